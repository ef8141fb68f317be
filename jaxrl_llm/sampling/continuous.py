"""Continuous batching: S decode slots over one KV cache; a finished slot is refilled with the next queued request.

The static sampler (`sampler.generate`) decodes a whole batch until its longest row finishes, so with long-tailed
completion lengths most row-steps decode rows that already stopped. Here a host object (`SlotEngine`: a request
queue, the slot each request holds, counters) runs jitted pieces; `generate_slots` drives it over a fixed list of
requests, and sources that produce requests over time (async groups, episodes' next turns) submit to it:
  - `decode_chunk`: up to C decode steps over all S slots (free and finished slots masked, segment 0);
  - between chunks the finished requests leave (tokens, μ log-probs, per-token versions), the cache is shifted
    left past slots no live request reads (`shift_cache`), and queued requests are prefilled into the free
    slots (`prefill_slots`: a small batch of prompts written into those rows, their old slots cleared).

Cache layout: the write index is shared by all rows (`models.cache`), so a request admitted when it stands at i
holds its left-padded prompt in slots [i - P, i) and its completion column n in slot i + n: the same relative
layout as `generate`'s (prompt at [0, P), column n at P + n), so attention sees the same keys at the same RoPE
positions. Slots before a request's prompt hold segment 0 (cleared on admission), which its tokens never attend.
The shift keeps the index within P + N + C slots however long the engine runs.

Keys: every request carries its own key and draws column n with `fold_in(request_key, n)` (`sample.row_noise`),
so its tokens depend neither on its slot nor on its neighbours; `generate` given the same keys, one per row,
samples the same tokens (log-probs equal up to float rounding: the attention sums run over other slot widths).

Versions: `poll(version)` is asked at every chunk boundary for newer (version, params); the next chunk and the
prefills after it use them (an in-flight update stalls the slots for at most one chunk). The cache keeps the
keys/values the old parameters wrote (PipelineRL), and each token records the version that sampled it.

Speculative decoding (`sampler.spec_gamma` γ > 0) is the engine's other step (`speculate_chunk`): every call
drafts γ tokens per live slot with the drafter (the policy's first `spec_draft_layers` layers, or a distilled
drafter's parameters) over a drafter cache of the same slot layout, verifies them in one policy call, and every
live slot emits the common minimum m of what the live slots accepted (`speculative`'s "min" layout), so the
write index still advances alike for all rows and column n still sits at slot base + P + n. The draws are the
request's own (`fold_in(fold_in(key, SPEC_STREAM), column)`); the tokens follow the policy's sampling
distribution exactly (not `generate`'s bits), and μ, the records and MoE routes are the verify call's, as in
`speculative.generate_speculative`.

Resident rows (`SlotEngine(resident=True)`, episodes with `env.kv_cache`): a finished request submitted with a `keep`
id leaves its keys/values parked in its slot, and the next request of that id whose context extends them is
admitted by `resume_slots`: the row's kept slots are gathered to the end of a P-slot cache, the new tokens appended
with one forward, and the whole context shifted to end at slot P, which is exactly what `prefill_slots` would have
placed there (so the row's layout, the harvest and MoE routes by position are those of any admission).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.cache import init_cache, kv_bits, take_rows, window_record
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import decode_view, stack_cache
from jaxrl_llm.sampling import behavior, head_drafter, speculative
from jaxrl_llm.sampling.config import SamplerConfig
from jaxrl_llm.sampling.continuation import extend
from jaxrl_llm.sampling.sampler import decode_columns, draw_column, is_stop, prefill_rows, prompt_layout

Array = jax.Array
# poll(current_version) -> (newer_version, params) or None
Poll = Callable[[Any], Any]

# Slot (sequence) axis of every per-row cache entry; "index" is shared by all rows.
_SLOT_AXIS = {"k": 2, "v": 2, "k_scale": 2, "v_scale": 2, "positions_BS": 1, "segment_ids_BS": 1, "routes_LBSk": 2}
# Row (request) axis of every per-row cache entry, just before its slot axis; every other entry of the engine's
# state has its rows first.
_ROW_AXIS = {**{name: ax - 1 for name, ax in _SLOT_AXIS.items()}, "feat_BD": 0}  # feat_BD: a head drafter's
_CACHES = ("cache", "dcache")


SPEC_STREAM = 0x5350  # folded into a request's key for its draft-and-verify draws ("SP")


def engine_gamma(sampler_cfg: SamplerConfig, slots: int) -> int:
  """γ of the engine's draft-and-verify step (0: plain decoding); "auto" picks it for S slots
  (`speculative.auto_gamma`: the engine's batch is its slot count)."""
  return speculative.gamma_of(sampler_cfg, slots)


def check_supported(sampler_cfg: SamplerConfig) -> None:
  """Raises ValueError for the sampler settings the slot engine does not implement: speculation's "rows" layout
  (every slot shares the cache's write index, so the slots advance by a common minimum: "min")."""
  if sampler_cfg.spec_gamma and sampler_cfg.spec_layout != "min":
    raise ValueError(f"continuous batching speculates with sampler.spec_layout='min' (the slots share one write "
                     f"index), got {sampler_cfg.spec_layout!r}")


class HostKey(NamedTuple):
  """One request's key held on the host: its raw data and PRNG implementation (None: the data is a raw uint32
  key). Why: indexing a device array of keys row by row is an eager device op per request (a fifth of a toy
  model's `generate_slots` in a profile); `host_key_rows` reads the keys once and the engine stacks a whole
  admission's keys on the host into one device array."""
  data: np.ndarray
  impl: Any


def host_key_rows(keys_R) -> list[HostKey]:
  """`keys_R` (typed keys [R], or raw uint32 keys [R, 2]) as R `HostKey`s, read from the device once."""
  typed = jnp.issubdtype(keys_R.dtype, jax.dtypes.prng_key)
  data = np.asarray(jax.random.key_data(keys_R) if typed else keys_R)
  impl = jax.random.key_impl(keys_R) if typed else None
  return [HostKey(row, impl) for row in data]


def _stack_keys(keys: list) -> Array:
  """The device array of a list of request keys (device keys, or `HostKey`s: stacked on the host)."""
  if all(isinstance(k, HostKey) for k in keys):
    data = np.stack([k.data for k in keys])
    return jnp.asarray(data) if keys[0].impl is None else jax.random.wrap_key_data(data, impl=keys[0].impl)
  return jnp.stack([_stack_keys([k])[0] if isinstance(k, HostKey) else k for k in keys])


@dataclasses.dataclass(frozen=True)
class SlotLayout:
  """Where the engine's slots live on a mesh: `mesh` (the sampler's, where the parameters are) and the mesh `axes`
  the slot axis is split over (the caller's choice: `rollout.generation.slot_layout`, the sampler's batch axes
  that divide the slot count). Hashable: the jitted pieces take it as a static argument."""
  mesh: Any
  axes: tuple[str, ...]


def slot_shardings(state: dict, layout: SlotLayout) -> dict:
  """NamedShardings of the engine's `state`: every entry's row axis (one row per decode slot; `_ROW_AXIS`, not
  the cache's position axis `_SLOT_AXIS`) split over `layout.axes`, the shared write index replicated."""
  split = layout.axes or None

  def one(x, row_axis: int | None) -> jax.sharding.NamedSharding:
    spec = [split if i == row_axis else None for i in range(x.ndim)]
    return jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec(*spec))

  return {name: ({n: one(v, _ROW_AXIS.get(n)) for n, v in x.items()} if name in _CACHES else one(x, 0))
          for name, x in state.items()}


