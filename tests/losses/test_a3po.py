"""Golden values and gradients for A-3PO (interpolated proximal policy + decoupled PPO)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import a3po as a3po_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("a3po")
CURRENT = 5
VERSIONS = np.array([[4, 3, 1, -1], [5, 5, 2, 0], [4, 4, 0, 0]], np.int32)
ALPHA = np.array([[0.0, 0.5, 0.75, 0.0], [0.0, 0.0, 2 / 3, 0.8], [0.0, 0.0, 0.8, 0.8]])


def _grad(inputs, hp, mode="token-mean", spec=SPEC, **kw):
  def f(lp):
    out = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(out[0], inputs.mask_BN, mode, keep_BN=out[1].get("keep_BN"), **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  """Δ = log π_θ - log μ. With the default loglinear method r = e^{(1-α)Δ} and w = e^{αΔ}:
  clip triggers at (0,1), (0,3), (1,2); the behaviour filter (w > 5) masks (1,3); row 2 pads with -inf."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0]], np.float32)
  delta = np.array([[0.1, 0.8, -0.6, 0.5], [0.3, -0.2, 0.6, 2.5], [-0.1, 0.2, 0.0, 0.0]])
  adv = np.array([[1.0, 1.0, -1.0, 1.0], [-0.5, 2.0, 1.0, -1.0], [0.7] * 4], np.float32)
  mask = np.ones((3, 4), np.float32)
  mask[2, 2:] = 0
  behav = (logp - delta).astype(np.float32)
  logp[2, 2:] = -np.inf
  behav[2, 2:] = -np.inf
  return logp, behav, adv, mask


def _inputs(logp, behav, adv, mask, versions=VERSIONS, current=CURRENT):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    behavior_logp_BN=jnp.asarray(behav), versions_BN=jnp.asarray(versions),
                    current_version=jnp.asarray(current, jnp.int32))


def _golden(logp, behav, adv, mask, hp, alpha=ALPHA):
  m = mask > 0
  lp = np.where(m, logp.astype(np.float64), 0.0)
  bh = np.where(m, behav.astype(np.float64), 0.0)
  if hp.prox_method == "loglinear":
    px = bh + alpha * (lp - bh)
  else:
    px = np.log((1 - alpha) * np.exp(bh) + alpha * np.exp(lp))
  w = np.exp(px - bh)
  keep = m & (w <= hp.filter_upper)
  w = np.where(keep, w, 0.0)
  r = np.exp(lp - px)
  unc, clp = -adv * r, -adv * np.clip(r, 1 - hp.eps_low, 1 + hp.eps_high)
  use_clip = clp > unc
  val = w * np.where(use_clip, clp, unc)
  d = w * np.where(use_clip, 0.0, -adv * r)  # π_prox is detached, so ∂r/∂log π_θ = r
  return np.where(m, val, 0.0), np.where(m, d / mask.sum(), 0.0), keep


def test_alpha_golden():
  got = np.asarray(a3po_mod.interpolation_weight(jnp.asarray(VERSIONS), jnp.asarray(CURRENT)))
  np.testing.assert_allclose(got, ALPHA, rtol=1e-6, atol=0)
  # Lag 1 gives 0, lag n gives (n-1)/n; a version ahead of the learner gets 0 (AReaL), not the
  # clamped formula (4-6)/(5-6) = 2 -> 1.
  got = np.asarray(a3po_mod.interpolation_weight(jnp.array([[6, 4, 0, 2, 9]]), jnp.asarray(5)))
  np.testing.assert_allclose(got, [[0.0, 0.0, 0.8, 2 / 3, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_newer_than_learner_token_is_anchored_on_behavior(method):
  """v_μ > v_θ: α = 0, so π_prox = μ, w = 1 and r = π_θ/μ clips (Δ = 0.8, Â > 0); α = 1 would give
  r = 1 (never clipped) and a nonzero gradient -Â·e^{0.8}."""
  case = _case()
  versions = VERSIONS.copy()
  versions[0, 1] = CURRENT + 1
  alpha = ALPHA.copy()
  alpha[0, 1] = 0.0
  hp = a3po_mod.Hparams(prox_method=method)
  inputs = _inputs(*case, versions=versions)
  loss_BN, _ = SPEC.fn(inputs, hp)
  val, grad, _ = _golden(*case, hp, alpha=alpha)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert g[0, 1] == 0.0
  np.testing.assert_allclose(val[0, 1], -1.2, rtol=1e-6)  # -Â·(1 + ε_high), w = 1


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_golden_values_and_gradients(method):
  case = _case()
  hp = a3po_mod.Hparams(prox_method=method)
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, hp)
  val, grad, keep = _golden(*case, hp)
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  assert keep[1, 3] == 0 and keep.sum() == case[3].sum() - 1
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert np.all(np.isfinite(g)) and np.all(g[2, 2:] == 0) and g[1, 3] == 0
  if method == "loglinear":
    assert g[0, 1] == 0 and g[0, 3] == 0 and g[1, 2] == 0  # clipped
  assert g[0, 3] == 0  # α = 0 (prompt version -1): r = π_θ/μ = e^0.5 > 1.2 with Â > 0 in both methods


def test_loglinear_value_identities():
  # In value w = e^{αΔ} and r = e^{(1-α)Δ}, and an unclipped kept token's gradient is -Â·e^{Δ}.
  logp, behav, adv, mask = _case()
  g = _grad(_inputs(logp, behav, adv, mask), a3po_mod.Hparams())
  delta = logp[0, 2].astype(np.float64) - behav[0, 2]
  np.testing.assert_allclose(g[0, 2], -adv[0, 2] * np.exp(delta) / mask.sum(), rtol=1e-5)


def test_lag_one_reduces_to_ppo_anchored_on_behavior():
  logp, behav, adv, mask = _case()
  versions = np.full_like(VERSIONS, CURRENT - 1)
  inputs = _inputs(logp, behav, adv, mask, versions)
  ppo = losses.get("ppo_clip")
  ppo_inputs = inputs.replace(prox_logp_BN=jnp.asarray(behav))
  hp = a3po_mod.Hparams()
  a, _ = SPEC.fn(inputs, hp)
  b, _ = ppo.fn(ppo_inputs, ppo.Hparams())
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(_grad(inputs, hp), _grad(ppo_inputs, ppo.Hparams(), spec=ppo), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("method", ["loglinear", "linear"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_equals_pg(method, agg):
  logp, _, adv, mask = _case()
  inputs = _inputs(logp, logp, adv, mask)
  pg = losses.get("pg")
  got = _grad(inputs, a3po_mod.Hparams(prox_method=method), agg)
  np.testing.assert_allclose(got, _grad(inputs, pg.Hparams(), agg, spec=pg), rtol=1e-6, atol=1e-8)


def test_bad_method_raises():
  with pytest.raises(ValueError, match="prox_method"):
    a3po_mod.Hparams(prox_method="cubic")
