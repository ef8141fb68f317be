"""Golden values/gradients for f-OPD (freshness-weighted sampled-token reverse KL + rollout anchor)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import f_opd as mod
from jaxrl_llm.losses import opd_reverse_kl
from tests.losses.test_opd_reverse_kl import _case, _golden, _inputs

SPEC = losses.get("f_opd")


def _f_inputs(case, lag, sup):
  return _inputs(*case).replace(lag_B=jnp.asarray(lag, jnp.int32), sup_drift_B=jnp.asarray(sup, jnp.float32))


def _grad(inputs, hp):
  f = lambda lp: losses.reduce(SPEC.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


@pytest.mark.parametrize("hp", [mod.Hparams(), mod.Hparams(alpha=0.5, beta=2.0, xi=0.1, reg_coef=0.0)], ids=["default", "alt"])
def test_golden_values_and_gradients(hp):
  case = _case()
  logp, prox, behav, teacher, mask = case
  lag, sup = np.array([0, 2, 1]), np.array([0.0, 0.04, 0.5])
  inputs = _f_inputs(case, lag, sup)
  m = mask > 0
  d = np.where(m, logp, 0).astype(np.float64) - np.where(m, behav, 0)  # log π_θ − log μ
  k3 = np.where(m, np.exp(d) - d - 1, 0.0)
  droll = k3.sum(-1) / m.sum(-1)
  f = np.exp(-hp.alpha * np.sqrt(droll) - hp.beta * np.sqrt(sup)) / (lag + 1)
  w = np.maximum(f - hp.xi, 0) / (1 - hp.xi)
  base_val, base_grad = _golden(*case, opd_reverse_kl.Hparams())
  val = w[:, None] * base_val + hp.reg_coef * k3
  grad = w[:, None] * base_grad + np.where(m, hp.reg_coef * (np.exp(d) - 1), 0.0) / mask.sum()
  loss_BN, aux = SPEC.fn(inputs, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_grad(inputs, hp), grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(aux["freshness"][0]) / 3, f.mean(), rtol=1e-5)
  assert w[0] > max(w[1], w[2])  # the fresh row outweighs stale, drifted ones
  assert (w[1] == 0.0) == (hp.xi == 0.2)  # row 1 (f ≈ 0.12) is gated out at ξ = 0.2, kept at ξ = 0.1


def test_on_policy_fresh_equals_opd_reverse_kl():
  logp, _, _, teacher, mask = _case()
  case = (logp, logp, logp, teacher, mask)
  inputs = _f_inputs(case, [0, 0, 0], [0.0, 0.0, 0.0])
  base = losses.get("opd_reverse_kl")
  g_base = jax.grad(lambda lp: losses.reduce(base.fn(inputs.replace(logp_BN=lp), base.Hparams())[0], inputs.mask_BN))(
      inputs.logp_BN)
  np.testing.assert_allclose(_grad(inputs, mod.Hparams()), np.asarray(g_base), rtol=1e-6, atol=1e-8)


def test_stale_samples_below_the_gate_get_no_task_gradient():
  case = _case()
  inputs = _f_inputs(case, [9, 9, 9], [0.0, 0.0, 0.0])  # f ≤ 1/10 < ξ = 0.2
  g = _grad(inputs, mod.Hparams(reg_coef=0.0))
  np.testing.assert_array_equal(g, 0.0)


def test_freshness_helpers():
  f = mod.freshness(jnp.asarray([0, 1, 3]), jnp.asarray([0.0, 0.25, 1.0]), jnp.asarray([0.0, 0.0, 0.04]), 1.0, 1.0)
  np.testing.assert_allclose(np.asarray(f), [1.0, np.exp(-0.5) / 2, np.exp(-1.0 - 0.2) / 4], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(mod.freshness_gate(jnp.asarray([1.0, 0.2, 0.1]), 0.2)), [1.0, 0.0, 0.0])
  assert bool(mod.should_refresh(jnp.asarray([0.1, 0.2, 9.0]), jnp.asarray([1, 1, 0]), 0.3))
  assert not bool(mod.should_refresh(jnp.asarray([0.5, 0.4]), jnp.asarray([1, 1]), 0.3))


def test_refresh_buffer_asks_for_a_flush_when_mean_freshness_falls_below_the_threshold():
  """Control (c): `refresh_buffer` is 1 exactly when the batch's mean freshness (rows with tokens) is below
  `refresh_below`; with the default 0 the metric is absent (the loop never flushes)."""
  logp, _, _, teacher, mask = _case()
  inputs = _f_inputs((logp, logp, logp, teacher, mask), [0, 1, 3], [0.0, 0.0, 0.0])  # D_roll = 0: f = 1, 1/2, 1/4
  mean_f = (1 + 1 / 2 + 1 / 4) / 3
  assert "refresh_buffer" not in SPEC.fn(inputs, mod.Hparams())[1]
  for threshold, want in ((mean_f - 0.01, 0.0), (mean_f + 0.01, 1.0)):
    flag, count = SPEC.fn(inputs, mod.Hparams(refresh_below=threshold))[1]["refresh_buffer"]
    assert (float(flag), float(count)) == (want, 1.0)
