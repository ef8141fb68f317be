"""MemoryWalker replays: LogitTree and packed 4D mask equal naive per-view recomputation (values + grads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.distill import memory_walker as mw

CFG = models.ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
PARAMS = models.init_params(CFG, jax.random.PRNGKey(0))
T = 12
TOKENS = np.random.default_rng(0).integers(0, 32, T).astype(np.int32)
# Trunk 0..3; a tool call 4..6 is evicted when the summary token 7 is written; then 7..9 are evicted
# when 10 is written. Views: 11 sees {0..3, 10, 11}; 9 sees {0..3, 7, 8, 9}; 6 sees {0..6}.
EVENTS = [(7, 4, 7), (10, 7, 10)]
LOSS = np.array([0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], np.float32)  # 7 is harness-written


def _naive(params, end_T, loss_T):
  """Reference: each token re-scored by a fresh forward over its parent's view alone (views right-padded
  into one batch; padding is a separate segment after the view, so it cannot affect it)."""
  vis = mw.visibility(end_T)
  par = mw.parents(vis)
  idx = [i for i in range(T) if loss_T[i] > 0 and par[i] >= 0]
  rows = np.zeros((len(idx), T), np.int32)
  seg = np.zeros((len(idx), T), np.int32)
  last = np.zeros(len(idx), np.int32)
  for r, i in enumerate(idx):
    view = np.flatnonzero(vis[par[i]])
    rows[r, : len(view)], seg[r, : len(view)], last[r] = TOKENS[view], 1, len(view) - 1
  logits = models.forward(params, jnp.asarray(rows), CFG, segment_ids_BT=jnp.asarray(seg))
  lp = jax.nn.log_softmax(logits[jnp.arange(len(idx)), jnp.asarray(last)], -1)[jnp.arange(len(idx)), TOKENS[idx]]
  return jnp.zeros(T).at[jnp.asarray(idx)].set(lp)


def test_masked_forward_matches_model_on_causal_mask():
  tok = jnp.asarray(TOKENS)[None]
  mask = jnp.tril(jnp.ones((T, T), bool))[None]
  a = mw.hidden_masked(PARAMS, tok, CFG, positions_BT=jnp.arange(T)[None], mask_BTT=mask)
  np.testing.assert_allclose(np.asarray(a), np.asarray(models.hidden(PARAMS, tok, CFG)), rtol=1e-5, atol=1e-5)


def test_structure_of_the_example():
  end = mw.lifetimes_from_events(T, EVENTS)
  vis = mw.visibility(end)
  np.testing.assert_array_equal(np.flatnonzero(vis[11]), [0, 1, 2, 3, 10, 11])
  np.testing.assert_array_equal(mw.parents(vis)[[7, 10, 4]], [3, 3, 3])
  np.testing.assert_array_equal(mw.depths(vis)[[6, 7, 9, 10, 11]], [6, 4, 6, 4, 5])
  tree = mw.build_logit_tree(TOKENS, end, LOSS)
  assert tree["tokens_BT"].shape[0] == len(EVENTS) + 1  # K evictions -> K+1 branches
  counted = tree["target_src_BT"][tree["loss_mask_BT"] > 0]
  np.testing.assert_array_equal(np.sort(counted), np.flatnonzero((LOSS > 0) & (mw.parents(vis) >= 0)))
  np.testing.assert_array_equal(mw.eviction_points(end), 0)  # tail evictions: no survivor saw evicted context
  # A middle eviction (SDCC's setting): 4 and 5 survive but were generated while 2, 3 were visible.
  np.testing.assert_array_equal(mw.eviction_points(mw.lifetimes_from_events(8, [(6, 2, 4)])), [0, 0, 0, 0, 1, 1, 0, 0])


def test_non_tree_eviction_is_rejected():
  end = mw.lifetimes_from_events(8, [(6, 2, 4)])  # 4, 5 survive but saw 2, 3
  with pytest.raises(ValueError, match="tree"):
    mw.build_packed(TOKENS[:8], end, np.ones(8))


def test_both_replays_equal_naive_values_and_gradients():
  end = mw.lifetimes_from_events(T, EVENTS)
  packed = mw.build_packed(TOKENS, end, LOSS)
  tree = mw.build_logit_tree(TOKENS, end, LOSS)
  lm = jnp.asarray(packed["loss_mask_T"])
  naive = _naive(PARAMS, end, LOSS)
  lp_packed = mw.packed_logprobs(PARAMS, packed, CFG)
  lp_tree = mw.logit_tree_logprobs(PARAMS, tree, CFG, T)
  np.testing.assert_allclose(np.asarray(lp_packed * lm), np.asarray(naive), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lp_tree), np.asarray(naive), rtol=1e-5, atol=1e-5)
  # jitted: eagerly, each gradient dispatched the scanned layers' backward op by op
  g_naive = jax.jit(jax.grad(lambda p: _naive(p, end, LOSS).sum()))(PARAMS)
  g_packed = jax.jit(jax.grad(lambda p: (mw.packed_logprobs(p, packed, CFG) * lm).sum()))(PARAMS)
  g_tree = jax.jit(jax.grad(lambda p: mw.logit_tree_logprobs(p, tree, CFG, T).sum()))(PARAMS)
  for a, b, c in zip(jax.tree_util.tree_leaves(g_naive), jax.tree_util.tree_leaves(g_packed),
                     jax.tree_util.tree_leaves(g_tree)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-4, atol=1e-5)


def test_flattening_the_final_stream_is_wrong():
  """The naive-compressed replay (score every token under the final stream) differs: the bug being fixed."""
  end = mw.lifetimes_from_events(T, EVENTS)
  packed = mw.build_packed(TOKENS, end, LOSS)
  full_causal = dict(packed, mask_TT=np.tril(np.ones((T, T), bool)), positions_T=np.arange(T, dtype=np.int32),
                     parent_T=np.arange(T, dtype=np.int32) - 1)
  a = mw.packed_logprobs(PARAMS, packed, CFG)
  b = mw.packed_logprobs(PARAMS, full_causal, CFG)
  assert float(jnp.abs((a - b) * jnp.asarray(packed["loss_mask_T"])).max()) > 1e-4
