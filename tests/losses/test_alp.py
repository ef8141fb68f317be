"""Golden values and gradients for the ALP loss (single clipped ratio π_{θ,δ}/μ)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import alp as alp_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("alp")


def _grad(inputs, hp, mode="token-mean", spec=SPEC):
  def f(lp):
    return losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  """Δ = log π_{θ,δ} - log μ. Sequence sums: row 0: 0.5 (unclipped); row 1: 1.6, ρ = 4.95 > 4 with Â>0
  (clipped); row 2: -0.9, ρ = 0.41 < 0.5 with Â<0 (clipped); row 3: 1.4, ρ = 4.06 > c = 3 with Â<0 (dual clip).
  Rows 2 and 3 hold -inf padding."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0],
                   [-0.2, -0.6, -1.0, 0.0]], np.float32)
  delta = np.array([[0.1, 0.2, -0.1, 0.3], [1.0, 0.8, 0.0, -0.2], [-0.5, -0.4, 0.0, 0.0], [0.6, 0.6, 0.2, 0.0]])
  adv = np.array([[1.0] * 4, [0.5] * 4, [-0.8] * 4, [-1.0] * 4], np.float32)
  mask = np.ones((4, 4), np.float32)
  mask[2, 2:] = 0
  mask[3, 3:] = 0
  behav = (logp - delta).astype(np.float32)
  pad = mask == 0
  logp[pad] = -np.inf
  behav[pad] = -np.inf
  return logp, behav, adv, mask


def _inputs(logp, behav, adv, mask):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    behavior_logp_BN=jnp.asarray(behav))


def _golden(logp, behav, adv, mask, hp):
  m = mask > 0
  d = np.where(m, logp.astype(np.float64), 0.0) - np.where(m, behav.astype(np.float64), 0.0)
  cnt = np.cumsum(m, axis=1)
  if hp.mode == "token":
    stat = d
  elif hp.mode == "sequence":
    stat = d.sum(1, keepdims=True) / (np.maximum(m.sum(1, keepdims=True), 1) if hp.geometric else 1)
    stat = np.broadcast_to(stat, d.shape)
  else:
    stat = np.cumsum(d, axis=1) / (np.maximum(cnt, 1) if hp.geometric else 1)
  rho = np.exp(stat)
  unc, clp = -adv * rho, -adv * np.clip(rho, 1 - hp.clip_low, 1 + hp.clip_high)
  use_clip = clp > unc
  loss, g = np.where(use_clip, clp, unc), np.where(use_clip, 0.0, -adv * rho)  # ∂log ρ_t/∂log π_t = 1
  dual = (adv < 0) & (loss > -adv * hp.dual_clip)
  loss, g = np.where(dual, -adv * hp.dual_clip, loss), np.where(dual, 0.0, g)
  return np.where(m, loss, 0.0), np.where(m, g / mask.sum(), 0.0)


@pytest.mark.parametrize("mode,geometric", [("token", False), ("sequence", False), ("sequence", True),
                                            ("cum_token", False), ("cum_token", True)])
def test_golden_values_and_gradients(mode, geometric):
  case = _case()
  hp = alp_mod.Hparams(mode=mode, geometric=geometric)
  inputs = _inputs(*case)
  loss_BN, _ = SPEC.fn(inputs, hp)
  val, grad = _golden(*case, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert np.all(np.isfinite(g)) and np.all(g[case[3] == 0] == 0)


def test_default_sequence_sum_clips_and_dual_clips():
  case = _case()
  hp = alp_mod.Hparams()
  assert hp.mode == "sequence" and not hp.geometric and (hp.clip_low, hp.clip_high, hp.dual_clip) == (0.5, 3.0, 3.0)
  loss_BN, aux = SPEC.fn(_inputs(*case), hp)
  g = _grad(_inputs(*case), hp)
  assert np.all(g[0] != 0) and np.all(g[1:] == 0)  # rows 1-3: clip high, clip low, dual clip
  np.testing.assert_allclose(np.asarray(loss_BN[3, :3]), 3.0, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(loss_BN[1]), -0.5 * 4.0, rtol=1e-6)
  assert float(aux["clip_frac"][0]) == case[3][1:].sum()
  # Every token of row 0 gets the whole-sequence ratio e^{0.5} (GSPO-token trick, sum not mean).
  np.testing.assert_allclose(g[0], -np.exp(0.5) / case[3].sum(), rtol=1e-5)


@pytest.mark.parametrize("mode", alp_mod.MODES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_unperturbed_on_policy_equals_pg(mode, agg):
  logp, _, adv, mask = _case()
  inputs = _inputs(logp, logp, adv, mask)
  pg = losses.get("pg")
  got = _grad(inputs, alp_mod.Hparams(mode=mode), agg)
  np.testing.assert_allclose(got, _grad(inputs, pg.Hparams(), agg, spec=pg), rtol=1e-6, atol=1e-8)


def test_bad_hparams_raise():
  with pytest.raises(ValueError, match="mode"):
    alp_mod.Hparams(mode="cum-turn")
