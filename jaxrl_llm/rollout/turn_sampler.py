"""How one turn of a batch of episodes is sampled: one interface, three implementations.

  turn(params, version, rows_b, contexts, key, cfg) -> {tokens_BN, lengths_B, behavior_logp_BN} (host numpy)

`rows_b` are the episode ids of the sampler rows (a padded batch repeats the first one), `contexts[i]` the
whole episode so far of row i (prompt ids + response ids, compact), `cfg` the turn's `SamplerConfig`.

- `Reprefill`: every turn re-prefills each context, left-padded to one width W = P + N (one compiled shape
  per batch bucket), over the run's mesh when it has one (`multiprocess.generate_on_mesh`).
- `CachedTurns` (`env.kv_cache`, one device): each episode's KV cache lives across turns; a turn appends only
  the ids added since the last one (the observation) with `sampling.continuation.extend`, then decodes with
  `decode_turn`. Rows of finished episodes leave the cache (`models.cache.take_rows`). It re-prefills (as
  `Reprefill` does, into a fresh cache) on the first turn, when the parameters' version changes (async
  episodes: the cache of the old parameters would make μ differ from the new version's log-probs), and when
  the cache's slots run out (the shared write index leaves unused slots behind rows that append less).
  The log-probs equal a re-prefill's up to float rounding (tested), so tokens agree but for near-ties.
  `forget(row)`: that episode's context was rewritten (an eviction, `rollout.evict`); the next turn re-prefills.
- `SlotTurns` (`rollout.slots` > 0, one device; it takes precedence over `env.kv_cache`): continuous batching
  (`sampling.continuous.SlotEngine`, S = `rollout.slots` slots, `rollout.slot_chunk` decode steps per chunk).
  A turn submits each live row's context, left-padded to W as `Reprefill` does, as one request and runs the
  engine until idle; a slot whose row's turn ended is refilled with the next row, so long-tailed turn lengths
  stop costing the longest row's steps for every row. Row i of the turn draws column n with
  `fold_in(fold_in(key, i), n)` (`generation.request_keys`): its tokens equal `generate`'s given those per-row
  keys (log-probs up to float rounding, tested), not `Reprefill`'s batch-key draw. The pad rows of a padded
  batch are copies of the first row's output (not decoded). `prefills`: the engine's admission batches;
  `slot_steps` / `live_steps`: slot-steps run / those that decoded an unfinished turn (the engine's counters).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import multiprocess
from jaxrl_llm.models.cache import take_rows
from jaxrl_llm.rollout.generation import request_keys
from jaxrl_llm.sampling import continuous, generate, prompt_layout
from jaxrl_llm.sampling.continuation import decode_turn, extend
from jaxrl_llm.sampling.sampler import prefill_grouped
from jaxrl_llm.tasks.tokenizer import pad_left, pad_right

_prefill = jax.jit(prefill_grouped, static_argnames=("model_cfg", "slots", "group_size"))


def _bucket(n: int) -> int:
  """Appended widths are rounded up to a power of two (few compiled `extend` shapes)."""
  return 1 << max(0, n - 1).bit_length()


class Reprefill:
  """Re-prefills every context each turn (module docstring)."""

  def __init__(self, gen, width: int, mesh=None):
    self.gen, self.width, self.mesh = gen, width, mesh
    self.prefills = 0  # one per turn

  def turn(self, params, version: int, rows_b: Sequence[int], contexts: Sequence[Sequence[int]], key, cfg) -> dict:
    del version, rows_b
    self.prefills += 1
    ctx_bW, len_b = pad_left(contexts, self.width, self.gen.sampler_cfg.pad_id)
    got, _ = multiprocess.generate_on_mesh(generate, params, ctx_bW, len_b, key, self.gen.model_cfg, cfg, self.mesh)
    return got

  def forget(self, row: int) -> None:
    """Episode `row`'s context changed other than by appending (an eviction): nothing is kept, nothing to do."""


