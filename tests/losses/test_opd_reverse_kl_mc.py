"""Golden values/gradients for the AsyncOPD multi-sample MC reverse-KL estimator, and its unbiasedness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import opd_reverse_kl_mc as mod
from jaxrl_llm.types import LossInputs
from tests.losses.test_opd_reverse_kl_full import np_logsoftmax

SPEC = losses.get("opd_reverse_kl_mc")
B, N, J, V = 2, 3, 4, 6


def _case(seed=0):
  rng = np.random.default_rng(seed)
  lq_all = np_logsoftmax(rng.normal(0, 1, (B, N, V)))
  lmu_all = np_logsoftmax(np.log(np.exp(lq_all)) + rng.normal(0, 0.4, (B, N, V)))
  lp_all = np_logsoftmax(rng.normal(0, 1, (B, N, V)))
  ids = rng.integers(0, V, (B, N, J)).astype(np.int32)
  g = lambda a: np.take_along_axis(a, ids, -1).astype(np.float32)
  lq, lmu, lp = g(lq_all), g(lmu_all), g(lp_all)
  mask = np.ones((B, N), np.float32)
  mask[1, 2] = 0
  for x in (lq, lmu, lp):
    x[1, 2] = -np.inf
  ids[0, 0, 3] = -1  # an invalid candidate slot
  lq[0, 0, 3] = lmu[0, 0, 3] = lp[0, 0, 3] = -np.inf
  return ids, lq, lmu, lp, mask


def _inputs(ids, lq, lmu, lp, mask, tokens=None):
  return LossInputs(logp_BN=jnp.zeros(mask.shape), mask_BN=jnp.asarray(mask), adv_BN=jnp.zeros(mask.shape),
                    mc_ids_BNJ=jnp.asarray(ids), mc_logp_BNJ=jnp.asarray(lq), mc_behavior_logp_BNJ=jnp.asarray(lmu),
                    mc_teacher_logp_BNJ=jnp.asarray(lp), tokens_BN=tokens)


def _grad(inputs, hp):
  f = lambda x: losses.reduce(SPEC.fn(inputs.replace(mc_logp_BNJ=x), hp)[0], inputs.mask_BN)
  return np.asarray(jax.grad(f)(inputs.mc_logp_BNJ))


@pytest.mark.parametrize("hp", [mod.Hparams(), mod.Hparams(online_advantage=False), mod.Hparams(eps_low=0.2, eps_high=0.2)],
                         ids=["default", "offline", "clipped"])
def test_golden_values_and_gradients(hp):
  ids, lq, lmu, lp, mask = _case()
  inputs = _inputs(ids, lq, lmu, lp, mask)
  ok = (ids >= 0) & np.isfinite(lq) & (mask[..., None] > 0)
  z = lambda x: np.where(ok, x, 0.0).astype(np.float64)
  q, mu, p = z(lq), z(lmu), z(lp)
  A = p - (q if hp.online_advantage else mu)
  r = np.exp(q - mu)
  unc, clp = -A * r, -A * np.clip(r, 1 - hp.eps_low, 1 + hp.eps_high)
  use = clp > unc
  n = np.maximum(ok.sum(-1), 1)
  val = np.where(mask > 0, np.where(ok, np.where(use, clp, unc), 0).sum(-1) / n, 0.0)
  dv = np.where(ok & ~use, -A * r, 0.0) / n[..., None] / mask.sum()
  np.testing.assert_allclose(np.asarray(SPEC.fn(inputs, hp)[0]), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, dv, rtol=1e-5, atol=1e-7)
  assert np.isfinite(g).all() and np.all(g[1, 2] == 0) and g[0, 0, 3] == 0
  if hp.eps_low < 1:
    assert use.any()  # the clip triggers in this case


def _dense_rev_grad(zs, zt):
  spec = losses.get("opd_reverse_kl_full")
  inp = LossInputs(logp_BN=jnp.zeros((1, 1)), mask_BN=jnp.ones((1, 1)), adv_BN=jnp.zeros((1, 1)),
                   teacher_logits_BNV=jnp.asarray(zt).reshape(1, 1, -1))
  return np.asarray(jax.grad(lambda z: spec.fn(inp.replace(student_logits_BNV=z.reshape(1, 1, -1)), spec.Hparams())[0].sum())(
      jnp.asarray(zs)))


def _mc_grad(zs, zt, lmu_all, ids, hp):
  """d loss / d student logits at one position with candidates `ids` drawn from μ."""
  lp_all = jax.nn.log_softmax(jnp.asarray(zt))

  def f(z):
    lq = jax.nn.log_softmax(z)[ids].reshape(1, 1, -1)
    inp = LossInputs(logp_BN=jnp.zeros((1, 1)), mask_BN=jnp.ones((1, 1)), adv_BN=jnp.zeros((1, 1)),
                     mc_ids_BNJ=jnp.asarray(ids).reshape(1, 1, -1), mc_logp_BNJ=lq,
                     mc_behavior_logp_BNJ=jnp.asarray(lmu_all)[ids].reshape(1, 1, -1),
                     mc_teacher_logp_BNJ=lp_all[ids].reshape(1, 1, -1))
    return SPEC.fn(inp, hp)[0].sum()
  return np.asarray(jax.grad(f)(jnp.asarray(zs)))


def test_exact_expectation_under_stale_mu_equals_current_reverse_kl_gradient():
  """μ uniform over V = 8 and candidates = each id once: the MC average is the exact expectation, so the
  online estimator's gradient equals ∇KL(π_θ‖p) at the current student although μ ≠ π_θ."""
  V8 = 8
  rng = np.random.default_rng(1)
  zs, zt = rng.normal(0, 1, V8).astype(np.float32), rng.normal(0, 1, V8).astype(np.float32)
  lmu = np.full(V8, -np.log(V8), np.float32)
  got = _mc_grad(zs, zt, lmu, np.arange(V8), mod.Hparams())
  np.testing.assert_allclose(got, _dense_rev_grad(zs, zt), rtol=1e-4, atol=1e-6)
  off = _mc_grad(zs, zt, lmu, np.arange(V8), mod.Hparams(online_advantage=False))
  assert np.abs(off - _dense_rev_grad(zs, zt)).max() > 1e-2  # the stale-baseline reward is biased


