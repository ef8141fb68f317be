"""Golden values and gradients for R²VPO (reconstruction, methods-rl §7.3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import r2vpo as r2
from jaxrl_llm.types import LossInputs

SPEC = losses.get("r2vpo")

LOGP = np.array([[-1.0, -0.5, -2.0, -np.inf],
                 [-1.2, -0.7, -0.3, -0.9],
                 [-np.inf, -0.4, -3.0, -1.0]], np.float32)
LR = np.array([[0.3, -0.2, 0.05, 0.0],
               [-0.6, 0.4, 0.0, 0.15],
               [0.0, 1.0, -0.35, 0.1]], np.float32)  # log(π_θ/π_old) on counted tokens
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]], np.float32)
ADV = np.array([[1.0] * 4, [-2.0] * 4, [0.5] * 4], np.float32)


def _inputs(lam, logp=LOGP, lr=LR, mask=MASK, adv=ADV):
  prox = np.where(mask > 0, logp - lr, -np.inf).astype(np.float32)
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    prox_logp_BN=jnp.asarray(prox), state=jnp.asarray(lam, jnp.float32))


def _value_and_grad(inputs, hp, mode="token-mean"):
  def f(lp):
    return losses.reduce(SPEC.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  v, g = jax.value_and_grad(f)(inputs.logp_BN)
  return float(v), np.asarray(g)


def _objective_np(lr, adv, mask, lam, delta):
  """Direct numpy objective and its analytic gradient w.r.t. logp (float64)."""
  m = mask > 0
  r = np.exp(lr.astype(np.float64))[m]
  a = adv.astype(np.float64)[m]
  n = m.sum()
  rbar = r.mean()
  var = ((r - rbar) ** 2).mean()
  obj = -(r * a).mean() + lam * (var - delta)
  g = np.zeros(mask.shape)
  g[m] = r * (-a / n + 2 * lam * (r - rbar) / n)  # ∂obj/∂r_t · ∂r_t/∂logp_t
  return obj, g, var


@pytest.mark.parametrize("lam", [0.0, 0.7, 5.0])
def test_token_mean_equals_objective_value_and_gradient(lam):
  hp = r2.Hparams(delta=0.03)
  inputs = _inputs(lam)
  v, g = _value_and_grad(inputs, hp)
  obj, g_np, var = _objective_np(LR, ADV, MASK, lam, hp.delta)
  np.testing.assert_allclose(v, obj, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g, g_np, rtol=1e-5, atol=1e-7)
  assert np.all(g[MASK == 0] == 0.0)
  _, aux = SPEC.fn(inputs, hp)
  np.testing.assert_allclose(float(aux["ratio_var"][0]), var, rtol=1e-5)
  np.testing.assert_allclose(float(aux["lambda"][0]), lam)


def test_per_token_values_are_documented_form():
  lam, hp = 0.7, r2.Hparams(delta=0.03)
  loss_BN, _ = SPEC.fn(_inputs(lam), hp)
  m = MASK > 0
  r = np.exp(LR.astype(np.float64))
  rbar = r[m].mean()
  want = np.where(m, -ADV * r + lam * ((r - rbar) ** 2 - hp.delta), 0.0)
  np.testing.assert_allclose(np.asarray(loss_BN), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lam,delta,expect", [
    (0.5, 0.01, "up"),  # Var > δ: λ grows by η(Var − δ)
    (0.01, 1.0, "zero"),  # Var ≪ δ: the step would go negative, projected to 0
    (2.0, 0.5, "down"),  # Var < δ: λ shrinks, stays positive
])
def test_dual_step(lam, delta, expect):
  hp = r2.Hparams(delta=delta, dual_lr=3.0)
  _, aux = SPEC.fn(_inputs(lam), hp)
  _, _, var = _objective_np(LR, ADV, MASK, lam, delta)
  want = max(0.0, lam + 3.0 * (var - delta))
  new = float(aux["state"])
  np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-7)
  assert {"up": new > lam, "zero": new == 0.0, "down": 0.0 < new < lam}[expect]


def test_state_gets_no_gradient_and_empty_batch_keeps_lambda():
  hp = r2.Hparams()
  inputs = _inputs(1.3, mask=np.zeros_like(MASK))
  loss_BN, aux = SPEC.fn(inputs, hp)
  assert float(aux["state"]) == pytest.approx(1.3)
  assert np.all(np.asarray(loss_BN) == 0.0)
  _, g = _value_and_grad(inputs, hp)
  assert np.all(g == 0.0)
  # d loss / d λ is not propagated (λ is a dual variable, updated only by the dual step)
  gl = jax.grad(lambda lam: losses.reduce(SPEC.fn(_inputs(0.0).replace(state=lam), hp)[0], jnp.asarray(MASK)))(
      jnp.asarray(0.5))
  assert float(gl) == 0.0


def test_init_state():
  assert float(SPEC.init_state(r2.Hparams(lambda_init=0.25))) == 0.25


def test_on_policy_is_pg_and_lambda_decays():
  hp = r2.Hparams(delta=0.02, dual_lr=10.0)
  inputs = _inputs(1.0, lr=np.zeros_like(LR))
  _, g = _value_and_grad(inputs, hp)
  np.testing.assert_allclose(g, np.where(MASK > 0, -ADV, 0.0) / MASK.sum(), rtol=1e-6, atol=1e-8)
  _, aux = SPEC.fn(inputs, hp)
  np.testing.assert_allclose(float(aux["state"]), 1.0 - 10.0 * 0.02, rtol=1e-6)


def test_variance_penalty_pulls_ratios_together():
  # With Â = 0 only the penalty acts: a small gradient step on logp must reduce Var(r).
  hp = r2.Hparams(delta=0.0)
  inputs = _inputs(1.0, adv=np.zeros_like(ADV))
  _, g = _value_and_grad(inputs, hp)
  lr2 = np.where(MASK > 0, LR - 0.5 * g, 0.0)  # prox is fixed, so a step on logp moves log r equally
  _, _, var0 = _objective_np(LR, ADV, MASK, 1.0, 0.0)
  _, _, var1 = _objective_np(lr2, ADV, MASK, 1.0, 0.0)
  assert var1 < var0


def test_extreme_ratios_and_inf_padding_are_finite():
  lr = np.where(np.arange(4)[None, :] % 2 == 0, 50.0, -50.0).repeat(3, 0).astype(np.float32)
  logp = np.where(MASK > 0, -0.01, -np.inf).astype(np.float32)
  inputs = _inputs(2.0, logp=logp, lr=lr)
  v, g = _value_and_grad(inputs, r2.Hparams())
  _, aux = SPEC.fn(inputs, r2.Hparams())
  assert np.isfinite(v) and np.all(np.isfinite(g)) and np.isfinite(float(aux["state"]))
  assert np.all(g[MASK == 0] == 0.0)


def test_stale_sequences_are_reweighted_not_dropped():
  """A sequence whose behaviour ratio π_old/μ has mean (ρ − 1)² = v above stale_delta keeps its surrogate gradient
  scaled by sqrt(stale_delta / v) (numpy golden); a fresh sequence (μ = π_old) and the variance penalty are
  untouched; stale_delta=0 (or no behaviour record) is the plain objective."""
  lam, hp = 0.7, r2.Hparams(delta=0.03, stale_delta=0.1)
  inputs = _inputs(lam)
  prox = np.asarray(inputs.prox_logp_BN)
  mu_shift = np.array([[0.0] * 4, [0.9, -0.8, 0.7, -0.6], [0.0, 0.05, -0.05, 0.0]], np.float32)  # log π_old − log μ
  stale = inputs.replace(behavior_logp_BN=jnp.asarray(np.where(MASK > 0, prox - mu_shift, -np.inf)))
  _, g_plain = _value_and_grad(inputs.replace(behavior_logp_BN=stale.behavior_logp_BN), r2.Hparams(delta=0.03,
                                                                                                     stale_delta=0.0))
  _, g = _value_and_grad(stale, hp)
  rho = np.exp(mu_shift.astype(np.float64))
  v = np.array([((rho[b] - 1) ** 2)[MASK[b] > 0].mean() for b in range(3)])
  w = np.where(v > hp.stale_delta, np.sqrt(hp.stale_delta / np.maximum(v, 1e-30)), 1.0)
  assert w[0] == 1.0 and w[2] == 1.0 and 0 < w[1] < 1  # only the second sequence is past the budget
  # the surrogate's part of the gradient scales by w; the penalty's part (λ ∂Var/∂logp) does not
  obj0, g_np0, _ = _objective_np(LR, ADV, MASK, 0.0, hp.delta)  # surrogate only
  want = g_plain + (w[:, None] - 1.0) * g_np0
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
  assert np.all(g[MASK == 0] == 0.0)
  _, aux = SPEC.fn(stale, hp)
  np.testing.assert_allclose(float(aux["stale_weight_mean"][0]) / float(aux["stale_weight_mean"][1]), w.mean(),
                             rtol=1e-5)
  np.testing.assert_allclose(float(aux["stale_reweighted_frac"][0]), 1.0)
  # fresh data (μ = π_old) and no behaviour record: the plain objective
  for fresh in (inputs.replace(behavior_logp_BN=inputs.prox_logp_BN), inputs):
    _, g_fresh = _value_and_grad(fresh, hp)
    _, g_off = _value_and_grad(fresh, r2.Hparams(delta=0.03, stale_delta=0.0))
    np.testing.assert_array_equal(g_fresh, g_off)
