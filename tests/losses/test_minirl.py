"""Golden values and gradients for MiniRL (untruncated π_θ/μ with a one-sided PPO mask)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import minirl as minirl_mod
from jaxrl_llm.types import LossInputs
from ._util import mismatch_inputs

SPEC = losses.get("minirl")
HP = minirl_mod.Hparams()


def _grad(inputs, hp, mode="token-mean", spec=SPEC):
  def f(lp):
    return losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  """Masked by M: (0,1) Â>0, r = e^0.3 > 1.27; (1,0) Â<0, r = e^-0.3 < 0.8.
  Kept: (0,2) Â<0, r = e^0.3 (no mask on that side); (1,1) Â>0, r = e^-0.3; (0,3) r = e^0.2 < 1.27.
  ρ = e^2 at (1,2) is not truncated. Row 2 holds -inf padding after two tokens."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0]], np.float32)
  lr = np.array([[0.05, 0.3, 0.3, 0.2], [-0.3, -0.3, 0.1, -0.05], [0.25, -0.02, 0.0, 0.0]])  # log π_θ/π_old
  lrho = np.array([[0.0, 0.5, -0.5, 0.3], [0.9, -1.0, 2.0, 0.0], [0.1, 0.4, 0.0, 0.0]])  # log π_old/μ
  adv = np.array([[1.0, 1.0, -1.0, 1.0], [-1.5, 0.7, -2.0, 0.4], [-0.8] * 4], np.float32)
  mask = np.ones((3, 4), np.float32)
  mask[2, 2:] = 0
  prox = (logp - lr).astype(np.float32)
  behav = (prox - lrho).astype(np.float32)
  for x in (logp, prox, behav):
    x[2, 2:] = -np.inf
  return logp, prox, behav, adv, mask


_inputs = mismatch_inputs


def _golden(logp, prox, behav, adv, mask, hp):
  m = mask > 0
  f64 = lambda x: np.where(m, x.astype(np.float64), 0.0)
  lp, px, bh = f64(logp), f64(prox), f64(behav)
  rho, r = np.exp(px - bh), np.exp(lp - px)
  drop = ((adv > 0) & (r > 1 + hp.eps_high)) | ((adv < 0) & (r < 1 - hp.eps_low))
  keep = m & ~drop
  val = np.where(keep, -rho * r * adv, 0.0)
  return val, val / mask.sum(), keep  # ∂(-ρ r Â)/∂log π_θ = -ρ r Â


def test_golden_values_and_gradients():
  case = _case()
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, HP)
  val, grad, keep = _golden(*case, HP)
  np.testing.assert_array_equal(keep, np.array([[1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 0, 0]], bool))
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, HP)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert g[0, 1] == 0 and g[1, 0] == 0 and np.all(g[2, 2:] == 0) and np.all(np.isfinite(g))
  # Gradient is -(π_θ/μ)·Â·∇log π_θ, untruncated: at (1,2) π_θ/μ = e^{2.1}.
  np.testing.assert_allclose(g[1, 2], 2.0 * np.exp(2.1) / case[4].sum(), rtol=1e-5)
  assert float(aux["masked_frac"][0]) == 2.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_on_policy_equals_pg(agg):
  logp, _, _, adv, mask = _case()
  inputs = _inputs(logp, logp, logp, adv, mask)
  pg = losses.get("pg")
  np.testing.assert_allclose(_grad(inputs, HP, agg), _grad(inputs, pg.Hparams(), agg, spec=pg), rtol=1e-6, atol=1e-8)


def test_mask_uses_recomputed_ratio_not_total():
  # π_θ = π_old (r = 1) but π_old/μ = e^1: nothing is masked, the whole gradient carries ρ.
  logp, _, _, adv, mask = _case()
  behav = np.where(mask > 0, logp - 1.0, -np.inf).astype(np.float32)
  inputs = _inputs(logp, logp, behav, adv, mask)
  _, aux = SPEC.fn(inputs, HP)
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), mask)
  pg = losses.get("pg")
  np.testing.assert_allclose(_grad(inputs, HP), np.e * _grad(inputs, pg.Hparams(), spec=pg), rtol=1e-5)