def _constrain(state: dict, layout: SlotLayout | None) -> dict:
  """`state` kept in its slot layout (`slot_shardings`; None: one device, nothing to say), so every jitted piece
  hands the next one the layout it was compiled for."""
  return state if layout is None else jax.lax.with_sharding_constraint(state, slot_shardings(state, layout))


def _write_column(buf_SN: Array, value_S: Array, col_S: Array, live_S: Array) -> Array:
  """`buf_SN` with row s's column `col_S[s]` set to `value_S[s]` where `live_S[s]` (trailing axes ride along:
  a record's [S, N, k] takes [S, k] values)."""
  hit_SN = live_S[:, None] & (jnp.arange(buf_SN.shape[1])[None, :] == col_S[:, None])
  return jnp.where(hit_SN.reshape(hit_SN.shape + (1,) * (buf_SN.ndim - 2)), value_S[:, None].astype(buf_SN.dtype),
                   buf_SN)


def init_state(model_cfg: ModelConfig, sampler_cfg: SamplerConfig, slots: int, width: int, chunk: int,
               key_like: Array, head: bool = False, extra: int = 0) -> dict:
  """The engine's device state with every slot free: a cache of P + N + C (+ `extra`: how far the write index may
  run ahead of a resident row's first token, `SlotEngine`'s `resident`) slots whose write index stands at P
  (room for the first prompts), and per slot its next column `step_S`, prompt length `start_S` (completion
  column n sits at RoPE position start + n), key, live / stopped flags, logits of its next column and its
  output columns (tokens, μ log-probs, mask, versions). With speculation the drafter's state: its own cache, or
  for a `head` drafter (`sampling.head_drafter`) one feature per slot."""
  N, gamma = sampler_cfg.max_new_tokens, engine_gamma(sampler_cfg, slots)
  room = chunk_room(chunk, gamma) + extra
  cache = init_cache(model_cfg, slots, width + N + room, sampler_cfg.kv_dtype)  # full or int8 (window: a mask)
  cache["index"] = jnp.asarray(width, jnp.int32)
  spec = {}
  if gamma and head:
    spec["dcache"] = {"feat_BD": jnp.zeros((slots, model_cfg.d_model), model_cfg.compute_dtype)}
  elif gamma:  # the drafter's own cache, same slots (full: it only proposes)
    d_cfg = dataclasses.replace(model_cfg, n_layers=sampler_cfg.spec_draft_layers)
    spec["dcache"] = {**init_cache(d_cfg, slots, width + N + room), "index": jnp.asarray(width, jnp.int32)}
  return {
      **spec,
      "cache": cache,
      "step_S": jnp.zeros((slots,), jnp.int32),
      "start_S": jnp.zeros((slots,), jnp.int32),
      "keys_S": jnp.broadcast_to(key_like[:1], (slots,) + key_like.shape[1:]),
      "live_S": jnp.zeros((slots,), bool),
      "unfed_S": jnp.zeros((slots,), bool),
      "stopped_S": jnp.zeros((slots,), bool),
      "logits_SV": jnp.zeros((slots, model_cfg.vocab_size), jnp.float32),
      "tokens_SN": jnp.full((slots, N), sampler_cfg.pad_id, jnp.int32),
      "logp_SN": jnp.zeros((slots, N), jnp.float32),
      "mask_SN": jnp.zeros((slots, N), jnp.float32),
      "versions_SN": jnp.zeros((slots, N), jnp.int32),
      **behavior.init_records(slots, N, sampler_cfg),  # μ's top-k / MC candidates, when asked ([S, N, k])
  }


def chunk_room(chunk: int, gamma: int) -> int:
  """Slots one chunk may advance the write index: one per decode step, or at most γ + 1 per draft-and-verify call
  (which writes γ + 1)."""
  return chunk if not gamma else (chunk + 1) * (gamma + 1)


def _record_names(sampler_cfg: SamplerConfig) -> tuple[str, ...]:
  """The state's μ record buffers ([S, N, k|J], `generate`'s output names) the sampler config asks for."""
  return ((behavior.TOPK_FIELDS if sampler_cfg.behavior_topk else ()) +
          (behavior.MC_FIELDS if sampler_cfg.mc_samples else ()))


def _emit(state: dict, version: Array, sampler_cfg: SamplerConfig, feed_stops: bool = False) -> dict:
  """Samples every live slot's next column from `logits_SV`, writes it, and retires rows that emitted a stop id
  or filled their N columns."""
  live_S, step_S = state["live_S"], state["step_S"]
  # each row its own column with its own key: `generate`'s draw with per-row keys (records too)
  token_S, logp_S, got = draw_column(state["logits_SV"], state["keys_S"], step_S, sampler_cfg)
  recs = {name: _write_column(state[name], x, step_S, live_S) for name, x in got.items()}
  token_S = jnp.where(live_S, token_S, sampler_cfg.pad_id).astype(jnp.int32)
  stop_S = live_S & is_stop(token_S, sampler_cfg.stop_ids)
  return {
      **state,
      **recs,
      "tokens_SN": _write_column(state["tokens_SN"], token_S, step_S, live_S),
      "logp_SN": _write_column(state["logp_SN"], logp_S, step_S, live_S),
      "mask_SN": _write_column(state["mask_SN"], jnp.ones_like(logp_S), step_S, live_S),
      "versions_SN": _write_column(state["versions_SN"], jnp.broadcast_to(version, step_S.shape), step_S, live_S),
      "stopped_S": state["stopped_S"] | stop_S,
      "live_S": live_S & ~stop_S & (step_S + 1 < sampler_cfg.max_new_tokens),
      # the rows whose new column the next decode step feeds: the live ones, and with `feed_stops` (MoE: the
      # routes of every real input token are recorded, as `generate` feeds a stop token) a just-stopped one once
      "unfed_S": live_S & (step_S + 1 < sampler_cfg.max_new_tokens) & (~stop_S | feed_stops),
      "step_S": step_S + live_S.astype(jnp.int32),
  }


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg", "chunk", "layout"),
                   donate_argnames=("state",))
def decode_chunk(params: dict, state: dict, version: Array, model_cfg: ModelConfig, sampler_cfg: SamplerConfig,
                 chunk: int, layout=None) -> tuple[dict, Array]:
  """Up to `chunk` decode steps over all slots (fewer once no slot has a column to feed): `generate`'s decode loop
  (`sampler.decode_columns`), each step feeding every unfed slot's last column at its own position and sampling
  every live slot's next. Returns (state, steps run); `layout`: where the slots live on a mesh (`SlotLayout`)."""
  version = jnp.asarray(version, jnp.int32)

  def emit(st: dict, logits_SV: Array) -> dict:
    st = {**st, "steps": st["steps"] + 1, "logits_SV": jnp.where(st["live_S"][:, None], logits_SV, st["logits_SV"])}
    return _emit(st, version, sampler_cfg, model_cfg.is_moe)

  more = lambda st: (st["steps"] < chunk) & jnp.any(st["unfed_S"])

  def columns(st: dict) -> tuple[Array, Array, Array]:  # each slot's last drawn column, fed where unfed
    prev_S = jnp.maximum(st["step_S"] - 1, 0)
    return jnp.take_along_axis(st["tokens_SN"], prev_S[:, None], axis=1)[:, 0], prev_S, st["unfed_S"]

  state = decode_columns(params, {**state, "steps": jnp.zeros((), jnp.int32)}, state["start_S"], emit, more,
                         model_cfg, sampler_cfg.kv_window_arg, columns=columns)
  steps = state.pop("steps")
  return _constrain(state, layout), steps


