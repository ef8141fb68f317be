"""Golden values/gradients for the GKD generalised JSD and its β→0 / β→1 limits."""

import numpy as np
import pytest

from jaxrl_llm import losses
from tests.losses.test_opd_reverse_kl_full import (dense_case, dense_inputs, logits_grad, np_kl, np_logsoftmax,
                                                   softmax_grad)

SPEC = losses.get("gkd_jsd")
HP = SPEC.Hparams


def _np(zs, zt, mask):
  m = mask > 0
  return m, np_logsoftmax(np.where(m[..., None], zs, 0)), np_logsoftmax(np.where(m[..., None], zt, 0))


def _finite_case(seed):
  zs, zt, mask = dense_case(seed)
  # No near-zero teacher entries: the β→1 limit is not uniform where p ≪ (1−β)q.
  zt = np.where(np.isfinite(zt), zt, -3.0).astype(np.float32)
  zt[1, 2] = -np.inf
  return zs, zt, mask


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_golden_value_and_gradient(beta):
  zs, zt, mask = dense_case(0)
  inputs = dense_inputs(zs, zt, mask)
  m, lq, lp = _np(zs, zt, mask)
  p, q = np.exp(lp), np.exp(lq)
  M = beta * p + (1 - beta) * q
  lm = np.log(M)
  kl_pm = (p * np.where(p > 0, lp - lm, 0.0)).sum(-1)
  want = np.where(m, beta * kl_pm + (1 - beta) * np_kl(lq, lm), 0.0)
  loss_BN, _ = SPEC.fn(inputs, HP(teacher_weight=beta))
  np.testing.assert_allclose(np.asarray(loss_BN), want, rtol=1e-5, atol=1e-6)
  # ∂JSD/∂q_v = (1−β)(log q_v − log M_v).
  gz = softmax_grad(lq, (1 - beta) * (lq - lm)) * (m[..., None] / m.sum())
  np.testing.assert_allclose(logits_grad(SPEC, inputs, HP(teacher_weight=beta)), gz, rtol=1e-4, atol=1e-6)


def test_endpoints_are_forward_and_reverse_kl():
  zs, zt, mask = _finite_case(1)
  inputs = dense_inputs(zs, zt, mask)
  fwd = losses.get("opd_forward_kl").fn(inputs, losses.get("opd_forward_kl").Hparams())[0]
  rev = losses.get("opd_reverse_kl_full").fn(inputs, losses.get("opd_reverse_kl_full").Hparams())[0]
  np.testing.assert_allclose(np.asarray(SPEC.fn(inputs, HP(teacher_weight=0.0))[0]), np.asarray(fwd), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(SPEC.fn(inputs, HP(teacher_weight=1.0))[0]), np.asarray(rev), rtol=1e-6)


def test_limits_match_forward_and_reverse_kl():
  """JSD_β/β → KL(p‖q) as β→0 and JSD_β/(1−β) → KL(q‖p) as β→1 (values and logits-gradients)."""
  zs, zt, mask = _finite_case(2)
  inputs = dense_inputs(zs, zt, mask)
  m, lq, lp = _np(zs, zt, mask)
  eps = 1e-4
  small = np.asarray(SPEC.fn(inputs, HP(teacher_weight=eps))[0]) / eps
  large = np.asarray(SPEC.fn(inputs, HP(teacher_weight=1 - eps))[0]) / eps
  np.testing.assert_allclose(small[m], np_kl(lp, lq)[m], rtol=2e-2)
  np.testing.assert_allclose(large[m], np_kl(lq, lp)[m], rtol=2e-2)
  g_small = logits_grad(SPEC, inputs, HP(teacher_weight=eps)) / eps
  g_fwd = (np.exp(lq) - np.exp(lp)) * (m[..., None] / m.sum())
  np.testing.assert_allclose(g_small, g_fwd, rtol=5e-2, atol=2e-3)
  g_large = logits_grad(SPEC, inputs, HP(teacher_weight=1 - eps)) / eps
  g_rev = softmax_grad(lq, lq - lp + 1.0) * (m[..., None] / m.sum())
  np.testing.assert_allclose(g_large, g_rev, rtol=5e-2, atol=2e-3)


def test_bounds_and_symmetry():
  zs, zt, mask = dense_case(3)
  m = mask > 0
  a = np.asarray(SPEC.fn(dense_inputs(zs, zt, mask), HP())[0])
  b = np.asarray(SPEC.fn(dense_inputs(zt, zs, mask), HP())[0])
  assert np.all(a[m] >= -1e-7) and np.all(a[m] <= np.log(2) + 1e-6)  # JSD_½ ≤ log 2
  np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)  # β = ½ is symmetric


def test_bad_beta_raises():
  zs, zt, mask = dense_case(0)
  with pytest.raises(ValueError, match="teacher_weight"):
    SPEC.fn(dense_inputs(zs, zt, mask), HP(teacher_weight=1.5))
