"""Golden values and logits-gradients for the full-vocabulary reverse KL (and shared dense helpers)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import losses
from jaxrl_llm.types import LossInputs

SPEC = losses.get("opd_reverse_kl_full")
B, N, V = 2, 3, 5


def np_logsoftmax(z):
  z = z.astype(np.float64)
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def np_kl(la, lb):
  a = np.exp(la)
  return (a * np.where(a > 0, la - lb, 0.0)).sum(-1)


def softmax_grad(lq, g):
  """d f / d logits for f(q), q = softmax(logits), given g = ∂f/∂q: q·(g − Σ q g)."""
  q = np.exp(lq)
  return q * (g - (q * g).sum(-1, keepdims=True))


def dense_case(seed=0):
  """Student/teacher logits, a mask with one padded position whose logits are -inf / NaN."""
  rng = np.random.default_rng(seed)
  zs = rng.normal(0, 1.5, (B, N, V)).astype(np.float32)
  zt = rng.normal(0, 1.5, (B, N, V)).astype(np.float32)
  zt[0, 1, 2] = -np.inf  # a teacher zero inside the mask (p = 0 entry)
  mask = np.ones((B, N), np.float32)
  mask[1, 2] = 0
  zs[1, 2] = np.nan
  zt[1, 2] = -np.inf
  return zs, zt, mask


def dense_inputs(zs, zt, mask):
  logp = np.zeros((B, N), np.float32)
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.zeros((B, N)),
                    student_logits_BNV=jnp.asarray(zs), teacher_logits_BNV=jnp.asarray(zt))


def logits_grad(spec, inputs, hp, mode="token-mean"):
  def f(z):
    return losses.reduce(spec.fn(inputs.replace(student_logits_BNV=z), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.student_logits_BNV))


def test_golden_value_and_gradient():
  zs, zt, mask = dense_case()
  inputs = dense_inputs(zs, zt, mask)
  hp = SPEC.Hparams()
  loss_BN, aux = SPEC.fn(inputs, hp)
  m = mask > 0
  lq, lp = np_logsoftmax(np.where(m[..., None], zs, 0)), np_logsoftmax(np.where(m[..., None], zt, 0))
  d = np.clip(lq - lp, -20, 20)  # the teacher zero costs q·20
  want = np.where(m, (np.exp(lq) * d).sum(-1), 0.0)
  np.testing.assert_allclose(np.asarray(loss_BN), want, rtol=1e-5, atol=1e-6)
  assert want[0, 1] > 0 and np.isfinite(want).all()
  # Gradient of Σ q (log q − log p) w.r.t. logits: g = d + 1 where unclamped, 1 where clamped.
  g_q = np.where(np.abs(lq - lp) < 20, lq - lp + 1.0, 20.0)
  gz = softmax_grad(lq, g_q) * (m[..., None] / m.sum())
  got = logits_grad(SPEC, inputs, hp)
  np.testing.assert_allclose(got, gz, rtol=1e-4, atol=1e-6)
  assert np.all(got[1, 2] == 0.0) and np.isfinite(got).all()
  np.testing.assert_allclose(float(aux["kl_rev"][0]), want.sum(), rtol=1e-5)


def test_grad_wrt_logp_is_zero_and_equal_distributions_give_zero():
  zs, _, mask = dense_case(1)
  inputs = dense_inputs(zs, zs + 3.0, mask)  # same distribution (shifted logits)
  loss_BN, _ = SPEC.fn(inputs, SPEC.Hparams())
  np.testing.assert_allclose(np.asarray(loss_BN), 0.0, atol=1e-6)
  np.testing.assert_allclose(logits_grad(SPEC, inputs, SPEC.Hparams()), 0.0, atol=1e-7)
  g = jax.grad(lambda lp: losses.reduce(SPEC.fn(inputs.replace(logp_BN=lp), SPEC.Hparams())[0], inputs.mask_BN))(
      inputs.logp_BN)
  np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_empty_mask_zero_loss_zero_grad():
  zs, zt, _ = dense_case(2)
  inputs = dense_inputs(zs, zt, np.zeros((B, N), np.float32))
  val = losses.reduce(SPEC.fn(inputs, SPEC.Hparams())[0], inputs.mask_BN)
  assert float(val) == 0.0
  np.testing.assert_array_equal(logits_grad(SPEC, inputs, SPEC.Hparams()), 0.0)


def test_temperature_scales_both_logits():
  zs, zt, mask = dense_case(3)
  inputs = dense_inputs(zs, zt, mask)
  a = SPEC.fn(inputs, SPEC.Hparams(temperature=2.0))[0]
  b = SPEC.fn(dense_inputs(zs / 2, zt / 2, mask), SPEC.Hparams())[0]
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