def _place(cache: dict, small: dict, rows_k: Array, P: int) -> dict:
  """`cache` with rows `rows_k` replaced by the prefilled `small` cache (P slots) at slots [index - P, index), the
  rest of those rows cleared (segment 0); a row index >= S is dropped."""
  at = cache["index"] - P
  out = {"index": cache["index"]}
  for name, x in cache.items():
    if name == "index":
      continue
    ax = _SLOT_AXIS[name]
    fresh = jnp.zeros(small[name].shape[:ax] + (x.shape[ax],) + small[name].shape[ax + 1:], x.dtype)
    fresh = jax.lax.dynamic_update_slice_in_dim(fresh, small[name].astype(x.dtype), at, axis=ax)
    out[name] = x.at[(slice(None),) * (ax - 1) + (rows_k,)].set(fresh, mode="drop")
  return out


def _put_block(buf_SN: Array, x_SG: Array, col_SG: Array, write_SG: Array) -> Array:
  """`buf_SN` with row s's columns `col_SG[s]` set to `x_SG[s]` where `write_SG` (trailing axes ride along)."""
  cols_SG = jnp.where(write_SG, col_SG, buf_SN.shape[1])  # out of range: dropped
  return buf_SN.at[jnp.arange(buf_SN.shape[0])[:, None], cols_SG].set(x_SG.astype(buf_SN.dtype), mode="drop")


SPEC_COUNTS = ("calls", "advance", "live_calls", "accepted", "proposed", "emitted")


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg", "chunk", "gamma", "layout"),
                   donate_argnames=("state",))
def speculate_chunk(params: dict, draft_params: dict | None, state: dict, version: Array, model_cfg: ModelConfig,
                    sampler_cfg: SamplerConfig, chunk: int, gamma: int, layout=None) -> tuple[dict, dict]:
  """`decode_chunk` with speculative decoding: up to `chunk` draft-and-verify calls over all slots (module
  docstring). Returns (state, counts): `SPEC_COUNTS` summed over the calls (calls; advance, the slots the write
  index moved; live_calls, live slot-calls; accepted / proposed drafts of live slots; emitted columns)."""
  version = jnp.asarray(version, jnp.int32)
  d_params, d_cfg = speculative.resolve_drafter(params, draft_params, model_cfg, sampler_cfg.spec_draft_layers)
  v_params, cache = decode_view(params, state["cache"], model_cfg)
  vd_params, dcache = speculative.drafter_view(d_params, state["dcache"], d_cfg)
  G, N = gamma + 1, sampler_cfg.max_new_tokens
  i_G = jnp.arange(G, dtype=jnp.int32)

  def call(carry: tuple[dict, dict]) -> tuple[dict, dict]:
    st, n = carry
    live_S, unfed_S, step_S = st["live_S"], st["unfed_S"], st["step_S"]
    prev_S = jnp.maximum(step_S - 1, 0)
    last_S = jnp.take_along_axis(st["tokens_SN"], prev_S[:, None], axis=1)[:, 0]
    pos0_S = st["start_S"] + prev_S
    keys_S = jax.vmap(lambda k, c: jax.random.fold_in(jax.random.fold_in(k, SPEC_STREAM), c))(st["keys_S"], step_S)
    start = st["cache"]["index"]
    # the last column of every unfed slot is real; the drafts only of live ones (MoE: a stop token is fed alone)
    n_S, block_SG, mu_SG, got, cache, dcache = speculative.draft_and_verify(
        v_params, vd_params, st["cache"], st["dcache"], last_S, pos0_S, unfed_S, live_S, keys_S, model_cfg, d_cfg,
        sampler_cfg, gamma)
    m = jnp.where(jnp.any(live_S), jnp.min(jnp.where(live_S, n_S + 1, G)), 1)  # the common minimum
    cache = {**cache, "index": start + m}
    dcache = speculative.roll_back(dcache, start, jnp.full(last_S.shape, m, jnp.int32), "min", G)
    # each live slot writes its first m tokens, through its first stop id and up to column N - 1
    stop_SG = is_stop(block_SG, sampler_cfg.stop_ids)
    col_SG = step_S[:, None] + i_G[None, :]
    write_SG = (live_S[:, None] & (i_G[None, :] < m) & ~(jnp.cumsum(stop_SG, axis=1) - stop_SG > 0)
                & (col_SG < N))
    new_S = jnp.sum(write_SG, axis=1).astype(jnp.int32)
    stopped_S = jnp.any(write_SG & stop_SG, axis=1)
    step_new_S = step_S + new_S
    live_new_S = live_S & ~stopped_S & (step_new_S < N)
    put = lambda name, x_SG: _put_block(st[name], x_SG, col_SG, write_SG)
    recs = {name: put(name, x) for name, x in got.items()}  # μ's records, when asked
    st = {
        **st,
        **recs,
        "cache": cache,
        "dcache": dcache,
        "tokens_SN": put("tokens_SN", block_SG),
        "logp_SN": put("logp_SN", mu_SG),
        "mask_SN": put("mask_SN", jnp.ones_like(mu_SG)),
        "versions_SN": put("versions_SN", jnp.broadcast_to(version, block_SG.shape)),
        "stopped_S": st["stopped_S"] | stopped_S,
        "live_S": live_new_S,
        # the next call feeds the last written column of a live slot; MoE: also a stop this call did not feed (a
        # written column i < m - 1 was fed here as draft i + 1), as `generate` feeds a stop token
        "unfed_S": live_new_S | (model_cfg.is_moe & stopped_S & (new_S == m) & (step_new_S < N)),
        "step_S": step_new_S,
    }
    live = jnp.sum(live_S).astype(jnp.float32)
    n = {"calls": n["calls"] + 1, "advance": n["advance"] + m, "live_calls": n["live_calls"] + live,
         "accepted": n["accepted"] + jnp.sum(jnp.where(live_S, n_S, 0)), "proposed": n["proposed"] + gamma * live,
         "emitted": n["emitted"] + jnp.sum(new_S)}
    return st, n

  def keep_going(carry: tuple[dict, dict]) -> Array:
    return (carry[1]["calls"] < chunk) & jnp.any(carry[0]["unfed_S"])

  zero = jnp.zeros((), jnp.float32)
  counts = {"calls": jnp.zeros((), jnp.int32), "advance": jnp.zeros((), jnp.int32), "live_calls": zero,
            "accepted": zero, "proposed": zero, "emitted": zero}
  state, counts = jax.lax.while_loop(keep_going, call, ({**state, "cache": cache, "dcache": dcache}, counts))
  state = {**state, "cache": stack_cache(state["cache"]), "dcache": speculative.drafter_stack(state["dcache"])}
  return _constrain(state, layout), counts


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg", "layout"), donate_argnames=("state",))
def prefill_slots(params: dict, state: dict, rows_k: Array, src_k: Array, prompt_uP: Array, len_u: Array,
                  keys_k: Array, version: Array, model_cfg: ModelConfig, sampler_cfg: SamplerConfig,
                  draft_params: dict | None = None, layout=None) -> dict:
  """Admits k requests into slots `rows_k` (a row index >= S pads the bucket and is dropped): prefills the u
  distinct left-padded prompts once each (request i holds prompt `src_k[i]`: the G rows of a GRPO group admitted
  together share one prefill), writes the keys/values into slots [index - P, index) of those rows (the rest of
  the row cleared to segment 0), and samples their column 0 with `version`. With speculation the drafter
  (`draft_params`, None: the policy's first layers) prefills its own cache the same way."""
  P = prompt_uP.shape[1]
  positions_uP, segment_ids_uP = prompt_layout(len_u, P)
  prompt_uP = jnp.where(segment_ids_uP > 0, prompt_uP, sampler_cfg.pad_id).astype(jnp.int32)
  small, logits_uV = prefill_rows(params, prompt_uP, positions_uP, segment_ids_uP, model_cfg, P,
                                   sampler_cfg.kv_dtype, sampler_cfg.kv_window_arg)
  small, logits_kV, len_k = take_rows(small, src_k), logits_uV[src_k], len_u[src_k]
  dsmall = None
  if "dcache" in state and not speculative.is_head_state(state["dcache"]):
    d_params, d_cfg = speculative.resolve_drafter(params, draft_params, model_cfg, sampler_cfg.spec_draft_layers)
    dsmall = take_rows(prefill_rows(d_params, prompt_uP, positions_uP, segment_ids_uP, d_cfg, P)[0], src_k)
  return _fill_rows(state, small, dsmall, logits_kV, rows_k, len_k, keys_k, version, model_cfg, sampler_cfg, layout)


