"""Partial rollouts: resumable chunked decoding that can switch parameter versions between chunks.

Between chunks of decode steps the driver asks whether a newer version was published; if so it
continues the same sequences with the new parameters and records the version of every token in
`versions_BN`. Two ways to treat the KV cache at a switch:
  - keep it (PipelineRL): earlier keys/values stay those of the old parameters; cheap, and the
    behaviour log-probs are those of the mixed computation that really produced each token;
  - `reprefill=True` (AReaL): recompute the cache of the prefix under the new parameters, so every
    token after the switch is exactly a sample of the new policy given its prefix.

The jitted pieces (`prefill`, `decode_until`, `reprefill_cache`) follow `sampling.generate` line
for line (left-padded prompts, key `fold_in(key, n)` for column n, the stop id included in the mask, pads
after it), so without a switch the result equals `generate`. Shapes are static: one compilation
per (B, P, N) bucket and pair of configs, whatever the chunk boundaries.

Speculative decoding (`sampler.spec_gamma`): the chunks are draft-and-verify calls (`speculative.decode_until`,
the loop `generate_speculative` runs) with the drafter of the current version (the policy's first layers, or
`draft_params`); a chunk ends at the first call boundary at or after its column, so a switch lands between calls
and every token is still an exact sample of the version that verified it. The drafter's cache is kept across a
switch (it only proposes: a stale drafter lowers acceptance, never changes the distribution).

MoE models also return `routes_BTLk` (routing replay, R3): the expert ids the KV cache holds for
each slot, i.e. the routes under which every later token was computed. Keeping the cache, a slot
keeps the routes of the version that fed it (older tokens keep old routes); `reprefill` re-routes
the prefix under the new version, which is what the tokens sampled after the switch saw (replaying
them for the tokens sampled before the switch is then approximate: one route set per sequence).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.models.cache import init_cache, kv_bits, ring_layout, window_record
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import hidden_with_cache
from jaxrl_llm.sampling import behavior, speculative
from jaxrl_llm.sampling.config import SamplerConfig
from jaxrl_llm.sampling.sampler import decode_columns, emit_token, live_before, prefill_grouped, prefill_prompts

Array = jax.Array
# poll(current_version) -> (newer_version, params) or None; poll(None) once generation has finished.
Poll = Callable[[Any], Any]


def _emit(carry: dict, logits_BV: Array, key: Array, version: Array, sampler_cfg: SamplerConfig) -> dict:
  """Samples column `step` exactly as `generate` does, and records the version that produced it."""
  out = emit_token(carry, logits_BV, key, sampler_cfg)
  return {**out, "versions_BN": carry["versions_BN"].at[:, carry["step"]].set(version)}


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg"))
def prefill(params: dict, prompt_tokens_BP: Array, prompt_len_B: Array, key: Array, version: Array,
            model_cfg: ModelConfig, sampler_cfg: SamplerConfig) -> dict:
  """Fills the cache with the prompts and samples completion column 0; returns the decode carry."""
  B, P = prompt_tokens_BP.shape
  N = sampler_cfg.max_new_tokens
  prompt_BP, positions_BP, segment_ids_BP, cache, first_logits_BV = prefill_prompts(
      params, prompt_tokens_BP, prompt_len_B, model_cfg, sampler_cfg, _ring(P, sampler_cfg))
  carry = {
      "step": jnp.zeros((), jnp.int32),
      "cache": cache,
      "prompt_BP": prompt_BP,
      "positions_BP": positions_BP,
      "segment_ids_BP": segment_ids_BP,
      "prompt_len_B": prompt_len_B.astype(jnp.int32),
      "tokens_BN": jnp.full((B, N), sampler_cfg.pad_id, jnp.int32),
      "logp_BN": jnp.zeros((B, N), jnp.float32),
      "mask_BN": jnp.zeros((B, N), jnp.float32),
      "versions_BN": jnp.zeros((B, N), jnp.int32),
      "done_B": jnp.zeros((B,), bool),
      **behavior.init_records(B, N, sampler_cfg),  # μ's top-k / MC candidates, when asked (`emit_token` writes)
  }
  return _emit(carry, first_logits_BV, key, jnp.asarray(version, jnp.int32), sampler_cfg)


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg"), donate_argnames=("carry",))
def decode_until(params: dict, carry: dict, key: Array, stop: Array, version: Array,
                 model_cfg: ModelConfig, sampler_cfg: SamplerConfig) -> dict:
  """Decodes with `params` until column `stop` (exclusive) is sampled or every row hit a stop id."""
  version = jnp.asarray(version, jnp.int32)
  emit = lambda c, logits_BV: _emit(c, logits_BV, key, version, sampler_cfg)
  # the same decode loop as `generate`
  return decode_columns(params, carry, carry["prompt_len_B"], emit,
                        live_before(jnp.minimum(stop, sampler_cfg.max_new_tokens)), model_cfg,
                        sampler_cfg.kv_window_arg, _ring(carry["prompt_BP"].shape[1], sampler_cfg))


def _ring(P: int, sampler_cfg: SamplerConfig) -> tuple[int, int, int] | None:
  """`generate`'s ring buffer for a "window" cache (`cache.ring_layout`): the layout is static, as in `generate`,
  because a compressed cache is never re-prefilled (`generate_partial` refuses `reprefill` with one)."""
  return ring_layout(P, sampler_cfg.max_new_tokens, sampler_cfg.kv_window_arg)


@functools.partial(jax.jit, static_argnames=("model_cfg", "group_size"), donate_argnames=("carry",))
def reprefill_cache(params: dict, carry: dict, model_cfg: ModelConfig, group_size: int = 1) -> dict:
  """Recomputes the KV cache of everything decoded so far under `params` (AReaL's switch).

  Slots 0..P+step-2 hold the prompt and the completion columns already fed to the model (column
  step-1 is fed by the next decode step); later slots get segment 0 and are overwritten before any
  query can attend to them. With `group_size` G > 1 the prompt is re-run once per group of G rows
  (`sampler.prefill_grouped`), then the completions of all rows attend to its copied keys/values
  (not for an MoE with capacity limits, whose token drops depend on how many tokens a call holds).
  """
  B, P = carry["prompt_BP"].shape
  N = carry["tokens_BN"].shape[1]
  S = carry["cache"]["positions_BS"].shape[1]  # P + N, or more (speculation's verify writes past the last column)
  fed_BN = carry["mask_BN"] * (jnp.arange(N)[None, :] < carry["step"] - 1)
  positions_BN = (carry["prompt_len_B"][:, None] + jnp.arange(N)[None, :]).astype(jnp.int32)
  if group_size == 1 or (model_cfg.is_moe and model_cfg.capacity_factor > 0):
    tokens_BT = jnp.concatenate([carry["prompt_BP"], carry["tokens_BN"]], axis=1)
    positions_BT = jnp.concatenate([carry["positions_BP"], positions_BN], axis=1)
    segment_ids_BT = jnp.concatenate([carry["segment_ids_BP"], fed_BN.astype(jnp.int32)], axis=1)
    _, cache = hidden_with_cache(params, tokens_BT, init_cache(model_cfg, B, S), model_cfg,
                                 positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
  else:
    cache, _ = prefill_grouped(params, carry["prompt_BP"], carry["positions_BP"], carry["segment_ids_BP"], model_cfg,
                               S, group_size)
    _, cache = hidden_with_cache(params, carry["tokens_BN"], cache, model_cfg, positions_BT=positions_BN,
                                 segment_ids_BT=fed_BN.astype(jnp.int32))
  index = (P + carry["step"] - 1).astype(jnp.int32)
  if "routes_LBSk" in cache:  # slots not fed yet keep their routes (the never-fed last slot holds 0..k-1)
    fed_S = jnp.arange(S) < index
    cache["routes_LBSk"] = jnp.where(fed_S[None, None, :, None], cache["routes_LBSk"], carry["cache"]["routes_LBSk"])
  return {**carry, "cache": {**cache, "index": index}}


def finalize(carry: dict) -> dict:
  """The outputs of `generate` (same keys and layout, `routes_BTLk` for MoE) plus `versions_BN` (int32)."""
  mask_BN = carry["mask_BN"]
  N = mask_BN.shape[1]
  positions_BN = (carry["prompt_len_B"][:, None] + jnp.arange(N)[None, :]).astype(jnp.int32)
  P = carry["prompt_BP"].shape[1]
  routes = {"routes_BTLk": jnp.moveaxis(carry["cache"]["routes_LBSk"], 0, 2)} if "routes_LBSk" in carry["cache"] else {}
  return {
      **routes,
      **{k: carry[k] for k in behavior.TOPK_FIELDS + behavior.MC_FIELDS if k in carry},  # μ's records, if asked
      "tokens_BN": carry["tokens_BN"],
      "mask_BN": mask_BN,
      "behavior_logp_BN": carry["logp_BN"],
      "versions_BN": carry["versions_BN"],
      "lengths_B": jnp.sum(mask_BN, axis=1).astype(jnp.int32),
      "finished_B": carry["done_B"],
      "sequence_BT": jnp.concatenate([carry["prompt_BP"], carry["tokens_BN"]], axis=1),
      "positions_BT": jnp.concatenate([carry["positions_BP"], positions_BN], axis=1),
      "segment_ids_BT": jnp.concatenate([carry["segment_ids_BP"], mask_BN.astype(jnp.int32)], axis=1),
      "completion_mask_BT": jnp.concatenate([jnp.zeros((mask_BN.shape[0], P), jnp.float32), mask_BN], axis=1),
      "gen_kv_bits": jnp.float32(kv_bits(carry["cache"])),
  }


def generate_partial(version: int, params: dict, poll: Poll, prompt_tokens_BP: Array, prompt_len_B: Array,
                     key: Array, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, *, chunk_steps: int,
                     reprefill: bool = False, draft_params: dict | None = None,
                     on_version_end: Callable[[int, dict], None] | None = None) -> dict:
  """Generates like `sampling.generate`, polling for a newer version every `chunk_steps` columns.

  Args:
    version, params: the version the rollout was admitted at and its parameters.
    poll: `poll(current_version)` returns `(newer_version, newer_params)` to switch to, or None;
      it is called once more with None at the end (to release what it pinned).
    chunk_steps: columns per chunk; the switch happens at column multiples of it.
    reprefill: recompute the prefix's KV cache with the new parameters at a switch (else keep it).
    draft_params: with `sampler_cfg.spec_gamma`, a distilled drafter's parameters (None: the current version's
      first `spec_draft_layers` layers); the chunks then speculate (module docstring; "rows" layout: keep the cache).
    on_version_end: called as `on_version_end(version, out)` when a version stops sampling (at each switch, before
      the newer one takes over, and at the end, before `poll(None)`), `out` the outputs so far (as returned): the
      interruption route to exact old logits scores the version's tokens there, while its snapshot is held.
  Returns the `generate` dict plus `versions_BN`: the version that sampled each column (MoE:
  `routes_BTLk` as the final KV cache holds them, see the module docstring), μ's records when the sampler config
  asks for them, and `kv_window_B2` with a window cache. A compressed cache (int8, window) is kept across a switch
  (a window of sinks + window < N as `generate`'s ring buffer, when the chunks do not speculate). Also
  `gen_partial_polls`: the chunk boundaries at which it asked `poll` for newer parameters.
  """
  if chunk_steps < 1:
    raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
  if reprefill and sampler_cfg.kv_cache != "full":  # the re-prefill recomputes a full cache
    raise ValueError(f"partial rollouts with reprefill support sampler.kv_cache='full' only, got "
                     f"{sampler_cfg.kv_cache!r}")
  N = sampler_cfg.max_new_tokens
  gamma = speculative.gamma_of(sampler_cfg, prompt_tokens_BP.shape[0])
  spec = _Speculating(sampler_cfg, model_cfg, gamma, draft_params) if gamma else None
  if spec is not None and reprefill and sampler_cfg.spec_layout != "min":  # the re-prefill puts column n at P + n
    raise ValueError("partial rollouts with reprefill speculate with sampler.spec_layout='min' only")
  outputs = lambda c: finalize(c) if spec is None else spec.finish(c)
  try:
    if spec is None:
      carry = prefill(params, prompt_tokens_BP, prompt_len_B, key, version, model_cfg, sampler_cfg)
    else:
      carry = spec.start(params, prompt_tokens_BP, prompt_len_B, key, version)
    stop, polls = min(chunk_steps, N), 0
    while True:
      if spec is None:
        carry = decode_until(params, carry, key, stop, version, model_cfg, sampler_cfg)
      else:
        carry = spec.decode(params, carry, key, stop, version)
      if int(carry["step"]) >= N or bool(jnp.all(carry["done_B"])):
        break
      newer, polls = poll(version), polls + 1
      if newer is not None:
        if on_version_end is not None:
          on_version_end(version, outputs(carry))
        version, params = newer
        if reprefill:
          carry = reprefill_cache(params, carry, model_cfg, sampler_cfg.group_size)
      stop = min(max(stop, int(carry["step"])) + chunk_steps, N) if spec is not None else min(stop + chunk_steps, N)
    out = outputs(carry)
    if on_version_end is not None:
      on_version_end(version, out)
  finally:
    poll(None)
  # what each token could see, as `generate` records it (SMD)
  return {**out, **window_record(sampler_cfg.kv_window_arg, out["mask_BN"].shape[0]), "gen_partial_polls": polls}


class _Speculating:
  """`generate_partial`'s chunks as draft-and-verify calls (`speculative`'s start / decode_until / finish)."""

  def __init__(self, sampler_cfg: SamplerConfig, model_cfg: ModelConfig, gamma: int, draft_params: dict | None):
    self.sampler_cfg, self.model_cfg, self.gamma, self.draft_params = sampler_cfg, model_cfg, gamma, draft_params
    self.draft_cfg = dataclasses.replace(model_cfg, n_layers=sampler_cfg.spec_draft_layers)

  def _static(self) -> dict:
    return dict(model_cfg=self.model_cfg, draft_cfg=self.draft_cfg, sampler_cfg=self.sampler_cfg, gamma=self.gamma,
                layout=self.sampler_cfg.spec_layout)

  def start(self, params, prompt_tokens_BP, prompt_len_B, key, version) -> dict:
    return speculative.start_partial(params, self.draft_params, prompt_tokens_BP, prompt_len_B, key,
                                     version=jnp.asarray(version, jnp.int32), **self._static())

  def decode(self, params, carry, key, stop, version) -> dict:
    return speculative.decode_until(params, self.draft_params, carry, key, jnp.asarray(stop, jnp.int32),
                                    jnp.asarray(version, jnp.int32), **self._static())

  def finish(self, carry) -> dict:
    return speculative.finish_partial(carry, self.model_cfg, self.sampler_cfg)
