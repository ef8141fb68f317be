"""Golden values and gradients for truncated importance sampling (TIS)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import tis as tis_mod
from jaxrl_llm.types import LossInputs
from ._util import mismatch_inputs

SPEC = losses.get("tis")


def _grad(inputs, hp, mode="token-mean", spec=SPEC):
  def f(lp):
    return losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  """Rows: (0) A>0, unclipped r, token ρ = e^1.2 above C; (1) clip triggers on tokens 0,1, ρ_0 above C;
  (2) A<0 with r above 1+ε (no clip) and -inf padding on the last two positions."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0]], np.float32)
  lr = np.array([[0.05, -0.1, 0.0, 0.1], [0.3, -0.3, 0.1, -0.05], [0.25, -0.02, 0.0, 0.0]])  # log π_θ/π_old
  lrho = np.array([[0.0, 1.2, -0.5, 0.3], [0.9, -1.0, 0.2, 0.0], [0.1, 0.4, 0.0, 0.0]])  # log π_old/μ
  adv = np.array([[1.0] * 4, [1.5, -0.7, -2.0, 0.4], [-0.8] * 4], np.float32)
  mask = np.ones((3, 4), np.float32)
  mask[2, 2:] = 0
  prox = (logp - lr).astype(np.float32)
  behav = (prox - lrho).astype(np.float32)
  for x in (logp, prox, behav):
    x[2, 2:] = -np.inf
  return logp, prox, behav, adv, mask


_inputs = mismatch_inputs


def _np_surr(r, a, el, eh):
  """PPO loss max(-a r, -a clip(r)) and its derivative w.r.t. log π_θ (zero on the clipped branch)."""
  unc, clp = -a * r, -a * np.clip(r, 1 - el, 1 + eh)
  use_clip = clp > unc
  return np.where(use_clip, clp, unc), np.where(use_clip, 0.0, -a * r)


def _golden(logp, prox, behav, adv, mask, hp):
  m = mask > 0
  f64 = lambda x: np.where(m, x.astype(np.float64), 0.0)
  lp, px, bh = f64(logp), f64(prox), f64(behav)
  log_rho = (px - bh) if hp.mode == "decoupled" else (lp - bh)
  if hp.level == "sequence":
    log_rho = np.broadcast_to(log_rho.sum(1, keepdims=True), log_rho.shape)
  w = np.minimum(np.exp(log_rho), hp.cap)
  if hp.batch_normalize:
    w = w / (w[m].mean() if hp.level == "token" else w[mask.sum(1) > 0, 0].mean())
  if hp.mode == "decoupled":
    s, ds = _np_surr(np.exp(lp - px), adv, hp.eps_low, hp.eps_high)
    val, d = w * s, w * ds
  else:
    val, d = -w * adv * lp, -w * adv
  n = mask.sum()
  return np.where(m, val, 0.0), np.where(m, d / n, 0.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("batch_normalize", [False, True])
def test_golden_values_and_gradients(level, mode, batch_normalize):
  case = _case()
  hp = tis_mod.Hparams(level=level, mode=mode, batch_normalize=batch_normalize)
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, hp)
  val, grad = _golden(*case, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert np.all(np.isfinite(g)) and np.all(g[case[4] == 0] == 0)


def test_truncation_and_clip_trigger():
  logp, prox, behav, adv, mask = _case()
  inputs = _inputs(logp, prox, behav, adv, mask)
  hp = tis_mod.Hparams()
  _, aux = SPEC.fn(inputs, hp)
  # Token ρ above C: (0,1) e^1.2 and (1,0) e^0.9.
  assert float(aux["is_truncated_frac"][0]) == 2.0
  assert float(aux["clip_frac"][0]) == 2.0  # (1,0) and (1,1)
  g = _grad(inputs, hp)
  n = mask.sum()
  # Truncated token: weight exactly C times the unclipped PPO gradient -A·r.
  r01 = np.exp(np.float64(logp[0, 1]) - prox[0, 1])
  np.testing.assert_allclose(g[0, 1], -2.0 * 1.0 * r01 / n, rtol=1e-5)
  assert g[1, 0] == 0 and g[1, 1] == 0
  # Sequence level: Σ log ρ of row 0 is 1.0 -> e > C -> every token of row 0 has weight C.
  seq = SPEC.fn(inputs, tis_mod.Hparams(level="sequence"))[1]
  np.testing.assert_allclose(float(seq["is_weight"][0]), (4 * 2.0 + 4 * np.exp(0.1) + 2 * np.exp(0.5)), rtol=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_equals_pg(level, mode, agg):
  logp, _, _, adv, mask = _case()
  inputs = _inputs(logp, logp, logp, adv, mask)
  pg = losses.get("pg")
  want = _grad(inputs, pg.Hparams(), agg, spec=pg)
  got = _grad(inputs, tis_mod.Hparams(level=level, mode=mode), agg)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_bypass_ignores_prox():
  logp, prox, behav, adv, mask = _case()
  hp = tis_mod.Hparams(mode="bypass")
  a = _grad(_inputs(logp, prox, behav, adv, mask), hp)
  b = _grad(_inputs(logp, np.zeros_like(prox), behav, adv, mask), hp)
  np.testing.assert_array_equal(a, b)


def test_all_padding_row_is_finite():
  logp = np.full((2, 3), -np.inf, np.float32)
  logp[0] = [-1.0, -2.0, -0.5]
  mask = np.zeros((2, 3), np.float32)
  mask[0] = 1
  adv = np.ones((2, 3), np.float32)
  for hp in (tis_mod.Hparams(level="sequence", batch_normalize=True), tis_mod.Hparams(mode="bypass")):
    inputs = _inputs(logp, logp, logp, adv, mask)
    loss_BN, _ = SPEC.fn(inputs, hp)
    g = _grad(inputs, hp)
    assert np.all(np.isfinite(np.asarray(loss_BN))) and np.all(np.isfinite(g))
    assert np.all(g[1] == 0)


def test_bad_hparams_raise():
  with pytest.raises(ValueError, match="level"):
    tis_mod.Hparams(level="geo")
  with pytest.raises(ValueError, match="mode"):
    tis_mod.Hparams(mode="x")