def _fill_rows(state: dict, small: dict, dsmall: dict | None, logits_kV: Array, rows_k: Array, len_k: Array,
               keys_k: Array, version: Array, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, layout) -> dict:
  """`state` with rows `rows_k` holding requests whose contexts (`len_k` real tokens, left-padded to P) the
  P-slot caches `small` (the policy's) and `dsmall` (a layers drafter's; None: none, or a head, whose feature is
  zeroed) hold: written at slots [index - P, index), the rest of those rows cleared; column 0 sampled from
  `logits_kV` with `version`."""
  P = small["segment_ids_BS"].shape[1]
  spec = {}
  if "dcache" in state and speculative.is_head_state(state["dcache"]):  # a head: no feature yet in those slots
    spec["dcache"] = {"feat_BD": state["dcache"]["feat_BD"].at[rows_k].set(0, mode="drop")}
  elif "dcache" in state:
    spec["dcache"] = _place(state["dcache"], dsmall, rows_k, P)
  N = sampler_cfg.max_new_tokens
  put = lambda buf, val: buf.at[rows_k].set(val, mode="drop")
  k = rows_k.shape[0]
  admitted = {
      **state,
      **spec,
      "cache": _place(state["cache"], small, rows_k, P),
      "step_S": put(state["step_S"], jnp.zeros((k,), jnp.int32)),
      "start_S": put(state["start_S"], len_k.astype(jnp.int32)),
      "keys_S": put(state["keys_S"], keys_k),
      "live_S": put(state["live_S"], jnp.ones((k,), bool)),
      "stopped_S": put(state["stopped_S"], jnp.zeros((k,), bool)),
      "logits_SV": put(state["logits_SV"], logits_kV),
      "tokens_SN": put(state["tokens_SN"], jnp.full((k, N), sampler_cfg.pad_id, jnp.int32)),
      "logp_SN": put(state["logp_SN"], jnp.zeros((k, N), jnp.float32)),
      "mask_SN": put(state["mask_SN"], jnp.zeros((k, N), jnp.float32)),
      "versions_SN": put(state["versions_SN"], jnp.zeros((k, N), jnp.int32)),
      **{name: put(state[name], jnp.full((k,) + state[name].shape[1:], sampler_cfg.pad_id if "ids" in name else 0,
                                         state[name].dtype)) for name in _record_names(sampler_cfg)},
  }
  # Column 0 of the admitted rows only: the other live rows sample theirs in the next chunk.
  only_S = jnp.zeros_like(state["live_S"]).at[rows_k].set(True, mode="drop")
  emitted = _emit({**admitted, "live_S": only_S}, jnp.asarray(version, jnp.int32), sampler_cfg, model_cfg.is_moe)
  keep = lambda a, b: jnp.where(only_S.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  out = {name: keep(emitted[name], admitted[name]) for name in
         ("tokens_SN", "logp_SN", "mask_SN", "versions_SN", "stopped_S", "step_S", "unfed_S",
          *_record_names(sampler_cfg))}
  return _constrain({**admitted, **out, "live_S": jnp.where(only_S, emitted["live_S"], admitted["live_S"])}, layout)


def _take_slots(cache: dict, rows_k: Array, src_kT: Array, valid_kT: Array) -> dict:
  """A cache of T slots per row: row i holds cache row `rows_k[i]`'s slots `src_kT[i]` where `valid_kT[i]`, empty
  slots (zeros: segment 0) elsewhere; a row index >= S reads a clipped row (a dropped pad)."""
  out = {"index": jnp.asarray(src_kT.shape[1], jnp.int32)}
  for name, x in cache.items():
    if name == "index":
      continue
    ax = _SLOT_AXIS[name]
    xr = jnp.take(x, rows_k, axis=ax - 1, mode="clip")
    tail = (1,) * (x.ndim - ax - 1)
    idx = jnp.clip(src_kT, 0, x.shape[ax] - 1).reshape((1,) * (ax - 1) + src_kT.shape + tail)
    got = jnp.take_along_axis(xr, idx, axis=ax)
    out[name] = jnp.where(valid_kT.reshape(idx.shape), got, jnp.zeros((), x.dtype))
  return out


def _kept(cache: dict, rows_k: Array, lo_k: Array, kept_k: Array, P: int, E: int) -> dict:
  """A cache of P + E slots per resumed row, write index P: row i's `kept_k[i]` resident slots from `lo_k[i]`
  (positions 0 .. kept - 1) gathered to end at slot P, room for E appended tokens after them."""
  t_P = jnp.arange(P, dtype=jnp.int32)[None, :]
  first_k = P - kept_k
  kept = _take_slots(cache, rows_k, lo_k[:, None] - first_k[:, None] + t_P, t_P >= first_k[:, None])
  room = lambda name, x: [(0, E) if a == _SLOT_AXIS[name] else (0, 0) for a in range(x.ndim)]
  return {name: x if name == "index" else jnp.pad(x, room(name, x)) for name, x in kept.items()}


def _aligned(grown: dict, kept_k: Array, len_k: Array, P: int) -> dict:
  """`_kept`'s cache after `len_k[i]` tokens were appended to row i: its whole context, [P - kept, P + len), moved
  left by len to end at slot P, as a prefill of it leaves it (P slots)."""
  t_P = jnp.arange(P, dtype=jnp.int32)[None, :]
  ctx_k = kept_k + len_k
  aligned = _take_slots(grown, jnp.arange(len_k.shape[0]), len_k[:, None] + t_P, t_P >= P - ctx_k[:, None])
  return {**aligned, "index": jnp.asarray(P, jnp.int32)}


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg", "width", "layout"),
                   donate_argnames=("state",))
