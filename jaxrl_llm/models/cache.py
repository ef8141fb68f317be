"""KV cache for incremental decoding, and the attention masks of the full and cached paths.

The cache is a plain dict pytree:
  k, v:            [L, B, S, K, hd] keys (already rotated by RoPE) and values, compute dtype.
  positions_BS:    int32 RoPE position of the token in each slot.
  segment_ids_BS:  int32 segment id of each slot; 0 = empty slot or padding token.
  index:           int32 scalar, the next slot to write (shared by all rows, so slot order is time order).
  routes_LBSk:     MoE only: int32 expert ids each layer routed the slot's token to (routing replay, R3).
                   Unwritten slots hold experts 0..k-1 (valid ids; they belong to padding).

A query may attend to a slot when the slot is not later than the query's own slot and both carry the
same segment id. This is exactly the rule of the full forward pass, so prefill + decode reproduces it.

Compressed caches (the sampler's `kv_cache`, a deliberate mismatch with the learner's dense forward):
  int8:   `k`, `v` hold int8 with per-token-per-head scales `k_scale`, `v_scale` [L, B, S, K] (float32):
          a slot stores round(x / s) with s = max|x| / 127 over head_dim, and is read back as q·s.
  window: attention sinks + a sliding window (StreamingLLM-style) over positions: a query at position p
          sees a key at position p' of its segment when p' < sinks or p − p' < window
          (`window_visible`). The static decode loop (`sampling.generate`) allocates a ring buffer
          (`ring_layout`): the P prompt slots, then `sinks` slots for the first generated tokens and `window`
          slots reused in turn by the later ones (`write_slot`), P + sinks + window slots instead of P + N, which
          hold every key the mask lets through; slot order is then not time order, so causality is by
          position (`position_mask`). The other decode loops keep the full-size cache under the same mask.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ModelConfig

Array = jax.Array


def init_cache(cfg: ModelConfig, batch: int, max_len: int, kv_dtype: str = "compute",
               route_len: int | None = None) -> dict:
  """An empty cache with `max_len` slots per row: keys/values in the model's compute dtype, or
  `kv_dtype="int8"` with float32 per-token-per-head scales (see the module docstring). MoE routes get
  `route_len` slots (default `max_len`): a ring buffer keeps every token's routes, in time order."""
  kv_shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
  if kv_dtype not in ("compute", "int8"):
    raise ValueError(f"init_cache: kv_dtype must be 'compute' or 'int8', got {kv_dtype!r}")
  dtype = jnp.int8 if kv_dtype == "int8" else cfg.compute_dtype
  cache = {
      "k": jnp.zeros(kv_shape, dtype),
      "v": jnp.zeros(kv_shape, dtype),
      "positions_BS": jnp.zeros((batch, max_len), jnp.int32),
      "segment_ids_BS": jnp.zeros((batch, max_len), jnp.int32),
      "index": jnp.zeros((), jnp.int32),
  }
  if kv_dtype == "int8":
    cache["k_scale"] = jnp.ones(kv_shape[:-1], jnp.float32)
    cache["v_scale"] = jnp.ones(kv_shape[:-1], jnp.float32)
  if cfg.num_experts > 0:
    k = cfg.experts_per_token
    cache["routes_LBSk"] = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32),
                                            (cfg.n_layers, batch, route_len or max_len, k))
  return cache


EMPTY_SLOT = {"k": 0, "v": 0, "k_scale": 1.0, "v_scale": 1.0}  # what `init_cache` leaves in a slot of each array


def pad_slots(x: Array, axis: int, slots: int, value=0) -> Array:
  """`x` padded with `value` along its slot axis `axis` to `slots` entries."""
  pad = [(0, slots - x.shape[axis]) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)]
  return jnp.pad(x, pad, constant_values=value)


def widen(cache: dict, slots: int | None, kv: bool = True) -> dict:
  """The cache with `slots` slots per row, the added ones empty as `init_cache` leaves them (None, or the
  cache's own width: unchanged). Why: `generate` prefills into the prompt's P slots only and the decode loop
  adds its room, so the full-width cache never exists beside its copy in the decode layout
  (`transformer.decode_view`). `kv=False` leaves `k` and `v` (and their scales) to the caller. MoE routes
  have their own length (`init_cache`'s route_len) and are left as they are."""
  S = cache["segment_ids_BS"].shape[1]
  if slots is None or slots == S:
    return cache
  if slots < S:
    raise ValueError(f"cache.widen: {slots} slots is fewer than the cache's {S}")
  out = {**cache, "positions_BS": pad_slots(cache["positions_BS"], 1, slots),
         "segment_ids_BS": pad_slots(cache["segment_ids_BS"], 1, slots)}
  if kv:
    out.update({n: pad_slots(cache[n], 2, slots, value) for n, value in EMPTY_SLOT.items() if n in cache})
  return out