def test_random_samples_converge_to_dense_gradient():
  V8, n = 8, 20000
  rng = np.random.default_rng(2)
  zs, zt = rng.normal(0, 1, V8).astype(np.float32), rng.normal(0, 1, V8).astype(np.float32)
  lmu = np_logsoftmax(zs + rng.normal(0, 0.5, V8)).astype(np.float32)  # a stale student
  ids = rng.choice(V8, size=n, p=np.exp(lmu.astype(np.float64)) / np.exp(lmu.astype(np.float64)).sum())
  got = _mc_grad(zs, zt, lmu, ids, mod.Hparams())
  np.testing.assert_allclose(got, _dense_rev_grad(zs, zt), atol=0.03)


def test_col0_metric_and_empty_mask():
  ids, lq, lmu, lp, mask = _case()
  tokens = ids[..., 0].copy()
  tokens[0, 1] += 1
  _, aux = SPEC.fn(_inputs(ids, lq, lmu, lp, mask, jnp.asarray(tokens)), mod.Hparams())
  assert float(aux["mc_col0_match"][0]) == 4.0 and float(aux["mc_col0_match"][1]) == 5.0
  np.testing.assert_array_equal(_grad(_inputs(ids, lq, lmu, lp, np.zeros_like(mask)), mod.Hparams()), 0.0)


def test_advantage_is_not_clamped():
  """A candidate the teacher puts 34 nats below the student gets advantage −34, not the ±20 clamp's −20 (as async-opd;
  the clamp biased the estimator, experiments/opd_claims.py): on-policy the gradient at it is −A / J = 34 / 2."""
  ids = np.array([[[3, 5]]], np.int32)
  lq = np.full((1, 1, 2), -1.0, np.float32)
  lp = np.array([[[-35.0, -1.0]]], np.float32)
  inputs = _inputs(ids, lq, lq, lp, np.ones((1, 1), np.float32))
  np.testing.assert_allclose(_grad(inputs, mod.Hparams()), [[[17.0, 0.0]]], rtol=1e-6, atol=1e-6)