def resume_slots(params: dict, state: dict, rows_k: Array, lo_k: Array, kept_k: Array, suffix_kE: Array,
                 len_k: Array, keys_k: Array, version: Array, model_cfg: ModelConfig, sampler_cfg: SamplerConfig,
                 width: int, draft_params: dict | None = None, layout=None) -> dict:
  """Admits k requests that continue the context resident in slots `rows_k` (a row index >= S pads the bucket and
  is dropped): row i keeps the first `kept_k[i]` tokens its slots hold from slot `lo_k[i]` on (a prefix of what
  its last request left: that request's context and completion but the last column, which no forward fed for
  sure) and appends the rest of its context, `len_k[i]` tokens (`suffix_kE`, right-padded: e.g. that last column,
  then an environment's observation), with one forward over them (`continuation.extend`), instead of prefilling
  the whole context. The row then holds the context as `prefill_slots` leaves an admitted prompt (left-padded to
  the engine's `width` P, at slots [index - P, index)), and column 0 is sampled with `version`. A layers
  drafter's cache is continued the same way (`speculative.extend_drafter`, from the same slots); a head's feature
  is zeroed, as at any admission."""
  P, E = width, suffix_kE.shape[1]
  no_logits_kV = jnp.zeros((rows_k.shape[0], model_cfg.vocab_size), jnp.float32)  # every row appends >= 1 token
  logits_kV, small = extend(params, _kept(state["cache"], rows_k, lo_k, kept_k, P, E), suffix_kE, len_k, kept_k,
                            no_logits_kV, model_cfg, sampler_cfg.kv_window_arg)
  dsmall = None
  if "dcache" in state and not speculative.is_head_state(state["dcache"]):
    grown = speculative.extend_drafter(params, draft_params, _kept(state["dcache"], rows_k, lo_k, kept_k, P, E),
                                       suffix_kE, len_k, kept_k, model_cfg=model_cfg,
                                       n_layers=sampler_cfg.spec_draft_layers)
    dsmall = _aligned(grown, kept_k, len_k, P)
  return _fill_rows(state, _aligned(small, kept_k, len_k, P), dsmall, logits_kV, rows_k, kept_k + len_k, keys_k,
                    version, model_cfg, sampler_cfg, layout)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnames=("cache",))
def shift_cache(cache: dict, d: Array, layout=None) -> dict:
  """The cache with every row's slots moved d to the left (slots [0, d) dropped, cleared slots enter at the
  right) and the write index moved back by d: frees room once no live request reads slots [0, d)."""
  out = {"index": cache["index"] - d}
  for name, x in cache.items():
    if name == "index":
      continue
    ax, W = _SLOT_AXIS[name], x.shape[_SLOT_AXIS[name]]
    rolled = jnp.roll(x, -d, axis=ax)
    if name == "segment_ids_BS":  # the wrapped-in slots are empty
      rolled = jnp.where(jnp.arange(W)[None, :] < W - d, rolled, 0)
    out[name] = rolled
  return _constrain({"cache": out}, layout)["cache"]


def _distinct_prompts(prompt_kP: np.ndarray, len_k: np.ndarray) -> tuple[list[int], np.ndarray]:
  """(the first request of each distinct prompt, each request's distinct-prompt number); a prompt is its real
  tokens (the pads of a left-padded row do not count)."""
  number, firsts, src = {}, [], []
  P = prompt_kP.shape[1]
  for i, n in enumerate(len_k):
    key = prompt_kP[i, P - int(n):].tobytes()
    if key not in number:
      number[key] = len(firsts)
      firsts.append(i)
    src.append(number[key])
  return firsts, np.asarray(src)


def _bucket(k: int, slots: int) -> int:
  """Prefill batch for k admissions: the next power of two, at most the slot count (few compilations)."""
  return min(slots, 1 << (k - 1).bit_length())


