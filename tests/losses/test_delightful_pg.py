"""Golden values and gradients for Delightful Policy Gradient (addendum §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import delightful_pg as dg
from jaxrl_llm.types import LossInputs

SPEC = losses.get("delightful_pg")

LOGP = np.array([[-0.1, -4.0, -1.0, -np.inf],
                 [-6.0, -0.5, -2.0, -0.01],
                 [-np.inf, -3.0, -0.2, -1.5]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]], np.float32)
ADV = np.array([[1.0] * 4, [-1.5] * 4, [0.5, 0.5, -0.5, 2.0]], np.float32)


def _inputs(logp=LOGP, mask=MASK, adv=ADV):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv))


def _grad(inputs, hp, mode="token-mean"):
  def f(lp):
    return losses.reduce(SPEC.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _gate(logp, adv, mask, eta):
  lp = np.where(mask > 0, logp, 0.0).astype(np.float64)
  return np.where(mask > 0, 1.0 / (1.0 + np.exp(-adv * -lp / eta)), 0.0)


@pytest.mark.parametrize("eta", [1.0, 2.5])
def test_golden_values_gradients_and_gate_metric(eta):
  hp = dg.Hparams(eta=eta)
  inputs = _inputs()
  loss_BN, aux = SPEC.fn(inputs, hp)
  w = _gate(LOGP, ADV, MASK, eta)
  m = MASK > 0
  lp = np.where(m, LOGP, 0.0)
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(m, -w * ADV * lp, 0.0), rtol=1e-5, atol=1e-7)
  # token-mean: ∇ = −w·Â/N (gate detached)
  np.testing.assert_allclose(_grad(inputs, hp), np.where(m, -w * ADV, 0.0) / MASK.sum(), rtol=1e-5, atol=1e-8)
  # seq-mean-token-mean: ∇ = −w·Â/(L_b·B')
  L = MASK.sum(-1, keepdims=True)
  np.testing.assert_allclose(_grad(inputs, hp, "seq-mean-token-mean"), np.where(m, -w * ADV / L, 0.0) / 3,
                             rtol=1e-5, atol=1e-8)
  s, c = aux["gate_mean"]
  np.testing.assert_allclose(float(s) / float(c), w[m].mean(), rtol=1e-5)
  assert float(c) == MASK.sum()
  s, c = aux["delight_mean"]
  np.testing.assert_allclose(float(s) / float(c), (ADV * -lp)[m].mean(), rtol=1e-5)


def test_gate_is_not_differentiated():
  # If the gate were differentiated the gradient would pick up −Â·logp·∂w/∂logp; check the two differ,
  # and that ours is the detached one.
  inputs = _inputs()
  hp = dg.Hparams()
  g = _grad(inputs, hp)
  m = MASK > 0
  lp = np.where(m, LOGP, 0.0).astype(np.float64)
  w = _gate(LOGP, ADV, MASK, 1.0)
  dw = w * (1 - w) * (-ADV)  # ∂σ(−Â·logp)/∂logp
  full = np.where(m, -(w + dw * lp) * ADV, 0.0) / MASK.sum()
  assert np.abs(full - g).max() > 1e-3
  np.testing.assert_allclose(g, np.where(m, -w * ADV, 0.0) / MASK.sum(), rtol=1e-5, atol=1e-8)


def test_gate_properties():
  mask = np.ones((1, 4), np.float32)
  logp = np.array([[-12.0, -12.0, 0.0, -1e-6]], np.float32)
  adv = np.array([[1.0, -1.0, 1.0, -1.0]], np.float32)
  w, _ = dg.delight_gate(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), 1.0)
  w = np.asarray(w)[0]
  assert w[0] > 0.9999  # rare success: amplified (kept at full weight)
  assert w[1] < 1e-4  # rare failure: suppressed
  np.testing.assert_allclose(w[2:], 0.5, atol=1e-5)  # confident tokens: gate 1/2
  # η → ∞: gate → 1/2 everywhere, i.e. ½·PG
  w_inf, _ = dg.delight_gate(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), 1e9)
  np.testing.assert_allclose(np.asarray(w_inf), 0.5, atol=1e-6)


def test_on_policy_gradient_is_gated_pg_and_ignores_anchors():
  # DG has no ratio: adding prox/behavior log-probs changes nothing.
  inputs = _inputs()
  hp = dg.Hparams()
  g0 = _grad(inputs, hp)
  g1 = _grad(inputs.replace(prox_logp_BN=jnp.asarray(LOGP - 3.0), behavior_logp_BN=jnp.asarray(LOGP + 1.0)), hp)
  np.testing.assert_array_equal(g0, g1)
  m = MASK > 0
  pg = np.where(m, -ADV, 0.0) / MASK.sum()
  np.testing.assert_allclose(g0, _gate(LOGP, ADV, MASK, 1.0) * pg, rtol=1e-5, atol=1e-8)


def test_padding_with_inf_and_empty_mask_are_finite_with_zero_masked_grad():
  inputs = _inputs()
  g = _grad(inputs, dg.Hparams())
  assert np.all(np.isfinite(g)) and np.all(g[MASK == 0] == 0.0)
  empty = _inputs(mask=np.zeros_like(MASK))
  loss_BN, aux = SPEC.fn(empty, dg.Hparams())
  assert np.all(np.asarray(loss_BN) == 0.0)
  assert np.all(_grad(empty, dg.Hparams()) == 0.0)
  assert float(aux["gate_mean"][1]) == 0.0