class CachedTurns:
  """Keeps each episode's KV cache across turns (module docstring). Host state: the device cache, which cache
  row holds which episode, how many of each episode's ids it holds, and the version that computed it."""

  def __init__(self, gen, width: int):
    self.gen, self.width = gen, width
    self.slots = 2 * width  # a re-prefilled context fills `width`; the rest is room for turns and their gaps
    self.cache: dict | None = None
    self.last_logits_bV = None
    self.row_of: dict[int, int] = {}
    self.cached_len: dict[int, int] = {}
    self.version: int | None = None
    self.prefills = 0  # re-prefills so far (first turn included): tests and metrics

  def turn(self, params, version: int, rows_b: Sequence[int], contexts: Sequence[Sequence[int]], key, cfg) -> dict:
    cfg_decode = dataclasses.replace(cfg, group_size=1)  # the decode loop reads one cache per row
    suffixes = [list(c[self.cached_len[b]:]) if b in self.cached_len else None for b, c in zip(rows_b, contexts)]
    E = _bucket(max((len(s) for s in suffixes if s is not None), default=1))
    reuse = (self.cache is not None and version == self.version and all(s is not None for s in suffixes)
             and int(self.cache["index"]) + E + cfg.max_new_tokens <= self.slots)
    if reuse:
      take = [self.row_of[b] for b in rows_b]
      cache, last = self.cache, self.last_logits_bV
      if take != list(range(len(take))) or len(take) != last.shape[0]:
        idx = jnp.asarray(take, jnp.int32)
        cache, last = take_rows(cache, idx), jnp.take(last, idx, axis=0)
      tokens_bE, len_b = pad_right(suffixes, E, self.gen.sampler_cfg.pad_id)
      start_b = np.asarray([self.cached_len[b] for b in rows_b], np.int32)
      logits_bV, cache = extend(params, cache, tokens_bE, len_b, start_b, last, self.gen.model_cfg)
    else:
      cache, logits_bV = self._prefill(params, contexts, cfg.group_size)
    start_b = np.asarray([len(c) for c in contexts], np.int32)
    out, self.cache, self.last_logits_bV = decode_turn(params, cache, logits_bV, start_b, key, self.gen.model_cfg,
                                                       cfg_decode)
    out = jax.tree.map(np.asarray, out)
    self.version = version
    self.row_of, self.cached_len = {}, {}
    for i, b in enumerate(rows_b):
      if b not in self.row_of:  # a padded batch repeats its first episode: the first copy is the one kept
        self.row_of[b] = i
        self.cached_len[b] = len(contexts[i]) + int(out["lengths_B"][i])
    return out

  def forget(self, row: int) -> None:
    """Episode `row`'s context changed other than by appending (an eviction): its cache is stale, so the next
    turn re-prefills (every row: the cache is one batch)."""
    self.cached_len.pop(row, None)

  def _prefill(self, params, contexts, group_size: int) -> tuple[dict, Any]:
    ctx_bW, len_b = pad_left(contexts, self.width, self.gen.sampler_cfg.pad_id)
    positions_bW, segment_ids_bW = prompt_layout(jnp.asarray(len_b), self.width)
    self.prefills += 1
    return _prefill(params, jnp.asarray(ctx_bW), positions_bW, segment_ids_bW, model_cfg=self.gen.model_cfg,
                    slots=self.slots, group_size=group_size)


class SlotTurns:
  """Samples each turn with continuous batching (module docstring). Host state: one `SlotEngine`, rebuilt when
  the turn's sampler settings change, idle between turns."""

  def __init__(self, gen, width: int, slots: int, chunk: int):
    self.gen, self.width, self.slots, self.chunk = gen, width, slots, chunk
    self.engine: continuous.SlotEngine | None = None
    self.prefills = 0  # admission batches (`prefill_slots` calls) so far
    self._steps0 = (0, 0)  # (slot_steps, live_steps) of engines replaced so far

  @property
  def slot_steps(self) -> int:
    return self._steps0[0] + (self.engine.slot_steps if self.engine is not None else 0)

  @property
  def live_steps(self) -> int:
    return self._steps0[1] + (self.engine.live_steps if self.engine is not None else 0)

  def turn(self, params, version: int, rows_b: Sequence[int], contexts: Sequence[Sequence[int]], key, cfg) -> dict:
    cfg = dataclasses.replace(cfg, group_size=1)  # the engine prefills each distinct prompt once by itself
    engine = self._engine(cfg)
    ctx_bW, len_b = pad_left(contexts, self.width, cfg.pad_id)
    keys_b = request_keys(key, len(rows_b))
    first: dict[int, int] = {}  # episode -> its first row (a padded batch repeats its first episode)
    for i, b in enumerate(rows_b):
      if b not in first:
        first[b] = i
        engine.submit(i, ctx_bW[i], int(len_b[i]), keys_b[i])
    N = cfg.max_new_tokens
    out = {"tokens_BN": np.full((len(rows_b), N), cfg.pad_id, np.int32),
           "behavior_logp_BN": np.zeros((len(rows_b), N), np.float32), "lengths_B": np.zeros((len(rows_b),), np.int32)}
    while not engine.idle:
      if engine.queue and engine.held < engine.slots:  # this step admits queued rows (`SlotEngine.step`)
        self.prefills += 1
      for i, cols in engine.step(params, version):
        out["tokens_BN"][i], out["behavior_logp_BN"][i] = cols["tokens_N"], cols["behavior_logp_N"]
        out["lengths_B"][i] = int(cols["mask_N"].sum())
    for i, b in enumerate(rows_b):
      if first[b] != i:
        for k in out:
          out[k][i] = out[k][first[b]]
    return out

  def forget(self, row: int) -> None:
    """Episode `row`'s context changed other than by appending (an eviction): nothing is kept, nothing to do."""

  def _engine(self, cfg) -> continuous.SlotEngine:
    if self.engine is None or self.engine.sampler_cfg != cfg:
      if self.engine is not None:
        self._steps0 = (self.slot_steps, self.live_steps)
      self.engine = continuous.SlotEngine(self.gen.model_cfg, cfg, slots=self.slots, chunk=self.chunk,
                                          width=self.width)
    return self.engine