class SlotEngine:
  """The host shell of continuous batching: a queue of requests, the slot each holds, the shared write index.

  `submit(tag, prompt_P, length, key)` queues one request (a prompt left-padded to the engine's `width`; its key, a
  device key or a `HostKey`, draws column n with `fold_in(key, n)`); `step(params, version)` admits queued requests
  into free slots (in submission order), decodes one chunk, and returns `(tag, columns)` for every request that
  finished in it (`columns`: tokens_N, behavior_logp_N, mask_N, versions_N, finished). Callers may submit between
  steps (the async source admits groups as admission allows; an episode queues its next turn when the environment
  answers), and switch `params`/`version` between steps: the next chunk and admissions use them (an in-flight update
  stalls the slots for at most one chunk). The device state lives in `state`; everything else is queues and counters
  (`slot_steps`, `live_steps`, `prefill_calls`; with speculation a step is a draft-and-verify call and
  `spec_counts` sums `SPEC_COUNTS`, `spec_stats` turns them into `generate`'s spec_* metrics).
  `layout` (`SlotLayout`; None: one device): the state's slots split over mesh axes (`slot_shardings`), so each
  device decodes its share of the slots, as a static batch's rows on a mesh.

  `resident=True` keeps a finished request's keys/values in its slot (parked: its context and completion but the
  last column, which no forward fed for sure), and admits a later request that shares a prefix with them into that
  slot by `resume_slots`: the shared prefix stays, only the rest is fed (the last column and e.g. an environment's
  observation) instead of prefilling the whole context (`resumed` counts them). A request submitted
  with a `keep` id (an episode) continues the slot its id's last request parked, if they share any prefix; one
  without takes the parked slot sharing the longest prefix with it, if that prefix is at least half its context
  (the harness endpoint: a conversation's next call extends its last one, whose id the engine is not told). It
  re-prefills instead when nothing is shared (an eviction rewrote the context), when other parameters computed
  the slot's keys/values than the ones admitting it (a version switch), or when the slot was reclaimed: a parked
  slot is given to a queued request when no slot is free (least recently parked first), or dropped when the write
  index would run more than `width` slots past what the cache holds for it (its cache rows have P + N + C + P
  slots: P more than without). `release(keep)` drops a parked slot. The log-probs equal a re-prefill's up to float
  rounding.
  """

  def __init__(self, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, *, slots: int, chunk: int, width: int,
               layout=None, resident: bool = False):
    check_supported(sampler_cfg)
    if slots < 1 or chunk < 1:
      raise ValueError(f"continuous batching: slots={slots} and chunk={chunk} must be >= 1")
    self.model_cfg, self.sampler_cfg, self.slots, self.chunk, self.width = model_cfg, sampler_cfg, slots, chunk, width
    self.layout, self.resident = layout, resident
    self.extra = width if resident else 0  # how far a parked row's first token may fall behind, beyond P + N
    self.gamma = engine_gamma(sampler_cfg, slots)
    self.spec_counts = dict.fromkeys(SPEC_COUNTS, 0.0)
    self.state = None  # built at the first admission (the key's shape comes from the first request)
    self.queue: deque = deque()  # (tag, prompt_P, length, key, keep)
    self.tag_S: list = [None] * slots
    # owner: -1 free, 1 a request, 2 parked (a finished request's keys/values kept for its `keep` id)
    self.owner_S, self.base_S = np.full((slots,), -1), np.zeros((slots,), np.int64)
    self.lo_S = np.zeros((slots,), np.int64)  # the slot of the row's first real token
    self.ids_S: list = [None] * slots  # the real ids the row's cache holds (resident: context, then completion)
    self.keep_S: list = [None] * slots
    self.kver_S: list = [None] * slots  # the version that computed all of the row's keys/values (None: several)
    self.parked: dict = {}  # keep id -> slot, least recently parked first
    self.index, self.slot_steps, self.live_steps = width, 0, 0
    self.prefill_calls = self.resumed = 0

  def submit(self, tag: Any, prompt_P, length: int, key: Array, keep: Any = None) -> None:
    prompt_P = np.asarray(prompt_P, np.int32)
    if prompt_P.shape != (self.width,) or not 0 < int(length) <= self.width:
      raise ValueError(f"SlotEngine.submit: a prompt of width {self.width} with 1..{self.width} real tokens, got "
                       f"shape {prompt_P.shape} and length {length}")
    if self.resident and keep is None:  # parked under an id of its own; found again by its prefix
      keep = _Unnamed()
    self.queue.append((tag, prompt_P, int(length), key, keep if self.resident else None))

  def release(self, keep: Any) -> None:
    """Drops the slot parked for `keep`, if any (its context changed other than by appending)."""
    s = self.parked.pop(keep, None)
    if s is not None:
      self.owner_S[s], self.keep_S[s], self.ids_S[s] = -1, None, None

  @property
  def held(self) -> int:
    """Requests in slots (decoding, or finished and not yet returned)."""
    return int((self.owner_S == 1).sum())

  @property
  def idle(self) -> bool:
    return not self.queue and not self.held

  @property
  def kv_bits(self) -> float | None:
    """Bits per cached key/value element of the slots' cache (`cache.kv_bits`; None before the first admission)."""
    return None if self.state is None else kv_bits(self.state["cache"])

  def spec_stats(self) -> dict:
    """`generate`'s speculative metrics over every call so far ({} without speculation)."""
    if not self.gamma:
      return {}
    c = self.spec_counts
    return {"spec_calls": c["calls"], "spec_accept_rate": c["accepted"] / max(c["proposed"], 1.0),
            "spec_tokens_per_call": c["emitted"] / max(c["live_calls"], 1.0)}

  def _resumable(self, version: int) -> list[tuple[int, tuple, int]]:
    """Takes from the queue the requests that continue a parked slot's keys/values of `version`: (slot, request,
    ids kept) each. A named request whose parked slot shares nothing with it releases that slot and stays queued."""
    out, rest = [], deque()
    for req in self.queue:
      ids = req[1][self.width - req[2]:]
      if isinstance(req[4], _Unnamed):  # the parked slot sharing the longest prefix, if it is half the context
        shared = {k: self._shared(s, ids, version) for k, s in self.parked.items()}
        k = max(shared, key=shared.get, default=None)
        kept = shared[k] if k is not None and 2 * shared[k] >= len(ids) else 0
      else:
        k = req[4] if req[4] in self.parked else None
        kept = self._shared(self.parked[k], ids, version) if k is not None else 0
        if k is not None and not kept:
          self.release(k)
      if not kept:
        rest.append(req)
        continue
      out.append((self.parked.pop(k), req, kept))
    self.queue = rest
    return out

  def _shared(self, s: int, ids: np.ndarray, version: int) -> int:
    """How many of `ids` parked slot s can keep: their common prefix with what it holds, short of the last id
    (one at least is fed for the logits of column 0); 0 when other parameters computed its keys/values."""
    held = self.ids_S[s]
    if self.kver_S[s] != version:
      return 0
    n = min(len(held), len(ids) - 1)
    differ = np.flatnonzero(held[:n] != ids[:n])
    return int(differ[0]) if len(differ) else n

  def _occupy(self, s: int, req: tuple) -> None:
    """Slot s now holds request `req`, its context at [index - length, index) (the row's layout at admission)."""
    self.tag_S[s], self.keep_S[s], self.owner_S[s] = req[0], req[4], 1
    self.base_S[s], self.lo_S[s] = self.index - self.width, self.index - req[2]
    self.ids_S[s] = req[1][self.width - req[2]:]

  def step(self, params: dict, version: int, draft_params: dict | None = None) -> list[tuple[Any, dict]]:
    """Admit (resume parked slots, fill free ones) → one decode chunk → harvest (park) → shift; the requests that
    finished, as (tag, columns). `draft_params`: a distilled drafter's (with speculation; None drafts with the
    policy's first `spec_draft_layers` layers)."""
    for s in np.flatnonzero(self.owner_S == 1):  # this chunk decodes with `version`
      if self.kver_S[s] != version:
        self.kver_S[s] = None
    resumes = self._resumable(version) if self.parked else []
    free = list(np.flatnonzero(self.owner_S < 0))
    while len(free) < len(self.queue) and self.parked:  # a queued request takes the least recently parked slot
      keep = next(iter(self.parked))
      free.append(self.parked[keep])
      self.release(keep)
    take = min(len(free), len(self.queue))
    if (take or resumes) and self.state is None:
      first = resumes[0][1] if resumes else self.queue[0]
      self.state = init_state(self.model_cfg, self.sampler_cfg, self.slots, self.width, self.chunk,
                              _stack_keys([first[3]]), head=head_drafter.is_head(draft_params), extra=self.extra)
      if self.layout is not None:
        self.state = jax.device_put(self.state, slot_shardings(self.state, self.layout))
    if resumes:
      self.state = self._resume(params, resumes, version, draft_params)
    if take:
      reqs = [self.queue.popleft() for _ in range(take)]
      rows = np.asarray(sorted(free)[:take])
      self.state = _admit(params, self.state, rows, reqs, version, self.model_cfg, self.sampler_cfg,
                          draft_params, self.layout)
      self.prefill_calls += 1
      for s, r in zip(rows, reqs):
        self._occupy(s, r)
        self.kver_S[s] = version
    if not self.held:
      return []
    state = self.state
    unfed = bool(np.asarray(state["unfed_S"]).any())  # live slots (and, MoE, stop tokens still to feed)
    if unfed and self.gamma:  # draft-and-verify calls
      state, counts = speculate_chunk(params, draft_params, state, version, self.model_cfg, self.sampler_cfg,
                                      self.chunk, self.gamma, self.layout)
      counts = {k: float(v) for k, v in jax.device_get(counts).items()}
      for k, v in counts.items():
        self.spec_counts[k] += v
      self.index, self.slot_steps = self.index + int(counts["advance"]), self.slot_steps + self.slots * int(counts["calls"])
      self.live_steps += int(counts["live_calls"])
    elif unfed:
      step_before = int(np.asarray(state["step_S"]).sum())
      state, steps = decode_chunk(params, state, version, self.model_cfg, self.sampler_cfg, self.chunk, self.layout)
      self.index, self.slot_steps = self.index + int(steps), self.slot_steps + self.slots * int(steps)
      self.live_steps += int(np.asarray(state["step_S"]).sum()) - step_before  # one column per live slot-step
    done = _harvest(state, self.owner_S, self.tag_S, self.base_S, self.width + self.sampler_cfg.max_new_tokens)
    for s, _, cols in done:
      self._park(s, cols)
    self.state = state
    self._shift()
    return [(tag, cols) for _, tag, cols in done]

  def _park(self, s: int, cols: dict) -> None:
    """Slot s's request finished (`_harvest` freed it): a resident engine keeps its keys/values for its `keep` id
    (an `_Unnamed` one when it was submitted without) when one version computed them all: its context and
    completion but the last column."""
    keep, self.keep_S[s] = self.keep_S[s], None
    if keep is None or self.kver_S[s] is None:
      self.ids_S[s] = None
      return
    self.release(keep)  # an older slot of the same id (a request submitted twice) is dropped
    n = int(np.asarray(cols["mask_N"]).sum())
    self.ids_S[s] = np.concatenate([self.ids_S[s], np.asarray(cols["tokens_N"][:n - 1], np.int32)])
    self.owner_S[s], self.parked[keep] = 2, s

  def _shift(self) -> None:
    """Drops parked slots the write index ran too far past, then moves the cache left past the slots no held or
    parked row reads any more."""
    for keep, s in list(self.parked.items()):
      if self.index - self.lo_S[s] > self.width + self.sampler_cfg.max_new_tokens + self.extra:
        self.release(keep)
    held, parked = self.owner_S == 1, self.owner_S == 2
    d = min([self.index - self.width] + ([int(self.base_S[held].min())] if held.any() else []) +
            ([int(self.lo_S[parked].min())] if parked.any() else []))
    if d > 0:  # no request or parked row reads slots [0, d) any more
      state = self.state
      for name in ("cache", "dcache"):
        if name in state and not speculative.is_head_state(state[name]):
          state[name] = shift_cache(state[name], jnp.asarray(d, jnp.int32), self.layout)
      self.index -= d
      self.base_S[held | parked] -= d
      self.lo_S[held | parked] -= d

  def _resume(self, params: dict, resumes: list, version: int, draft_params: dict | None) -> dict:
    """`resume_slots` of the requests `resumes` ((slot, request, ids kept) each), padded to power-of-two buckets (of
    requests and of appended tokens)."""
    S, W, k = self.slots, self.width, len(resumes)
    kb = _bucket(k, S)
    kept = [n for _, _, n in resumes]
    suffixes = [req[1][W - req[2]:][n:] for _, req, n in resumes]
    E = 1 << (max(map(len, suffixes)) - 1).bit_length()
    suffix_kE = np.zeros((kb, E), np.int32)
    for i, x in enumerate(suffixes):
      suffix_kE[i, :len(x)] = x
    pad = kb - k
    rows_k = np.asarray([s for s, _, _ in resumes] + [S] * pad, np.int32)
    lo_k = np.asarray([self.lo_S[s] for s, _, _ in resumes] + [0] * pad, np.int32)
    kept_k = np.asarray(kept + [0] * pad, np.int32)
    len_k = np.asarray([len(x) for x in suffixes] + [1] * pad, np.int32)
    keys = [req[3] for _, req, _ in resumes]
    keys_k = _stack_keys(keys + [keys[0]] * pad)
    state = resume_slots(params, self.state, rows_k, lo_k, kept_k, suffix_kE, len_k, keys_k, version,
                         self.model_cfg, self.sampler_cfg, W, draft_params, self.layout)
    self.resumed += k
    for s, req, _ in resumes:
      self._occupy(s, req)  # its keys/values: all `version`'s (checked in `_resumable`)
    return state


