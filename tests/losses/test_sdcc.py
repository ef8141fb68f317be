"""Golden values/gradients for SDCC: PPO task term + λ·KL(teacher ‖ student) at eviction points."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import losses
from jaxrl_llm.losses import sdcc as mod
from tests.losses.test_opd_reverse_kl_full import B, N, dense_case, dense_inputs, logits_grad, np_logsoftmax

SPEC = losses.get("sdcc")


def _inputs(seed=0):
  zs, zt, mask = dense_case(seed)
  rng = np.random.default_rng(seed)
  logp = rng.uniform(-2, -0.1, (B, N)).astype(np.float32)
  prox = (logp - rng.normal(0, 0.3, (B, N))).astype(np.float32)
  adv = np.array([[1.0] * N, [-0.5] * N], np.float32)
  evict = np.array([[0, 1, 1], [1, 0, 1]], np.float32)  # (1, 2) is an eviction point but padding
  inp = dense_inputs(zs, zt, mask).replace(logp_BN=jnp.asarray(logp), prox_logp_BN=jnp.asarray(prox),
                                           adv_BN=jnp.asarray(adv), eviction_mask_BN=jnp.asarray(evict))
  return inp, zs, zt, mask, logp, prox, adv, evict


def test_golden_values_and_gradients():
  inp, zs, zt, mask, logp, prox, adv, evict = _inputs()
  hp = mod.Hparams(kl_coef=0.5)
  m = mask > 0
  lq, lp = np_logsoftmax(np.where(m[..., None], zs, 0)), np_logsoftmax(np.where(m[..., None], zt, 0))
  p = np.exp(lp)
  kl = (p * np.where(p > 0, lp - lq, 0.0)).sum(-1)
  e = (evict > 0) & m
  r = np.exp(logp.astype(np.float64) - prox)
  unc, clp = -adv * r, -adv * np.clip(r, 0.8, 1.2)
  use = clp > unc
  task = np.where(use, clp, unc)
  want = np.where(m, task + 0.5 * np.where(e, kl, 0.0), 0.0)
  loss_BN, aux = SPEC.fn(inp, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), want, rtol=1e-5, atol=1e-6)
  gz = 0.5 * (np.exp(lq) - p) * (e[..., None] / m.sum())
  np.testing.assert_allclose(logits_grad(SPEC, inp, hp), gz, rtol=1e-4, atol=1e-6)
  gl = jax.grad(lambda l: losses.reduce(SPEC.fn(inp.replace(logp_BN=l), hp)[0], inp.mask_BN))(inp.logp_BN)
  np.testing.assert_allclose(np.asarray(gl), np.where(m & ~use, -adv * r, 0.0) / m.sum(), rtol=1e-5, atol=1e-7)
  assert float(aux["eviction_frac"][0]) == 3.0


def test_lambda_zero_is_the_naive_compressed_task_loss():
  inp = _inputs(1)[0]
  ppo = losses.get("ppo_clip")
  np.testing.assert_allclose(np.asarray(SPEC.fn(inp, mod.Hparams(kl_coef=0.0))[0]),
                             np.asarray(ppo.fn(inp, ppo.Hparams())[0]), rtol=1e-6)
  np.testing.assert_array_equal(logits_grad(SPEC, inp, mod.Hparams(kl_coef=0.0)), 0.0)


def test_no_eviction_points_no_kl_gradient():
  inp = _inputs(2)[0]
  inp = inp.replace(eviction_mask_BN=jnp.zeros((B, N)))
  np.testing.assert_array_equal(logits_grad(SPEC, inp, mod.Hparams()), 0.0)
