"""Token log-probabilities (+ entropy, top-k) from a chunked lm-head.

The full [B, T, V] logits are never materialised: the final hidden states are computed once, then the
sequence is cut into chunks of C positions and each chunk applies the lm-head and reduces its logits
to per-token statistics. C is `chunk_size` capped so that one chunk's [B, C, V] logits hold at most
`max_chunk_elements` values (16 MiB of float32 by default): at a real vocabulary (V = 49,152, B = 32)
that is a few positions per chunk. The chunk function is rematerialised (`jax.checkpoint`), so the
backward pass recomputes one chunk's logits at a time instead of storing all of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import project
from jaxrl_llm.models.cache import groups_equal
from jaxrl_llm.models.transformer import hidden_shared_prefix, hidden_with_routing, lm_head_weights
from jaxrl_llm.vocab_chunks import MAX_CHUNK_ELEMENTS, chunk_positions, map_time_chunks

Array = jax.Array


def logprobs_from_logits(logits_BTV: Array, targets_BT: Array, temperature: float = 1.0) -> Array:
  """Reference path: log_softmax(logits / temperature) at the target ids, float32 [B, T]."""
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32) / temperature, axis=-1)
  return jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


def _head_stats(logits_BCV: Array, targets_BC: Array, temperature: float, with_entropy: bool,
                topk: int, gather_ids_BCk: Array | None = None) -> dict:
  """Per-token statistics of softmax(logits / temperature) for one chunk."""
  scaled_BCV = logits_BCV / temperature
  lse_BC = jax.nn.logsumexp(scaled_BCV, axis=-1)
  out = {"logp_BT": jnp.take_along_axis(scaled_BCV, targets_BC[..., None], axis=-1)[..., 0] - lse_BC}
  if with_entropy:
    # H = -sum p log p = lse - sum p * z, with z the tempered logits.
    probs_BCV = jnp.exp(scaled_BCV - lse_BC[..., None])
    out["entropy_BT"] = lse_BC - jnp.sum(probs_BCV * scaled_BCV, axis=-1)
  if topk:
    vals_BCk, ids_BCk = jax.lax.top_k(scaled_BCV, topk)
    out["topk_logp_BTk"] = vals_BCk - lse_BC[..., None]
    out["topk_ids_BTk"] = ids_BCk
    # log(1 - sum_k p_k) from the logits outside the top-k (exact; no 1 - sum cancellation).
    b_BCk, c_BCk = jnp.indices(ids_BCk.shape)[:2]
    in_top_BCV = jnp.zeros(scaled_BCV.shape, bool).at[b_BCk, c_BCk, ids_BCk].set(True)
    out["topk_residual_logp_BT"] = jax.nn.logsumexp(jnp.where(in_top_BCV, -jnp.inf, scaled_BCV), axis=-1) - lse_BC
  if gather_ids_BCk is not None:
    got_BCk = jnp.take_along_axis(scaled_BCV, jnp.maximum(gather_ids_BCk, 0), axis=-1) - lse_BC[..., None]
    out["gathered_logp_BTk"] = jnp.where(gather_ids_BCk >= 0, got_BCk, -jnp.inf)
  return out


def token_logprobs(params: dict, tokens_BT: Array, targets_BT: Array, cfg: ModelConfig, *,
                   positions_BT: Array | None = None, segment_ids_BT: Array | None = None,
                   temperature: float = 1.0, chunk_size: int = 256, with_entropy: bool = False,
                   topk: int = 0, perturb: tuple[Array, Array] | None = None,
                   routes_BTLk: Array | None = None, query_start: int = 0, gather_ids_BTk: Array | None = None,
                   max_chunk_elements: int = MAX_CHUNK_ELEMENTS, return_hidden: bool = False,
                   mask_BTT: Array | None = None) -> dict:
  """Log-probs of `targets_BT` given `tokens_BT` (the caller shifts: targets = next tokens).

  The distribution is softmax(logits / temperature): use the sampler's temperature so the learner
  scores tokens under the distribution they were drawn from.

  Args:
    params, tokens_BT, cfg, positions_BT, segment_ids_BT, perturb, routes_BTLk: as in
      `models.hidden_with_routing` (routes_BTLk replays MoE expert ids, aligned with tokens_BT).
    targets_BT: int ids whose log-probs are returned (any value at padding positions).
    temperature: > 0.
    chunk_size: positions per lm-head chunk; T need not be a multiple (padded internally).
    with_entropy: also return the entropy of the tempered distribution.
    topk: if > 0, also return the k most likely ids, their log-probs and the log of the rest's mass.
    query_start: static; score only targets query_start..T-1 (see `hidden_with_routing`): the
      per-token outputs then have T - query_start positions.
    gather_ids_BTk: optional int ids [B, T - query_start, k]; also return the log-probs at them
      (differentiable; -inf at ids < 0), e.g. the student at the teacher's top-k ids.
    max_chunk_elements: cap on B * C * V per chunk (see `chunk_positions`).
    return_hidden: also return "hidden_BTD", the final hidden states of the scored positions (compute
      dtype, differentiable), e.g. for a `vocab_chunks.VocabHead` of full-distribution losses.
    mask_BTT: optional explicit attention mask (`hidden_with_routing`), e.g. a compressed KV cache's
      visibility (`cache.window_attention_mask`: the SMD shadow forward).

  Returns:
    dict with float32 "logp_BT", and optionally "entropy_BT", "topk_logp_BTk", "topk_ids_BTk",
    "topk_residual_logp_BT" (log(1 - sum of the top-k probabilities); -inf when they hold all the mass),
    "gathered_logp_BTk"; for an MoE model also "routes_BTLk" (expert ids used) and the scalar
    "router_aux_loss".
  """
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
  h_BTD, routing = hidden_with_routing(params, tokens_BT, cfg, positions_BT=positions_BT,
                                      segment_ids_BT=segment_ids_BT, perturb=perturb, routes_BTLk=routes_BTLk,
                                      query_start=query_start, mask_BTT=mask_BTT)
  out = {**head_logprobs(h_BTD, targets_BT[:, query_start:], lm_head_weights(params, cfg), temperature=temperature,
                        chunk_size=chunk_size, with_entropy=with_entropy, topk=topk, gather_ids_BTk=gather_ids_BTk,
                        max_chunk_elements=max_chunk_elements), **routing}
  if return_hidden:
    out["hidden_BTD"] = h_BTD
  return out


def query_hidden(params: dict, tokens_BT: Array, cfg: ModelConfig, *, query_start: int, group_size: int = 1,
                 positions_BT: Array | None = None, segment_ids_BT: Array | None = None) -> Array:
  """`hidden_with_routing(..., query_start=query_start)[0]`, computing the first query_start + 1 columns
  once per group of `group_size` rows when the batch allows it (differentiable either way).

  With G = group_size > 1, a dense model and query_start >= 1: if every group of G consecutive rows has
  equal tokens, positions and segments in those columns (the shared prompt of a GRPO group, checked on
  device), `transformer.hidden_shared_prefix` runs them for B/G rows; otherwise (checked false) the
  plain forward. The values agree up to rounding either way.
  """
  full = lambda: hidden_with_routing(params, tokens_BT, cfg, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                                     query_start=query_start)[0]
  B, T = tokens_BT.shape
  Pp = query_start + 1  # the shared columns; the last one's output is the first one wanted
  if group_size == 1 or cfg.is_moe or query_start < 1 or Pp >= T:
    return full()
  if B % group_size:
    raise ValueError(f"group_size={group_size} must divide the batch of {B} rows")
  grouped = groups_equal(tokens_BT[:, :Pp], group_size)
  for x in (positions_BT, segment_ids_BT):
    if x is not None:
      grouped = grouped & groups_equal(x[:, :Pp], group_size)
  shared = lambda: hidden_shared_prefix(params, tokens_BT, cfg, prefix_len=Pp, group_size=group_size,
                                        positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
  return jax.lax.cond(grouped, shared, full)


def token_logprobs_shared(params: dict, tokens_BT: Array, targets_BT: Array, cfg: ModelConfig, *, query_start: int,
                          group_size: int, positions_BT: Array | None = None, segment_ids_BT: Array | None = None,
                          temperature: float = 1.0, chunk_size: int = 256, with_entropy: bool = False,
                          topk: int = 0, gather_ids_BTk: Array | None = None,
                          max_chunk_elements: int = MAX_CHUNK_ELEMENTS, return_hidden: bool = False) -> dict:
  """`token_logprobs` (dense model, no perturbation or route replay) with the columns before
  `query_start` computed once per group of `group_size` rows that share them (`query_hidden`):
  the reference / old-policy / teacher scoring of the G completions of one prompt."""
  h_BTD = query_hidden(params, tokens_BT, cfg, query_start=query_start, group_size=group_size,
                       positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
  out = head_logprobs(h_BTD, targets_BT[:, query_start:], lm_head_weights(params, cfg), temperature=temperature,
                      chunk_size=chunk_size, with_entropy=with_entropy, topk=topk, gather_ids_BTk=gather_ids_BTk,
                      max_chunk_elements=max_chunk_elements)
  if return_hidden:
    out["hidden_BTD"] = h_BTD
  return out


def head_logprobs(h_BTD: Array, targets_BT: Array, w_DV: Array, *, temperature: float = 1.0, chunk_size: int = 256,
                  with_entropy: bool = False, topk: int = 0, gather_ids_BTk: Array | None = None,
                  max_chunk_elements: int = MAX_CHUNK_ELEMENTS) -> dict:
  """The chunked lm-head of `token_logprobs` on given final hidden states `h_BTD` (compute dtype) and
  head weights `w_DV` (`models.lm_head_weights`): per-token statistics without any [B, T, V] array.
  Arguments and outputs as in `token_logprobs` (targets already aligned with h_BTD)."""
  B, T, _ = h_BTD.shape
  C = chunk_positions(B, T, w_DV.shape[-1], chunk_size, max_chunk_elements)
  xs = (h_BTD, targets_BT) + (() if gather_ids_BTk is None else (gather_ids_BTk,))

  def chunk(w_DV, h_BCD, targets_BC, gather_ids_BCk=None):
    logits_BCV = project(h_BCD, w_DV, preferred_element_type=jnp.float32)
    return _head_stats(logits_BCV, targets_BC, temperature, with_entropy, topk, gather_ids_BCk)

  return map_time_chunks(chunk, w_DV, xs, C)