class _Unnamed:
  """The `keep` id of a request submitted to a resident engine without one: its parked slot is found by prefix."""


def generate_slots(params: dict, prompt_tokens_RP, prompt_len_R, keys_R: Array, model_cfg: ModelConfig,
                   sampler_cfg: SamplerConfig, *, slots: int, chunk: int, version: int = 0,
                   poll: Poll | None = None, draft_params: dict | None = None, layout=None) -> dict:
  """Samples up to N = `sampler_cfg.max_new_tokens` tokens after each of R left-padded prompts with S = `slots`
  decode slots (a `SlotEngine`), refilling a slot with the next queued request (in request order) once its
  request finished.

  `keys_R`: one key per request (column n draws with `fold_in(keys_R[r], n)`); `chunk`: decode steps between
  boundaries (finished rows leave, free slots refill, `poll(version)` may hand newer (version, params)).
  Returns host arrays in request order with `generate`'s keys (tokens_BN, mask_BN, behavior_logp_BN, lengths_B,
  finished_B, sequence_BT, positions_BT, segment_ids_BT, completion_mask_BT) plus versions_BN (the version that
  sampled each token), and the counters slot_steps (S × decode steps run) and live_steps (the slot-steps that
  decoded an unfinished request; 1 - live/slot is the share wasted on free or finished slots). With speculation
  (`sampler_cfg.spec_gamma`; `draft_params` a distilled drafter's, None the policy's first layers) a step is a
  draft-and-verify call and the result adds `generate`'s spec_calls, spec_accept_rate and spec_tokens_per_call.
  `gen_kv_bits`: the slots' cache format, as `generate` reports its own (`cache.kv_bits`).
  `layout`: where the slots live on the sampler's mesh, beside `params` (`SlotLayout`; None: one device).
  """
  prompt_RP, len_R = np.asarray(prompt_tokens_RP, np.int32), np.asarray(prompt_len_R, np.int32)
  R, P = prompt_RP.shape
  N = sampler_cfg.max_new_tokens
  engine = SlotEngine(model_cfg, sampler_cfg, slots=slots, chunk=chunk, width=P, layout=layout)
  out = {"tokens_BN": np.full((R, N), sampler_cfg.pad_id, np.int32), "mask_BN": np.zeros((R, N), np.float32),
         "behavior_logp_BN": np.zeros((R, N), np.float32), "versions_BN": np.zeros((R, N), np.int32),
         "finished_B": np.zeros((R,), bool)}
  sc = sampler_cfg
  for name, k in ((n, sc.behavior_topk) for n in behavior.TOPK_FIELDS if sc.behavior_topk):
    out[name] = np.full((R, N, k), sc.pad_id, np.int32) if "ids" in name else np.zeros((R, N, k), np.float32)
  for name, k in ((n, sc.mc_samples) for n in behavior.MC_FIELDS if sc.mc_samples):
    out[name] = np.full((R, N, k), sc.pad_id, np.int32) if "ids" in name else np.zeros((R, N, k), np.float32)
  for r, key in enumerate(host_key_rows(keys_R)):
    engine.submit(r, prompt_RP[r], len_R[r], key)
  while not engine.idle:
    for r, cols in engine.step(params, version, draft_params):
      out["tokens_BN"][r], out["behavior_logp_BN"][r] = cols["tokens_N"], cols["behavior_logp_N"]
      out["mask_BN"][r], out["versions_BN"][r], out["finished_B"][r] = cols["mask_N"], cols["versions_N"], cols["finished"]
      for name in _record_names(sc):
        out[name][r] = cols[name]
      if "routes_TLk" in cols:  # MoE: the sampler's expert ids for routing replay
        out.setdefault("routes_BTLk", np.zeros((R,) + cols["routes_TLk"].shape, np.int32))[r] = cols["routes_TLk"]
    newer = poll(version) if poll is not None else None
    if newer is not None:
      version, params = newer
  return {**_assemble(out, prompt_RP, len_R, sampler_cfg, engine.slot_steps, engine.live_steps),
          **engine.spec_stats(), **({} if engine.kv_bits is None else {"gen_kv_bits": engine.kv_bits})}