def attention_mask(segment_ids_q_BT: Array, segment_ids_k_BS: Array, q_offset: Array | int = 0) -> Array:
  """Boolean [B, T, S] mask: key slot s <= query slot (q_offset + t) and equal segment ids.

  Padding (segment 0) only meets padding, and a token always meets itself, so no row is empty
  and padded rows cannot produce NaN.
  """
  T, S = segment_ids_q_BT.shape[1], segment_ids_k_BS.shape[1]
  q_slot_T = q_offset + jnp.arange(T)
  causal_TS = jnp.arange(S)[None, :] <= q_slot_T[:, None]
  same_BTS = segment_ids_q_BT[:, :, None] == segment_ids_k_BS[:, None, :]
  return causal_TS[None] & same_BTS


def window_visible(pos_q: Array, pos_k: Array, sinks, window) -> Array:
  """Whether a query at RoPE position `pos_q` keeps a key at `pos_k` in a sinks + sliding-window cache:
  one of the first `sinks` positions, or among the last `window` positions up to and including its own
  (pos_q − pos_k < window). Broadcasts; `sinks` / `window` may be traced ints (the learner's per-row record).
  Causality and segments are `attention_mask`'s part."""
  return (pos_k < sinks) | (pos_q - pos_k < window)


def window_attention_mask(positions_BT: Array, segment_ids_BT: Array, sinks_B: Array, window_B: Array) -> Array:
  """Boolean [B, T, T]: the full forward's causal segment mask restricted to what a sinks + window cache
  (per row: `sinks_B`, `window_B`) let each query see, so a forward with it reproduces the sampler's
  compressed attention (the SMD shadow policy). Each token still meets itself (window >= 1)."""
  keep_BTT = window_visible(positions_BT[:, :, None], positions_BT[:, None, :], sinks_B[:, None, None],
                            window_B[:, None, None])
  return attention_mask(segment_ids_BT, segment_ids_BT) & keep_BTT


def quantize_kv(x_BTKd: Array) -> tuple[Array, Array]:
  """(int8 values, float32 scales [B, T, K]): symmetric per token and head over head_dim, s = max|x| / 127."""
  x32 = x_BTKd.astype(jnp.float32)
  s_BTK = jnp.max(jnp.abs(x32), axis=-1) / 127.0
  s_BTK = jnp.where(s_BTK > 0, s_BTK, 1.0)
  return jnp.clip(jnp.round(x32 / s_BTK[..., None]), -127, 127).astype(jnp.int8), s_BTK


def dequantize_kv(q_BSKd: Array, s_BSK: Array, dtype) -> Array:
  """int8 keys/values back to `dtype`: q·s."""
  return (q_BSKd.astype(jnp.float32) * s_BSK[..., None]).astype(dtype)


def cache_bytes(cache: dict, names=("k", "v", "k_scale", "v_scale")) -> int:
  """Bytes of the cache's key/value arrays (and int8 scales), all rows; also of `jax.eval_shape(init_cache, ...)`."""
  return sum(math.prod(cache[n].shape) * jnp.dtype(cache[n].dtype).itemsize for n in names if n in cache)


def kv_bits(cache: dict) -> float:
  """Bits per cached key/value element, int8 scales included (32 fp32, 16 bf16, 8 + 64 / head_dim int8), read off
  the arrays of `cache`: the `gen_kv_bits` metric each decode path reports of the cache it decoded from."""
  return 8.0 * cache_bytes(cache) / sum(math.prod(cache[n].shape) for n in ("k", "v"))


def window_record(kv_window: tuple[int, int] | None, rows: int) -> dict:
  """{"kv_window_B2": int32 [rows, 2]}, each row's (sinks, window) of a sinks + window cache: what every token could
  see by position, from which the learner builds the shadow mask (`window_attention_mask`); {} without one."""
  if kv_window is None:
    return {}
  return {"kv_window_B2": np.broadcast_to(np.asarray(kv_window, np.int32), (rows, 2)).copy()}


