"""Golden values and gradients for IcePop (two-sided mask on k = π_old/μ, times PPO-clip)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import icepop as icepop_mod
from jaxrl_llm.losses import mis as mis_mod
from jaxrl_llm.types import LossInputs
from ._util import mismatch_inputs

SPEC = losses.get("icepop")
HP = icepop_mod.Hparams()


def _grad(inputs, hp, mode="token-mean", spec=SPEC, **kw):
  def f(lp):
    out = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(out[0], inputs.mask_BN, mode, keep_BN=out[1].get("keep_BN"), **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  """k below α at (0,1) and (1,3), above β at (1,0); inside the band elsewhere (including k = 4, 0.55).
  Clip triggers at (1,1) (A>0, r>1.2) and (1,2) (A<0, r<0.8); (0,3) is A<0 with r>1.2 (no clip).
  Row 2 holds -inf padding after two tokens."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0]], np.float32)
  lr = np.array([[0.05, -0.1, 0.0, 0.3], [0.0, 0.3, -0.3, -0.05], [0.25, -0.02, 0.0, 0.0]])  # log π_θ/π_old
  lk = np.log(np.array([[1.0, 0.3, 4.0, 0.55], [6.0, 1.3, 0.8, 0.45], [1.1, 2.0, 1.0, 1.0]]))  # log π_old/μ
  adv = np.array([[1.0, 1.0, 1.0, -0.5], [1.5, 0.7, -2.0, 0.4], [-0.8] * 4], np.float32)
  mask = np.ones((3, 4), np.float32)
  mask[2, 2:] = 0
  prox = (logp - lr).astype(np.float32)
  behav = (prox - lk).astype(np.float32)
  for x in (logp, prox, behav):
    x[2, 2:] = -np.inf
  return logp, prox, behav, adv, mask


_inputs = mismatch_inputs


def _golden(logp, prox, behav, adv, mask, hp):
  m = mask > 0
  f64 = lambda x: np.where(m, x.astype(np.float64), 0.0)
  lp, px, bh = f64(logp), f64(prox), f64(behav)
  k = np.exp(px - bh)
  keep = m & (k >= hp.alpha) & (k <= hp.beta)
  M = np.where(keep, k, 0.0)
  r = np.exp(lp - px)
  unc, clp = -adv * r, -adv * np.clip(r, 1 - hp.eps_low, 1 + hp.eps_high)
  use_clip = clp > unc
  val = M * np.maximum(unc, clp)
  d = M * np.where(use_clip, 0.0, -adv * r)
  return np.where(m, val, 0.0), np.where(m, d / mask.sum(), 0.0), keep


def test_golden_values_and_gradients():
  case = _case()
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, HP)
  val, grad, keep = _golden(*case, HP)
  np.testing.assert_array_equal(keep, np.array([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0]], bool))
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, HP)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  # Masked by the band, clipped by PPO, or padding: exactly zero. Kept and unclipped: weight k itself.
  assert g[0, 1] == 0 and g[1, 0] == 0 and g[1, 3] == 0 and g[1, 1] == 0 and g[1, 2] == 0
  assert np.all(g[2, 2:] == 0) and np.all(np.isfinite(g))
  n = case[4].sum()
  np.testing.assert_allclose(g[0, 2], -4.0 * 1.0 * 1.0 / n, rtol=1e-5)  # k = 4 inside [0.5, 5], r = 1
  assert float(aux["masked_frac"][0]) == 3.0 and float(aux["clip_frac"][0]) == 2.0


def test_rejected_tokens_stay_in_denominator_by_default():
  case = _case()
  inputs = _inputs(*case)
  _, grad, keep = _golden(*case, HP)
  np.testing.assert_allclose(_grad(inputs, HP), grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_grad(inputs, HP, drop_rejected=True), grad * case[4].sum() / keep.sum(),
                             rtol=1e-5, atol=1e-7)


def test_equals_mis_with_icepop_band():
  inputs = _inputs(*_case())
  hp_mis = mis_mod.Hparams(criteria=("token_k1",), lower=(0.5,), upper=(5.0,), is_level="token")
  a, aux_a = SPEC.fn(inputs, HP)
  b, aux_b = losses.get("mis").fn(inputs, hp_mis)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(aux_a["keep_BN"]), np.asarray(aux_b["keep_BN"]))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_equals_pg(agg):
  logp, _, _, adv, mask = _case()
  inputs = _inputs(logp, logp, logp, adv, mask)
  pg = losses.get("pg")
  np.testing.assert_allclose(_grad(inputs, HP, agg), _grad(inputs, pg.Hparams(), agg, spec=pg), rtol=1e-6, atol=1e-8)


def test_bad_band_raises():
  with pytest.raises(ValueError):
    icepop_mod.Hparams(alpha=2.0, beta=1.0)
