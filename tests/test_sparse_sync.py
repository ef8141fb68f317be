"""SparseRL-Sync: bitwise change detection, sparse/dense packing, bit-exact sampler copy over Adam steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm.models import ModelConfig, forward, init_params
from jaxrl_llm.rollout import sparse_sync as ss

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
BF16 = jnp.bfloat16


def test_changes_are_bitwise_after_the_cast():
  prev = {"w": jnp.array([1.0, 2.0, 3.0, 0.0, 5.0], BF16)}
  # 2 + 2^-10 rounds back to 2.0 in bf16 (spacing 2^-6): no change; -0.0 differs bitwise from 0.0.
  master = {"w": jnp.array([1.0, 2.0 + 2.0 ** -10, 3.5, -0.0, 5.0], jnp.float32)}
  union, low = ss.track_step(ss.init_union(master), prev, master, BF16)
  np.testing.assert_array_equal(np.asarray(union["w"]), [False, False, True, True, False])
  payload = ss.pack(low, union, max_density=0.5)
  leaf = payload.leaves[0]
  np.testing.assert_array_equal(leaf.indices, [2, 3])
  assert leaf.indices.dtype == np.int32 and leaf.values.dtype == np.dtype(BF16)
  assert payload_bits(leaf.values) == payload_bits(np.array([3.5, -0.0], np.asarray(low["w"]).dtype))
  # 2 elements · (4-byte index + 2-byte value) vs 5 · 2 bytes dense.
  assert ss.payload_bytes(payload) == 12 and ss.payload_ratio(payload) == pytest.approx(12 / 10)
  out = ss.apply(prev, payload)
  assert same_bits(out, low)


def payload_bits(x):
  return np.asarray(x).view(np.uint16).tolist()


def same_bits(a, b) -> bool:
  return all(np.array_equal(np.asarray(ss.bits(x)), np.asarray(ss.bits(y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_dense_fallback_above_one_third():
  low = {"a": jnp.arange(6.0).astype(BF16)}
  union = {"a": jnp.array([1, 1, 1, 0, 0, 0], bool)}  # density 1/2 > 1/3
  leaf = ss.pack(low, union).leaves[0]
  assert leaf.indices is None and leaf.values.shape == (6,)
  leaf = ss.pack(low, {"a": jnp.array([1, 1, 0, 0, 0, 0], bool)}).leaves[0]  # density 1/3: sparse
  np.testing.assert_array_equal(leaf.indices, [0, 1])


def test_changed_then_reverted_is_resent_and_exact():
  p0 = {"w": jnp.array([1.0, 2.0], jnp.float32)}
  p1 = {"w": jnp.array([1.5, 2.0], jnp.float32)}
  union, low = ss.track_step(ss.init_union(p0), ss.cast(p0, BF16), p1, BF16)
  union, low = ss.track_step(union, low, p0, BF16)  # back to the start
  payload = ss.pack(low, union, max_density=1.0)
  np.testing.assert_array_equal(payload.leaves[0].indices, [0])  # superset: sent although unchanged
  assert same_bits(ss.apply(ss.cast(p0, BF16), payload), ss.cast(p0, BF16))


def test_apply_rejects_mismatched_payload():
  low = {"w": jnp.zeros(4, BF16)}
  payload = ss.pack(low, ss.init_union(low))
  with pytest.raises(ValueError, match="structure"):
    ss.apply({"v": jnp.zeros(4, BF16)}, payload)
  with pytest.raises(ValueError, match="shape"):
    ss.apply({"w": jnp.zeros(5, BF16)}, payload)


TOKENS = jax.random.randint(jax.random.key(1), (2, 6), 0, CFG.vocab_size)
ADAM = optax.scale_by_adam()


@jax.jit
def adam_step(params, opt_state, lr):
  """One Adam step on a next-token loss of the tiny model (lr traced: one compilation for all cases)."""
  def loss(p):
    logp = jax.nn.log_softmax(forward(p, TOKENS[:, :-1], CFG))
    return -jnp.mean(jnp.take_along_axis(logp, TOKENS[:, 1:, None], axis=-1))
  updates, opt_state = ADAM.update(jax.grad(loss)(params), opt_state, params)
  return optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates)), opt_state


@pytest.mark.parametrize("lr, sync_every", [(1e-6, 1), (1e-6, 3), (3e-2, 2)])
def test_sampler_copy_is_bit_exact_over_adam_steps(lr, sync_every):
  params = init_params(CFG, jax.random.key(0))
  opt_state = ADAM.init(params)
  sampler = ss.cast(params, BF16)
  union, low = ss.init_union(params), ss.cast(params, BF16)
  ratios, kinds = [], set()
  for t in range(6):
    params, opt_state = adam_step(params, opt_state, lr)
    union, low = ss.track_step(union, low, params, BF16)
    if (t + 1) % sync_every == 0:
      payload = ss.pack(low, union)
      ratios.append(ss.payload_ratio(payload))
      kinds |= {leaf.indices is None for leaf in payload.leaves}
      sampler = ss.apply(sampler, payload)
      union = ss.init_union(params)
      assert same_bits(sampler, ss.cast(params, BF16))  # bit-exact with a dense cast copy
  print("payload ratios", ratios)
  if lr < 1e-3:
    # RL-sized steps flip few bf16 elements: the payload is a small fraction of the dense copy.
    assert max(ratios) < 0.4 and kinds == {False}
  else:
    assert True in kinds  # large steps change most elements: dense fallback taken


def test_blocks_of_one_layout_update_any_region_of_another():
  """The receiver side of per-block payloads (`_updates`): blocks of a 2 x 2 grid over a [4, 6] tensor (some sparse,
  one dense) update a region of another layout exactly where the tensor changed, in the region's own flat order."""
  rng = np.random.default_rng(0)
  old, new = rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=(4, 6)).astype(np.float32)
  changed = rng.random((4, 6)) < 0.3
  new = np.where(changed, new, old)
  blocks = [ss._pack_block((r, c), new[r:r + 2, c:c + 3], changed[r:r + 2, c:c + 3], 0.5)
            for r in (0, 2) for c in (0, 3)]
  blocks[1] = ss._pack_block((0, 3), new[0:2, 3:6], np.ones((2, 3), bool), 0.5)  # sent dense
  assert blocks[1].indices is None and any(b.indices is not None for b in blocks)
  for start, shape in (((0, 0), (4, 6)), ((1, 0), (3, 6)), ((0, 2), (4, 2)), ((2, 3), (2, 3))):
    region = tuple(slice(s, s + n) for s, n in zip(start, shape))
    got = old[region].copy().reshape(-1)
    upd = ss._updates(blocks, start, shape)
    if isinstance(upd, np.ndarray):  # one dense block is the region
      got = upd.reshape(-1)
    else:
      got[upd[0]] = upd[1]
    np.testing.assert_array_equal(got.reshape(shape), new[region])