def assemble_requests(cols_R: list[dict], prompt_RP, prompt_len_R, sampler_cfg: SamplerConfig) -> dict:
  """`generate`'s outputs (host arrays, plus versions_BN) of R requests from the columns `SlotEngine.step` returned
  for each, in request order: what a caller that submits requests itself (the async slot worker) hands on."""
  stack = lambda name, dtype: np.stack([np.asarray(c[name], dtype) for c in cols_R])
  out = {"tokens_BN": stack("tokens_N", np.int32), "mask_BN": stack("mask_N", np.float32),
         "behavior_logp_BN": stack("behavior_logp_N", np.float32), "versions_BN": stack("versions_N", np.int32),
         "finished_B": np.asarray([c["finished"] for c in cols_R], bool),
         **{name: np.stack([np.asarray(c[name]) for c in cols_R]) for name in _record_names(sampler_cfg)},
         **({"routes_BTLk": np.stack([c["routes_TLk"] for c in cols_R])} if "routes_TLk" in cols_R[0] else {})}
  out = _assemble(out, np.asarray(prompt_RP, np.int32), np.asarray(prompt_len_R, np.int32), sampler_cfg, 0, 0)
  return {k: v for k, v in out.items() if k not in ("slot_steps", "live_steps")}


def _admit(params: dict, state: dict, rows: np.ndarray, reqs: list, version: int, model_cfg: ModelConfig,
           sampler_cfg: SamplerConfig, draft_params: dict | None = None, layout=None) -> dict:
  """`prefill_slots` of queued requests `reqs` ((tag, prompt_P, length, key) each) into free slots `rows`, padded
  to power-of-two buckets (of requests and of distinct prompts) so that a run compiles it a few times only."""
  S, take = state["live_S"].shape[0], len(reqs)
  prompt_kP = np.stack([r[1] for r in reqs])
  len_k = np.asarray([r[2] for r in reqs], np.int32)
  kb = _bucket(take, S)
  uniq, src = _distinct_prompts(prompt_kP, len_k)
  ub = _bucket(len(uniq), S)
  u_pick = np.asarray(uniq + [0] * (ub - len(uniq)))
  rows_k = np.concatenate([rows, np.full((kb - take,), S)]).astype(np.int32)  # row S: a dropped pad
  src_k = np.concatenate([src, np.zeros((kb - take,), np.int64)]).astype(np.int32)
  keys = [r[3] for r in reqs]
  keys_k = _stack_keys(keys + [keys[0]] * (kb - take))
  return prefill_slots(params, state, rows_k, src_k, prompt_kP[u_pick], len_k[u_pick], keys_k, version,
                       model_cfg, sampler_cfg, draft_params, layout)


@functools.partial(jax.jit, static_argnames=("length",))
def _row_routes(routes_LBSk: Array, rows_d: Array, starts_d: Array, length: int) -> Array:
  """[d, length, L, k]: the expert ids of `length` slots from `starts_d[i]` of cache row `rows_d[i]` (MoE). Slots
  past the cache's end (columns after the request finished: it never wrote them) read as expert 0."""
  S = routes_LBSk.shape[2]

  def one(r, a):
    idx_T = a + jnp.arange(length)
    got_LTk = jnp.take(routes_LBSk[:, r], jnp.minimum(idx_T, S - 1), axis=1)
    return jnp.where((idx_T < S)[None, :, None], got_LTk, 0)

  return jnp.moveaxis(jax.vmap(one)(rows_d, starts_d), 1, 2)


def _harvest(state: dict, owner_S: np.ndarray, tag_S: list, base_S: np.ndarray | None = None,
             length: int = 0) -> list[tuple[int, Any, dict]]:
  """(slot, tag, columns) of every held slot whose request finished; frees those slots (`owner_S` -1). An MoE cache
  also gives each request's routes ("routes_TLk", T = `length` = P + N): its prompt and completion sit in the
  contiguous slots from `base_S` (the index at admission minus P), column n at slot base + P + n, as in
  `generate`'s cache."""
  done = np.flatnonzero((owner_S == 1) & ~np.asarray(state["live_S"]) & ~np.asarray(state["unfed_S"]))
  if not len(done):
    return []
  routes = None
  if "routes_LBSk" in state["cache"]:
    routes = np.asarray(_row_routes(state["cache"]["routes_LBSk"], jnp.asarray(done, jnp.int32),
                                    jnp.asarray(base_S[done], jnp.int32), length))
  records = [k for k in behavior.TOPK_FIELDS + behavior.MC_FIELDS if k in state]
  host = jax.device_get({k: state[k] for k in ("tokens_SN", "logp_SN", "mask_SN", "versions_SN", "stopped_S",
                                                *records)})
  out = [(s, tag_S[s], {"tokens_N": host["tokens_SN"][s], "behavior_logp_N": host["logp_SN"][s],
                     "mask_N": host["mask_SN"][s], "versions_N": host["versions_SN"][s],
                     "finished": bool(host["stopped_S"][s]), **{k: host[k][s] for k in records},
                     **({} if routes is None else {"routes_TLk": routes[i]})}) for i, s in enumerate(done)]
  owner_S[done] = -1
  for s in done:
    tag_S[s] = None
  return out


def _assemble(out: dict, prompt_RP: np.ndarray, len_R: np.ndarray, sampler_cfg: SamplerConfig, slot_steps: int,
              live_steps: int) -> dict:
  """The per-request columns completed with `generate`'s sequence layout (host arrays) and the counters."""
  R, P = prompt_RP.shape
  N = out["mask_BN"].shape[1]
  first_R = P - len_R
  col_P = np.arange(P)
  real_RP = col_P[None, :] >= first_R[:, None]
  positions_RP = np.where(real_RP, col_P[None, :] - first_R[:, None], 0).astype(np.int32)
  prompt_RP = np.where(real_RP, prompt_RP, sampler_cfg.pad_id).astype(np.int32)
  mask_RN = out["mask_BN"]
  return {
      **out,
      "lengths_B": mask_RN.sum(axis=1).astype(np.int32),
      "sequence_BT": np.concatenate([prompt_RP, out["tokens_BN"]], axis=1),
      "positions_BT": np.concatenate([positions_RP, (len_R[:, None] + np.arange(N)[None, :]).astype(np.int32)], 1),
      "segment_ids_BT": np.concatenate([real_RP.astype(np.int32), mask_RN.astype(np.int32)], axis=1),
      "completion_mask_BT": np.concatenate([np.zeros((R, P), np.float32), mask_RN], axis=1),
      "slot_steps": slot_steps,
      "live_steps": live_steps,
      **window_record(sampler_cfg.kv_window_arg, R),  # a sinks + window cache: what each token could see (SMD)
  }
