"""Jitted generation: one prefill call over left-padded prompts, then a decode loop over a KV cache.

Shapes are static (one compilation per (B, P, N) bucket and pair of configs); the decode loop is a
`lax.while_loop` that also stops once every row has emitted a stop id (`SamplerConfig.stop_ids`).
With `SamplerConfig.group_size` G > 1 the prompt of each group of G rows is prefilled once and its
KV cache copied to the G rows (`prefill_grouped`); decoding then reads one cache per row.
`SamplerConfig.kv_cache` compresses the cache ("int8" keys/values, or a "window" of attention sinks +
sliding window): μ is then the compressed cache's policy while the learner scores the full context, the
mismatch SMD (`losses.smd`) corrects (`jaxrl_llm.models.cache`).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.models import cache as cache_lib
from jaxrl_llm.models.cache import groups_equal, init_cache, repeat_rows
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import (decode_view, forward_with_cache, hidden_with_cache, logits_from_hidden,
                                          stack_cache)
from jaxrl_llm.sampling import behavior
from jaxrl_llm.sampling.config import SamplerConfig
from jaxrl_llm.sampling.sample import (PREDRAW_MAX_ELEMENTS, is_row_keys, noise_shape, predraw_noise, row_noise,
                                       sample_token)

Array = jax.Array


def prompt_layout(prompt_len_B: Array, width: int) -> tuple[Array, Array]:
  """(positions_BP, segment_ids_BP) of prompts left-padded to `width`.

  Real tokens sit at the right end, positions count from the first real token, pads get
  position 0 and segment 0.
  """
  first_B = width - prompt_len_B
  col_P = jnp.arange(width, dtype=jnp.int32)
  real_BP = col_P[None, :] >= first_B[:, None]
  positions_BP = jnp.where(real_BP, col_P[None, :] - first_B[:, None], 0).astype(jnp.int32)
  return positions_BP, real_BP.astype(jnp.int32)


def prefill_rows(params: dict, prompt_BP: Array, positions_BP: Array, segment_ids_BP: Array,
                  model_cfg: ModelConfig, slots: int, kv_dtype: str = "compute",
                  kv_window: tuple[int, int] | None = None, route_len: int | None = None) -> tuple[dict, Array]:
  """(cache of `slots` slots holding the left-padded prompts, logits_BV after the last column); `kv_dtype` and
  `kv_window`: a compressed cache (`SamplerConfig.kv_dtype`, `SamplerConfig.kv_window_arg`); `route_len`: MoE
  route slots when they differ from `slots` (a ring buffer, `cache.ring_layout`)."""
  cache = init_cache(model_cfg, prompt_BP.shape[0], slots, kv_dtype, route_len)
  h_BPD, cache = hidden_with_cache(params, prompt_BP, cache, model_cfg, positions_BT=positions_BP,
                                   segment_ids_BT=segment_ids_BP, kv_window=kv_window)
  # Left padding puts every row's last real prompt token in the last column.
  return cache, logits_from_hidden(params, h_BPD[:, -1:], model_cfg)[:, 0]


def prefill_grouped(params: dict, prompt_BP: Array, positions_BP: Array, segment_ids_BP: Array,
                    model_cfg: ModelConfig, slots: int, group_size: int = 1, kv_dtype: str = "compute",
                    kv_window: tuple[int, int] | None = None, route_len: int | None = None) -> tuple[dict, Array]:
  """`prefill_rows` computed once per prompt group: (cache, logits_BV of the first completion token).

  With G = group_size > 1 and rows g·G .. g·G+G-1 holding one prompt (tokens, positions and segments
  equal), only rows 0, G, 2G, ... are run (B/G rows of prefill work) and their cache and logits are
  copied to the G rows of their group (`cache.repeat_rows`). The check runs on device (`lax.cond`):
  a batch whose groups differ is prefilled row by row, so the result never depends on the layout.
  """
  full = lambda: prefill_rows(params, prompt_BP, positions_BP, segment_ids_BP, model_cfg, slots, kv_dtype, kv_window,
                              route_len)
  G, B = group_size, prompt_BP.shape[0]
  if G == 1:
    return full()
  if B % G:
    raise ValueError(f"sampler.group_size={G} must divide the batch of {B} prompt rows")

  shared = lambda: prefill_per_group(params, prompt_BP, positions_BP, segment_ids_BP, model_cfg, slots, G, kv_dtype,
                                     kv_window, route_len)
  grouped = groups_equal(prompt_BP, G) & groups_equal(positions_BP, G) & groups_equal(segment_ids_BP, G)
  return jax.lax.cond(grouped, shared, full)


def prefill_per_group(params: dict, prompt_BP: Array, positions_BP: Array, segment_ids_BP: Array,
                      model_cfg: ModelConfig, slots: int, group_size: int, kv_dtype: str = "compute",
                      kv_window: tuple[int, int] | None = None, route_len: int | None = None) -> tuple[dict, Array]:
  """The shared branch of `prefill_grouped`, unchecked: runs rows 0, G, 2G, ... and copies each one's
  cache and logits to the G rows of its group (what the other rows hold is never read)."""
  G = group_size
  cache, logits_bV = prefill_rows(params, prompt_BP[::G], positions_BP[::G], segment_ids_BP[::G], model_cfg, slots,
                                   kv_dtype, kv_window, route_len)
  return repeat_rows(cache, G), jnp.repeat(logits_bV, G, axis=0)


def prefill_prompts(params: dict, prompt_tokens_BP: Array, prompt_len_B: Array, model_cfg: ModelConfig,
                    sampler_cfg: SamplerConfig, ring: tuple[int, int, int] | None = None, room: bool = True):
  """Runs the left-padded prompts through a fresh KV cache sized P + N, or P + sinks + window for a ring buffer
  `ring` (`cache.ring_layout`; `generate` only), once per prompt group when `sampler_cfg.group_size` > 1
  (see `prefill_grouped`). `room=False`: a cache of the P prompt slots only (MoE routes still P + N), which
  the decode loop widens (`decode_columns`' slots).

  Returns (prompt_BP with pads set to pad_id, positions_BP, segment_ids_BP, cache, logits_BV of the
  first completion token). Shared by `generate` and the partial-rollout sampler.
  """
  B, P = prompt_tokens_BP.shape
  positions_BP, segment_ids_BP = prompt_layout(prompt_len_B, P)
  prompt_BP = jnp.where(segment_ids_BP > 0, prompt_tokens_BP, sampler_cfg.pad_id).astype(jnp.int32)
  N = sampler_cfg.max_new_tokens
  cache, first_logits_BV = prefill_grouped(params, prompt_BP, positions_BP, segment_ids_BP, model_cfg,
                                           cache_lib.cache_slots(P, N, ring) if room else P, sampler_cfg.group_size,
                                           sampler_cfg.kv_dtype, sampler_cfg.kv_window_arg, P + N)
  return prompt_BP, positions_BP, segment_ids_BP, cache, first_logits_BV


def is_stop(token_B: Array, stop_ids: tuple[int, ...]) -> Array:
  """Whether each token is one of the (static, few) stop ids: an OR of comparisons, False when none."""
  hit_B = jnp.zeros(token_B.shape, bool)
  for i in stop_ids:
    hit_B = hit_B | (token_B == i)
  return hit_B


def draw_column(logits_BV: Array, key: Array, step: Array, sampler_cfg: SamplerConfig,
                noise_NBK: Array | None = None) -> tuple[Array, Array, dict]:
  """(token_B, logp_B, records) of one completion column per row, drawn from `logits_BV`.

  `step`: the column, one for every row (a scalar: row b draws with `fold_in(key, step)`, or with
  `fold_in(key[b], step)` when `key` holds one key per row, `sample.is_row_keys`) or one per row ([B], per-row
  keys only: the slot engine's rows stand at different columns). `noise_NBK`: the key's Gumbel noise of every
  column, drawn before the loop (`predraw_noise`; a scalar `step` only), None draws it here: the same bits.
  `records`: μ's top-k / Monte-Carlo candidates of the column (`behavior.record`) when `sampler_cfg.records`
  asks for them, each row's from its own step key; {} otherwise.
  """
  B = logits_BV.shape[0]
  per_row = jnp.ndim(step) == 1
  if per_row and not is_row_keys(key):
    raise ValueError("draw_column: one column per row needs one key per row")
  steps_B = step if per_row else jnp.full((B,), step, jnp.int32)
  gumbel_BK = None if noise_NBK is None else jax.lax.dynamic_index_in_dim(noise_NBK, step, keepdims=False)
  if gumbel_BK is None and is_row_keys(key):  # one key per row: row b's column n draws with fold_in(key_b, n)
    shape = noise_shape(B, logits_BV.shape[-1], sampler_cfg)
    gumbel_BK = None if shape is None else row_noise(key, steps_B, shape[1])
  step_key = None if is_row_keys(key) else jax.random.fold_in(key, step)  # per-row keys: the noise is drawn above
  token_B, logp_B = sample_token(logits_BV, step_key, sampler_cfg, gumbel_BK)
  recs = {}
  if sampler_cfg.records:  # μ's top-k / Monte-Carlo candidates (`behavior`), only when asked
    recs = (behavior.record_rows(logits_BV, token_B, logp_B, key, steps_B, sampler_cfg) if step_key is None else
            behavior.record(logits_BV, token_B, logp_B, step_key, sampler_cfg))
  return token_B, logp_B, recs


def emit_token(carry: dict, logits_BV: Array, key: Array, sampler_cfg: SamplerConfig,
               noise_NBK: Array | None = None) -> dict:
  """Samples completion column `carry["step"]` (`draw_column`: key `fold_in(key, step)`, or each row's own key),
  masks rows that already finished (pad, mask 0, logp 0), marks rows that emitted a stop id, and advances the
  step. With `sampler_cfg.records` it also writes the column's μ top-k / Monte-Carlo records into the carry's
  arrays of those names (`behavior.init_records`). The tokens are the same with or without `noise_NBK`.
  """
  step = carry["step"]
  token_B, logp_B, recs = draw_column(logits_BV, key, step, sampler_cfg, noise_NBK)
  live_B = ~carry["done_B"]
  if recs:
    recs = behavior.write_column(carry, recs, step, live_B, sampler_cfg.pad_id)
  token_B = jnp.where(live_B, token_B, sampler_cfg.pad_id).astype(jnp.int32)
  return {
      **carry,
      **recs,
      "step": step + 1,
      "tokens_BN": carry["tokens_BN"].at[:, step].set(token_B),
      "logp_BN": carry["logp_BN"].at[:, step].set(jnp.where(live_B, logp_B, 0.0)),
      "mask_BN": carry["mask_BN"].at[:, step].set(live_B.astype(jnp.float32)),
      "done_B": carry["done_B"] | (live_B & is_stop(token_B, sampler_cfg.stop_ids)),
  }


def previous_columns(carry: dict) -> tuple[Array, Array, Array]:
  """`decode_columns`' default (token_B, col_B, fed_B) of a static batch: every row's column `carry["step"] - 1`,
  fed as a real token where it is a completion token (mask 1: a stop id included), as padding after the row
  finished."""
  prev = carry["step"] - 1
  at = lambda x_BN: jax.lax.dynamic_index_in_dim(x_BN, prev, axis=1, keepdims=False)
  fed_B = at(carry["mask_BN"]) > 0
  return at(carry["tokens_BN"]), jnp.full(fed_B.shape, prev, jnp.int32), fed_B


def live_before(stop) -> Callable[[dict], Array]:
  """`decode_columns`' `more` of a static batch: go on while a row is live and the next column is before `stop`."""
  return lambda carry: (carry["step"] < stop) & ~jnp.all(carry["done_B"])


def feed_previous_column(params: dict, carry: dict, start_pos_B: Array, model_cfg: ModelConfig,
                         kv_window: tuple[int, int] | None = None, kv_ring: tuple[int, int, int] | None = None,
                         columns: Callable[[dict], tuple[Array, Array, Array]] = previous_columns
                         ) -> tuple[Array, Array, dict]:
  """Feeds each row's completion column (`columns(carry)` -> (token_B, col_B, fed_B)) through the carry's cache at
  position `start_pos_B + col_B` (rows with fed_B False as padding, segment 0). Returns (logits_BV after it, fed_B,
  the cache). `kv_window`: the sinks + window cache's (sinks, window), None for a full one; `kv_ring`: its ring
  buffer's layout when the cache is one (`cache.ring_layout`)."""
  token_B, col_B, fed_B = columns(carry)
  logits_B1V, cache = forward_with_cache(params, token_B[:, None].astype(jnp.int32), carry["cache"], model_cfg,
                                         positions_BT=(start_pos_B + col_B)[:, None].astype(jnp.int32),
                                         segment_ids_BT=fed_B[:, None].astype(jnp.int32), kv_window=kv_window,
                                         kv_ring=kv_ring)
  return logits_B1V[:, 0], fed_B, cache


def decode_columns(params: dict, carry: dict, start_pos_B: Array, emit: Callable[[dict, Array], dict],
                   more: Callable[[dict], Array], model_cfg: ModelConfig, kv_window: tuple[int, int] | None = None,
                   kv_ring: tuple[int, int, int] | None = None, continuing: bool = False,
                   columns: Callable[[dict], tuple[Array, Array, Array]] = previous_columns,
                   slots: int | None = None) -> dict:
  """The plain decode loop of every sampling path (`generate`, partial rollouts' chunks, `continuation.decode_turn`,
  the slot engine's `continuous.decode_chunk`): while `more(carry)`, feeds each row's last drawn column through the
  cache (`feed_previous_column`, in the decode view; `columns(carry)` gives each row's token and column and which
  rows are real: a static batch's rows share one, `previous_columns`, a slot engine's stand apart) and draws the next
  (`emit(carry, logits_BV)`); returns the carry with the cache stacked back. `continuing` (static): the carry
  keeps `last_logits_BV` (the logits after each row's last real token) and the loop ends by feeding the last
  column too, so the cache holds every sampled token (a next turn extends it). `slots`: the carry's cache is
  widened to that many slots first (`transformer.decode_view`; a prefill into the prompt's slots only)."""
  decode_params, cache = decode_view(params, carry["cache"], model_cfg, slots)

  def feed(c: dict) -> tuple[dict, Array]:
    logits_BV, fed_B, cache = feed_previous_column(decode_params, c, start_pos_B, model_cfg, kv_window, kv_ring,
                                                   columns)
    c = {**c, "cache": cache}
    if continuing:
      c["last_logits_BV"] = jnp.where(fed_B[:, None], logits_BV, c["last_logits_BV"])
    return c, logits_BV

  carry = jax.lax.while_loop(more, lambda c: emit(*feed(c)), {**carry, "cache": cache})
  if continuing:
    carry = feed(carry)[0]
  return {**carry, "cache": stack_cache(carry["cache"])}


def decode_carry(cache: dict, B: int, N: int, sampler_cfg: SamplerConfig) -> dict:
  """The decode loop's state before its first column (`emit_token` writes the columns): the cache, no tokens,
  no row done, and the empty records of μ the sampler config asks for."""
  return {
      "step": jnp.zeros((), jnp.int32),
      "cache": cache,
      "tokens_BN": jnp.full((B, N), sampler_cfg.pad_id, jnp.int32),
      "logp_BN": jnp.zeros((B, N), jnp.float32),
      "mask_BN": jnp.zeros((B, N), jnp.float32),
      "done_B": jnp.zeros((B,), bool),
      **behavior.init_records(B, N, sampler_cfg),
  }


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg"))
def generate(params: dict, prompt_tokens_BP: Array, prompt_len_B: Array, key: Array,
             model_cfg: ModelConfig, sampler_cfg: SamplerConfig) -> dict:
  """Samples up to N = sampler_cfg.max_new_tokens tokens after each prompt.

  Conventions:
  - Prompts are **left-padded** to the bucket width P: row b's real tokens are
    `prompt_tokens_BP[b, P - prompt_len_B[b]:]` (prompt_len_B >= 1); pad columns are ignored.
  - The model runs in `model_cfg.dtype` (e.g. a bf16 sampler against an fp32 learner).
  - `sampler_cfg.group_size` G > 1: rows g·G .. g·G+G-1 are expected to hold one prompt (GRPO groups,
    `np.repeat(prompts, G, 0)`); it is prefilled once per group (`prefill_grouped`). Same result up to
    rounding; a batch whose groups differ falls back to prefilling every row.
  - Step n draws with key `fold_in(key, n)`: no key is reused across steps. When the noise of all N
    steps is small (`sample.PREDRAW_MAX_ELEMENTS`) it is drawn before the decode loop, same bits.
    `key` of one key per row ([B, 2] raw / [B] typed): row b's step n draws its own noise with
    `fold_in(key[b], n)`, so a row's tokens do not depend on its neighbours (`sampling.continuous`).
  - A completion ends with its first stop id (EOS, end-of-turn, ...: `sampler_cfg.stop_ids`), which is
    included in the mask; later columns hold pad_id with mask 0 and behaviour logp 0.
  - `behavior_logp` follows `sampling.sample.sample_token` (temperature applied; renormalised
    truncated distribution under top-k/top-p; temperature-1 log-softmax when greedy).

  Returns a dict:
    tokens_BN (int32), mask_BN (float32, 1 on completion tokens incl. the stop id), behavior_logp_BN
    (float32), lengths_B (int32, completion length incl. the stop id), finished_B (bool, emitted a stop id), and
    the whole sequence for the learner, T = P + N:
    sequence_BT (prompt with pads set to pad_id, then tokens_BN), positions_BT, segment_ids_BT
    (1 on real tokens, 0 on pads), completion_mask_BT (mask_BN placed in columns P..P+N-1).
    A learner call `token_logprobs(params, sequence_BT[:, :-1], sequence_BT[:, 1:], cfg,
    positions_BT=positions_BT[:, :-1], segment_ids_BT=segment_ids_BT[:, :-1],
    temperature=sampler_cfg.temperature)["logp_BT"][:, P - 1:]` reproduces the sampler's context
    and scores the same tokens as `behavior_logp_BN`.
    MoE models (model_cfg.num_experts > 0) also return routes_BTLk (int32 [B, T, L, k]): the expert
    ids every layer used for each token of sequence_BT when it was fed through the model, prompt
    included (routing replay, R3). The last column was never fed (it holds experts 0..k-1); the
    learner replays `routes_BTLk[:, :-1]` with the inputs `sequence_BT[:, :-1]`.
    `sampler_cfg.behavior_topk` k > 0 adds behavior_topk_ids_BNk (int32) and behavior_topk_logp_BNk
    (float32) [B, N, k]; `sampler_cfg.mc_samples` J > 0 adds mc_ids_BNJ (int32) and mc_behavior_logp_BNJ
    (float32) [B, N, J] (`sampling.behavior`; finished columns hold pad_id / 0). The tokens are the same
    with or without them.
    `sampler_cfg.kv_cache`: "int8" / "window" decode from a compressed cache (behavior_logp_BN is then that
    cache's policy); "window" adds kv_window_B2 (int32 [B, 2], each row's (sinks, window)): what every token
    could see, from which the learner builds the shadow mask (`cache.window_attention_mask`).
    gen_kv_bits (float32 scalar): bits per cached key/value element of the cache it decoded from (`cache.kv_bits`:
    what shows the format in the metrics).
    Speculative decoding (`sampler_cfg.spec_gamma`) is routed by `sampling.dispatch.generate`, the package's
    `sampling.generate`; this function ignores the spec_* fields.
  """
  B, P = prompt_tokens_BP.shape
  N = sampler_cfg.max_new_tokens
  ring = cache_lib.ring_layout(P, N, sampler_cfg.kv_window_arg)  # a "window" cache: P + sinks + window slots
  # The prompt's slots only: the decode view adds the loop's room as it copies the cache into its layout, so the
  # full-width cache and its copy never coexist (for workload R, 0.38 GB less at the loop's start).
  prompt_BP, positions_BP, segment_ids_BP, cache, first_logits_BV = prefill_prompts(
      params, prompt_tokens_BP, prompt_len_B, model_cfg, sampler_cfg, ring, room=False)

  shape = noise_shape(B, first_logits_BV.shape[-1], sampler_cfg)
  predraw = shape is not None and N * math.prod(shape) <= PREDRAW_MAX_ELEMENTS
  if is_row_keys(key):
    draw = lambda n: row_noise(key, jnp.full((B,), n, jnp.int32), shape[1])
    noise_NBK = jax.vmap(draw)(jnp.arange(N)) if predraw else None
  else:
    noise_NBK = predraw_noise(key, N, shape) if predraw else None
  emit = lambda carry, logits_BV: emit_token(carry, logits_BV, key, sampler_cfg, noise_NBK)
  carry = decode_columns(params, emit(decode_carry(cache, B, N, sampler_cfg), first_logits_BV), prompt_len_B, emit,
                         live_before(N), model_cfg, sampler_cfg.kv_window_arg, ring,
                         slots=cache_lib.cache_slots(P, N, ring))

  mask_BN = carry["mask_BN"]
  positions_BN = (prompt_len_B[:, None] + jnp.arange(N)[None, :]).astype(jnp.int32)
  routes = {"routes_BTLk": jnp.moveaxis(carry["cache"]["routes_LBSk"], 0, 2)} if model_cfg.is_moe else {}
  records = {**{k: carry[k] for k in behavior.TOPK_FIELDS + behavior.MC_FIELDS if k in carry},
             **cache_lib.window_record(sampler_cfg.kv_window_arg, B)}
  return {
      **routes,
      **records,
      "gen_kv_bits": jnp.float32(cache_lib.kv_bits(carry["cache"])),
      "tokens_BN": carry["tokens_BN"],
      "mask_BN": mask_BN,
      "behavior_logp_BN": carry["logp_BN"],
      "lengths_B": jnp.sum(mask_BN, axis=1).astype(jnp.int32),
      "finished_B": carry["done_B"],
      "sequence_BT": jnp.concatenate([prompt_BP, carry["tokens_BN"]], axis=1),
      "positions_BT": jnp.concatenate([positions_BP, positions_BN], axis=1),
      "segment_ids_BT": jnp.concatenate([segment_ids_BP, mask_BN.astype(jnp.int32)], axis=1),
      "completion_mask_BT": jnp.concatenate([jnp.zeros((B, P), jnp.float32), mask_BN], axis=1),
  }
