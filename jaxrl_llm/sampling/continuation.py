"""Continuing sequences from a live KV cache: append tokens (`extend`), then decode one more turn (`decode_turn`).

What multi-turn episodes need (`rollout.turn_sampler.CachedTurns`): after a turn the cache already holds the
episode so far, so the next turn prefills only the tokens appended since (an environment's observation) and
decodes from there, instead of re-running the whole episode.

The cache's write index is shared by all rows (`models.cache`): a row that appends fewer tokens than the
widest row, or finishes its turn early, leaves slots with segment id 0, which no real token attends to. So
rows at different lengths share one batch, and a row's attention sees exactly its own tokens at their RoPE
positions, as in the full forward pass: the log-probs equal a re-prefill's up to float rounding.
Sampling keys and noise follow `sampler.generate` (column n draws with `fold_in(key, n)`), so with equal
logits a turn samples the tokens `generate` would sample from the re-prefilled context.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import hidden_with_cache, logits_from_hidden
from jaxrl_llm.sampling import behavior
from jaxrl_llm.sampling.config import SamplerConfig
from jaxrl_llm.sampling.sampler import decode_carry, decode_columns, emit_token, live_before

Array = jax.Array


def appended_layout(len_B: Array, start_pos_B: Array, E: int) -> tuple[Array, Array]:
  """(positions_BE, segment_ids_BE) of E columns appended per row: row b's first `len_B[b]` at positions
  `start_pos_B[b]`, ... (segment 1), the rest padding (position 0, segment 0)."""
  col_E = jnp.arange(E, dtype=jnp.int32)
  real_BE = col_E[None, :] < len_B[:, None]
  return jnp.where(real_BE, start_pos_B[:, None] + col_E[None, :], 0).astype(jnp.int32), real_BE.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model_cfg", "kv_window"))
def extend(params: dict, cache: dict, tokens_BE: Array, len_B: Array, start_pos_B: Array, last_logits_BV: Array,
           model_cfg: ModelConfig, kv_window: tuple[int, int] | None = None) -> tuple[Array, dict]:
  """Appends row b's first `len_B[b]` tokens of `tokens_BE` (right-padded) at positions `start_pos_B[b]`, ...;
  returns (logits_BV of the token after each row's last appended one, the cache). A row that appends nothing
  keeps `last_logits_BV` (the logits after its last cached token, from `decode_turn`)."""
  positions_BE, segment_ids_BE = appended_layout(len_B, start_pos_B, tokens_BE.shape[1])
  h_BED, cache = hidden_with_cache(params, tokens_BE.astype(jnp.int32), cache, model_cfg, positions_BT=positions_BE,
                                   segment_ids_BT=segment_ids_BE, kv_window=kv_window)
  last_B11 = jnp.maximum(len_B - 1, 0)[:, None, None]
  h_B1D = jnp.take_along_axis(h_BED, jnp.broadcast_to(last_B11, (h_BED.shape[0], 1, h_BED.shape[2])), axis=1)
  logits_BV = logits_from_hidden(params, h_B1D, model_cfg)[:, 0]
  return jnp.where((len_B > 0)[:, None], logits_BV, last_logits_BV), cache


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg"))
def decode_turn(params: dict, cache: dict, first_logits_BV: Array, start_pos_B: Array, key: Array,
                model_cfg: ModelConfig, sampler_cfg: SamplerConfig) -> tuple[dict, dict, Array]:
  """Samples up to N = `sampler_cfg.max_new_tokens` tokens per row from `first_logits_BV` on, at positions
  `start_pos_B[b]`, `start_pos_B[b] + 1`, ... (column n with `fold_in(key, n)`, stop ids as in `generate`).

  Every sampled token is fed through the cache before returning (the last column too), so the cache holds
  the whole turn. Returns ({tokens_BN, mask_BN, behavior_logp_BN, lengths_B}, cache, last_logits_BV: the
  logits after each row's last sampled token, for a next `extend` that appends nothing to that row).
  """
  B, N = first_logits_BV.shape[0], sampler_cfg.max_new_tokens
  emit = lambda carry, logits_BV: emit_token(carry, logits_BV, key, sampler_cfg)
  carry = emit({**decode_carry(cache, B, N, sampler_cfg), "last_logits_BV": first_logits_BV}, first_logits_BV)
  carry = decode_columns(params, carry, start_pos_B, emit, live_before(N), model_cfg, sampler_cfg.kv_window_arg,
                         continuing=True)
  out = {"tokens_BN": carry["tokens_BN"], "mask_BN": carry["mask_BN"], "behavior_logp_BN": carry["logp_BN"],
         "lengths_B": jnp.sum(carry["mask_BN"], axis=1).astype(jnp.int32),
         **{k: carry[k] for k in behavior.TOPK_FIELDS + behavior.MC_FIELDS if k in carry}}  # μ's records, if asked
  return out, carry["cache"], carry["last_logits_BV"]
