"""Gradient accumulation equals the full-batch gradient (sums of (numerator, denominator) parts), the naive
mean of micro-batch means does not; remat changes memory, not the step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import learner
from jaxrl_llm.models import ModelConfig, init_params

CFG = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, max_seq_len=16)
P, N, B = 3, 4, 8
SGD = optax.sgd(1.0)  # parameter change = -gradient, so the comparison is on gradients directly


def make_batch(params, cfg=CFG):
  """Masks with very different token counts per sequence: micro-batch means then weigh tokens unevenly."""
  seq = jax.random.randint(jax.random.key(0), (B, P + N), 3, 16)
  pos = jnp.broadcast_to(jnp.arange(P + N), (B, P + N))
  seg = jnp.ones((B, P + N), jnp.int32)
  lengths = jnp.array([4, 1, 1, 1, 4, 4, 2, 3])
  mask = (jnp.arange(N)[None, :] < lengths[:, None]).astype(jnp.float32)
  logp = learner.make_score_fn(cfg, 1.0)(params, seq, pos, seg, mask)
  adv = jnp.linspace(-1.0, 1.5, B)[:, None] * mask
  return learner.Batch(sequence_BT=seq, positions_BT=pos, segment_ids_BT=seg, mask_BN=mask, adv_BN=adv,
                       behavior_logp_BN=logp - 0.05 * mask, versions_BN=jnp.zeros((B, N), jnp.int32),
                       lag_B=jnp.zeros((B,), jnp.int32), prox_logp_BN=logp)


def grads_and_metrics(params, batch, cfg=CFG, **kw):
  """(-Δparams after one SGD(1) step = the gradient, metrics)."""
  step = learner.make_train_step(cfg, SGD, "ppo_clip", grad_accum=kw.pop("grad_accum", 1), **kw)
  copy = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
  state, m = step(learner.init_state(copy, SGD), batch, jax.random.key(0))
  return jax.tree.map(lambda a, b: b - a, state.params, params), m


def assert_trees_close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, **tol)


def max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_accumulated_gradient_equals_full_batch_gradient(agg_mode):
  params = init_params(CFG, jax.random.key(1))
  batch = make_batch(params)
  full_g, full_m = grads_and_metrics(params, batch, agg_mode=agg_mode)
  assert float(full_m["grad_norm"]) > 1e-3
  for m in (2, 4):
    g, met = grads_and_metrics(params, batch, agg_mode=agg_mode, grad_accum=m)
    assert_trees_close(g, full_g, rtol=1e-5, atol=1e-7)  # float summation order only
    for k in ("loss", "grad_norm", "kl_mu_k1", "clip_frac"):
      np.testing.assert_allclose(met[k], full_m[k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(met["ratio_max"], full_m["ratio_max"], rtol=1e-6)


def test_mean_of_micro_batch_means_is_not_the_full_batch_gradient():
  """What the (numerator, denominator) sums prevent: averaging per-micro-batch token means."""
  params = init_params(CFG, jax.random.key(1))
  batch = make_batch(params)
  full_g, _ = grads_and_metrics(params, batch)
  halves = [jax.tree.map(lambda x: x[i * B // 2:(i + 1) * B // 2], batch) for i in range(2)]
  naive = jax.tree.map(lambda a, b: (a + b) / 2, *(grads_and_metrics(params, h)[0] for h in halves))
  assert max_diff(naive, full_g) > 1e-3
  accumulated, _ = grads_and_metrics(params, batch, grad_accum=2)
  assert max_diff(accumulated, full_g) < 1e-6


def test_grad_accum_argument_checks():
  with pytest.raises(ValueError, match="grad_accum"):
    learner.make_train_step(CFG, SGD, "ppo_clip", grad_accum=0)
  with pytest.raises(ValueError, match="carries state"):
    learner.make_train_step(CFG, SGD, "r2vpo", grad_accum=2)
  params = init_params(CFG, jax.random.key(1))
  with pytest.raises(ValueError, match="must divide the batch size"):
    grads_and_metrics(params, make_batch(params), grad_accum=3)


@pytest.mark.parametrize("remat", [True, "dots"])
def test_remat_train_step_equals_plain_step(remat):
  params = init_params(CFG, jax.random.key(1))
  batch = make_batch(params)
  ref, ref_m = grads_and_metrics(params, batch)
  got, m = grads_and_metrics(params, batch, cfg=dataclasses.replace(CFG, remat=remat))
  assert_trees_close(got, ref, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m["loss"], ref_m["loss"], rtol=1e-6)