def ring_layout(P: int, N: int, kv_window: tuple[int, int] | None) -> tuple[int, int, int] | None:
  """(start P, sinks, window) of the ring buffer a sinks + window cache decodes N tokens after P prompt slots
  with, or None: no window, or sinks + window >= N (the full cache is no larger)."""
  if kv_window is None or sum(kv_window) >= N:
    return None
  return (P, *kv_window)


def cache_slots(P: int, N: int, ring: tuple[int, int, int] | None) -> int:
  """Slots per row of a cache for P prompt and N new tokens: P + N, or P + sinks + window with a ring."""
  return P + (N if ring is None else ring[1] + ring[2])


def write_slot(index: Array, ring: tuple[int, int, int] | None) -> Array:
  """The slot a token fed at time `index` (the cache's write index) is stored in: `index` itself before the
  ring's start (the prompt) and for the first `sinks` generated tokens, then start + sinks + (g − sinks) mod
  window for generated token g (a token overwrites the one `window` tokens older, which no later query sees).
  One token per call past the start (decode); a prefill ends at the start."""
  if ring is None:
    return index
  start, sinks, window = ring
  g = index - start
  return jnp.where(g < sinks, index, start + sinks + (g - sinks) % window)


def position_mask(positions_BT: Array, segment_ids_BT: Array, positions_BS: Array, segment_ids_BS: Array) -> Array:
  """Boolean [B, T, S]: key slot s at or before the query's position, same segment (a ring buffer's causality:
  within a segment positions grow with time). Unwritten slots hold segment 0 and meet only padding."""
  same_BTS = segment_ids_BT[:, :, None] == segment_ids_BS[:, None, :]
  return same_BTS & (positions_BS[:, None, :] <= positions_BT[:, :, None])


def ring_buffer_bytes(cfg: ModelConfig, sinks: int, window: int, slots: int) -> int:
  """Bytes per sequence of keys and values (compute dtype) in sinks + window slots, at most `slots`: with N
  generated tokens, what `sampling.generate`'s ring buffer holds beyond the prompt (`ring_layout`)."""
  kept = min(sinks + window, slots)
  return 2 * cfg.n_layers * kept * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize


def write_metadata(cache: dict, positions_BT: Array, segment_ids_BT: Array, slot: Array | None = None) -> dict:
  """Records positions and segment ids of T new tokens at slot `slot` (default: the write index; a ring buffer's
  `write_slot`) and advances the write index by T.

  Keys/values are written per layer by the forward pass; this handles the per-row bookkeeping.
  Writing past the last slot is not checked (dynamic_update_slice would clamp): size caches to
  prompt + new tokens.
  """
  index = cache["index"]
  slot = index if slot is None else slot
  return {
      **cache,
      "positions_BS": jax.lax.dynamic_update_slice_in_dim(
          cache["positions_BS"], positions_BT.astype(jnp.int32), slot, axis=1),
      "segment_ids_BS": jax.lax.dynamic_update_slice_in_dim(
          cache["segment_ids_BS"], segment_ids_BT.astype(jnp.int32), slot, axis=1),
      "index": index + positions_BT.shape[1],
  }


# Batch axis of every per-row cache entry ("index" is shared by all rows).
_ROW_AXIS = {"k": 1, "v": 1, "k_scale": 1, "v_scale": 1, "positions_BS": 0, "segment_ids_BS": 0, "routes_LBSk": 1}


def repeat_rows(cache: dict, group_size: int) -> dict:
  """The cache with each row copied to `group_size` consecutive rows (row b -> rows b·G .. b·G+G-1).

  Why: the G completions of a GRPO group share their prompt, so its keys and values are computed
  once per group (B/G rows of prefill) and copied to the G rows that decode from it.
  """
  return {name: x if name == "index" else jnp.repeat(x, group_size, axis=_ROW_AXIS[name])
          for name, x in cache.items()}


def groups_equal(x_B: Array, group_size: int) -> Array:
  """Scalar bool: whether rows g·G .. g·G+G-1 of `x_B` (any trailing shape) are equal for every group g."""
  x_gG = x_B.reshape(x_B.shape[0] // group_size, group_size, *x_B.shape[1:])
  return jnp.all(x_gG == x_gG[:, :1])


def take_rows(cache: dict, rows_b: Array) -> dict:
  """The cache of rows `rows_b` (an int array; repeats allowed), in that order: a batch that lost finished rows."""
  return {name: x if name == "index" else jnp.take(x, rows_b, axis=_ROW_AXIS[name]) for name, x in cache.items()}
