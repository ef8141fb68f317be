"""Golden values and gradients for VESPO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import vespo as vespo_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("vespo")
HP = vespo_mod.Hparams()


def _grad(inputs, hp, mode="token-mean", spec=SPEC):
  def f(lp):
    return losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  logp = np.array([[-1.0, -0.5, -2.0, -0.3],
                   [-1.2, -0.7, -np.inf, -np.inf],
                   [-0.4, -3.0, -1.0, -1.5],
                   [-0.4, -0.1, -1.0, -1.5],
                   [-np.inf] * 4], np.float32)
  # Per-token log r; row 2 has a token beyond the ±20 token clamp and a sequence sum beyond ±20.
  lr = np.array([[0.1, 0.2, -0.1, 0.3],
                 [-0.4, 0.1, 0.0, 0.0],
                 [25.0, 5.0, 0.0, 1.0],
                 [-0.5, -0.6, 0.2, -0.1],
                 [0.0] * 4], np.float32)
  prox = (logp - lr).astype(np.float32)
  prox[1, 2:] = -np.inf
  mask = np.ones((5, 4), np.float32)
  mask[1, 2:] = 0
  mask[4] = 0
  # Row 3 has per-token advantages whose masked mean is negative although the first token is positive.
  adv = np.array([[1.0] * 4, [-2.0] * 4, [0.5] * 4, [0.3, -1.0, -1.0, -1.0], [1.0] * 4], np.float32)
  behav = (prox - np.array([0.05, -0.02, 0.0, 0.01], np.float32)).astype(np.float32)
  return logp, prox, behav, mask, adv, lr


def _inputs(logp, prox, behav, mask, adv):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    prox_logp_BN=jnp.asarray(prox), behavior_logp_BN=jnp.asarray(behav))


def _golden_phi(lr, mask, adv, hp, extra=None):
  m = mask > 0
  log_w = np.where(m, np.clip(lr.astype(np.float64), -20, 20), 0.0).sum(1)
  if extra is not None:
    log_w = log_w + np.where(m, extra, 0.0).sum(1)
  log_w = np.clip(log_w, -20, 20)
  a = (adv * m).sum(1) / np.maximum(m.sum(1), 1)
  k = np.where(a >= 0, hp.k_pos, hp.k_neg)
  lam = np.where(a >= 0, hp.lam_pos, hp.lam_neg)
  w = np.exp(log_w)
  return w ** k * np.exp(lam * (1 - w)), log_w


@pytest.mark.parametrize("tis", [False, True])
def test_golden_values_and_gradients(tis):
  logp, prox, behav, mask, adv, lr = _case()
  hp = vespo_mod.Hparams(tis=tis)
  inputs = _inputs(logp, prox, behav, mask, adv)
  loss_BN, aux = SPEC.fn(inputs, hp)
  with np.errstate(invalid="ignore"):
    extra = np.nan_to_num(prox.astype(np.float64) - behav) if tis else None
  phi, log_w = _golden_phi(lr, mask, adv, hp, extra)
  m = mask > 0
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(m, -phi[:, None] * adv * np.where(m, logp, 0), 0.0),
                             rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, np.where(m, -phi[:, None] * adv, 0.0) / mask.sum(), rtol=1e-5, atol=1e-9)
  assert np.all(np.isfinite(g)) and np.all(g[~m] == 0)
  # Row 2 hit the sequence clamp (+20): φ underflows to 0, the sample is dropped and counted.
  assert log_w[2] == 20.0 and np.all(g[2] == 0)
  s, c = aux["log_w_at_bound"]
  assert float(s) == 1.0 and float(c) == 4.0
  # Row 3 uses the negative kernel (masked-mean advantage < 0), not adv[:, 0] > 0.
  assert phi[3] != _golden_phi(lr, mask, np.abs(adv), hp, extra)[0][3]


def test_kernel_shape():
  log_w = jnp.log(jnp.array([1e-3, 0.5, 1.0, 2.0 / 3.0, 2.0, 1e3]))
  phi = np.asarray(vespo_mod.vespo_kernel(log_w, 2.0, 3.0))
  assert phi[2] == 1.0  # φ(1) = 1 exactly.
  assert phi[3] == phi.max()  # mode at W = k/λ.
  np.testing.assert_allclose(phi[0], 1e-6 * np.exp(3.0 * (1 - 1e-3)), rtol=1e-4)
  assert phi[5] == 0.0  # e^{-3000} underflows to exactly 0, no NaN.


def test_on_policy_equals_pg():
  logp, _, _, mask, adv, _ = _case()
  inputs = _inputs(logp, logp, logp, mask, adv)
  pg = losses.get("pg")
  for tis in (False, True):
    np.testing.assert_array_equal(_grad(inputs, vespo_mod.Hparams(tis=tis)), _grad(inputs, pg.Hparams(), spec=pg))


@pytest.mark.parametrize("cap", ["default", None, 1.5])
def test_tis_term_is_capped_per_token(cap):
  """The code adds log(rollout_is_weights) = per token log min(π_old/μ, C), C = 2 in the released scripts."""
  logp, prox, _, mask, adv, lr = _case()
  lr[2] = [0.3, -0.2, 0.0, 0.1]  # keep every row off the sequence clamp
  prox = (logp - lr).astype(np.float32)
  prox[1, 2:] = -np.inf
  log_rho = np.array([1.5, -0.3, 0.9, 0.6], np.float32)  # above and below log 2 = 0.693 and log 1.5
  behav = (prox - log_rho).astype(np.float32)
  hp = vespo_mod.Hparams(tis=True) if cap == "default" else vespo_mod.Hparams(tis=True, tis_cap=cap)
  c = 2.0 if cap == "default" else cap
  if cap == "default":
    assert hp.tis_cap == 2.0
  inputs = _inputs(logp, prox, behav, mask, adv)
  loss_BN, _ = SPEC.fn(inputs, hp)
  extra = np.broadcast_to(log_rho.astype(np.float64), mask.shape)
  if c is not None:
    extra = np.minimum(extra, np.log(c))
  phi, _ = _golden_phi(lr, mask, adv, hp, extra)
  m = mask > 0
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(m, -phi[:, None] * adv * np.where(m, logp, 0), 0.0),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_grad(inputs, hp), np.where(m, -phi[:, None] * adv, 0.0) / mask.sum(),
                             rtol=1e-5, atol=1e-9)
  if c is not None:  # the cap binds, so the result differs from the uncapped weight
    phi_raw, _ = _golden_phi(lr, mask, adv, hp, np.broadcast_to(log_rho.astype(np.float64), mask.shape))
    assert np.abs(phi_raw - phi).max() > 1e-2
