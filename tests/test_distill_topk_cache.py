"""Teacher top-k cache: exact top-k, residual bucket sums to one, chunking invariance, student gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.distill import topk_cache as tc


def _logits(seed=0, B=2, T=5, V=9):
  return jnp.asarray(np.random.default_rng(seed).normal(0, 2, (B, T, V)), jnp.float32)


def test_top_k_values_ids_and_residual_sum_to_one():
  z = _logits()
  cache = tc.build_topk_cache(z, 3, chunk_size=2)
  lp = np.asarray(jax.nn.log_softmax(z, -1), np.float64)
  want_ids = np.argsort(-lp, -1)[..., :3]
  np.testing.assert_array_equal(np.asarray(cache.ids_BTk), want_ids)
  np.testing.assert_allclose(np.asarray(cache.logp_BTk), np.take_along_axis(lp, want_ids, -1), rtol=1e-5, atol=1e-6)
  total = np.exp(np.asarray(tc.with_residual(cache), np.float64)).sum(-1)
  np.testing.assert_allclose(total, 1.0, atol=1e-6)
  tail = np.log(np.exp(lp).sum(-1) - np.exp(np.take_along_axis(lp, want_ids, -1)).sum(-1))
  np.testing.assert_allclose(np.asarray(cache.residual_logp_BT), tail, rtol=1e-5, atol=1e-6)


def test_residual_is_exact_for_tiny_tails_and_minus_inf_at_k_equals_v():
  z = jnp.asarray([[[30.0, 0.0, -5.0]]])
  cache = tc.build_topk_cache(z, 1)
  # 1 − p_top is ~1e-13: 1 − Σ exp would round to 0 in float32, the logits-based tail does not.
  want = np.log(np.exp(0.0) + np.exp(-5.0)) - np.log(np.exp(30.0) + np.exp(0.0) + np.exp(-5.0))
  np.testing.assert_allclose(float(cache.residual_logp_BT[0, 0]), want, rtol=1e-5)
  assert np.isneginf(np.asarray(tc.build_topk_cache(z, 3).residual_logp_BT)).all()


@pytest.mark.parametrize("chunk", [1, 2, 5, 64])
def test_chunking_does_not_change_the_cache(chunk):
  z = _logits(1)
  a, b = tc.build_topk_cache(z, 4, chunk_size=chunk), tc.build_topk_cache(z, 4, chunk_size=5)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_temperature_storage_dtype_and_bad_k():
  z = _logits(2)
  c = tc.build_topk_cache(z, 2, temperature=2.0, dtype=jnp.bfloat16)
  assert c.logp_BTk.dtype == jnp.bfloat16 and c.residual_logp_BT.dtype == jnp.float32
  ref = tc.build_topk_cache(z / 2.0, 2)
  np.testing.assert_allclose(np.asarray(c.logp_BTk, np.float32), np.asarray(ref.logp_BTk), rtol=1e-2)
  with pytest.raises(ValueError):
    tc.build_topk_cache(z, 0)


def test_gather_student_logp_feeds_topk_loss_and_is_differentiable():
  zt, zs = _logits(3), _logits(4)
  cache = tc.build_topk_cache(zt, 3)
  ids = cache.ids_BTk.at[0, 0, 2].set(-1)
  s = tc.gather_logp(zs, ids)
  lp = np.asarray(jax.nn.log_softmax(zs, -1))
  np.testing.assert_allclose(np.asarray(s)[1], np.take_along_axis(lp, np.asarray(ids), -1)[1], rtol=1e-6)
  assert np.isneginf(np.asarray(s)[0, 0, 2])
  g = jax.grad(lambda z: jnp.where(ids >= 0, tc.gather_logp(z, ids), 0.0).sum())(zs)
  assert np.isfinite(np.asarray(g)).all()
