"""Golden values and logits-gradients for the full-vocabulary forward KL."""

import numpy as np

from jaxrl_llm import losses
from tests.losses.test_opd_reverse_kl_full import (B, N, dense_case, dense_inputs, logits_grad, np_kl,
                                                   np_logsoftmax)

SPEC = losses.get("opd_forward_kl")


def test_golden_value_and_gradient():
  zs, zt, mask = dense_case()
  inputs = dense_inputs(zs, zt, mask)
  loss_BN, aux = SPEC.fn(inputs, SPEC.Hparams())
  m = mask > 0
  lq, lp = np_logsoftmax(np.where(m[..., None], zs, 0)), np_logsoftmax(np.where(m[..., None], zt, 0))
  p = np.exp(lp)
  want = np.where(m, (p * np.where(p > 0, lp - lq, 0.0)).sum(-1), 0.0)  # the p = 0 entry contributes 0
  np.testing.assert_allclose(np.asarray(loss_BN), want, rtol=1e-5, atol=1e-6)
  # d/dz KL(p‖q) = q − p (token-mean: / N).
  gz = (np.exp(lq) - p) * (m[..., None] / m.sum())
  np.testing.assert_allclose(logits_grad(SPEC, inputs, SPEC.Hparams()), gz, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(aux["kl_fwd"][0]), want.sum(), rtol=1e-5)


def test_seq_mean_token_mean_gradient():
  zs, zt, mask = dense_case(5)
  inputs = dense_inputs(zs, zt, mask)
  m = mask > 0
  lq, lp = np_logsoftmax(np.where(m[..., None], zs, 0)), np_logsoftmax(np.where(m[..., None], zt, 0))
  L = m.sum(-1, keepdims=True)
  gz = (np.exp(lq) - np.exp(lp)) * (m / L / B)[..., None]
  np.testing.assert_allclose(logits_grad(SPEC, inputs, SPEC.Hparams(), "seq-mean-token-mean"), gz, rtol=1e-4, atol=1e-6)


def test_forward_differs_from_reverse_and_is_nonnegative():
  zs, zt, mask = dense_case(6)
  inputs = dense_inputs(zs, zt, mask)
  f = np.asarray(SPEC.fn(inputs, SPEC.Hparams())[0])
  r = np.asarray(losses.get("opd_reverse_kl_full").fn(inputs, SPEC.Hparams())[0])
  assert np.all(f >= -1e-6) and np.all(r >= -1e-6)
  assert np.abs(f - r).max() > 1e-2  # the directions are genuinely different
  lq, lp = np_logsoftmax(np.where(mask[..., None] > 0, zs, 0)), np_logsoftmax(np.where(mask[..., None] > 0, zt, 0))
  np.testing.assert_allclose(f[1, 0], np_kl(lp, lq)[1, 0], rtol=1e-5)
  assert f.shape == (B, N)
