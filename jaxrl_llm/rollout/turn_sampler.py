"""How one turn of a batch of episodes is sampled: one interface, three implementations.

  turn(params, version, rows_b, contexts, key, cfg) -> {tokens_BN, lengths_B, behavior_logp_BN} (host numpy)

`rows_b` are the episode ids of the sampler rows (a padded batch repeats the first one), `contexts[i]` the
whole episode so far of row i (prompt ids + response ids, compact), `cfg` the turn's `SamplerConfig`. MoE models
(routing replay) also get `routes_BXLk`: row i's expert ids indexed by context position (`routes_by_position`:
position p < len(context) is context token p, then the turn's tokens), from wherever the sampler fed each token.

- `Reprefill`: every turn re-prefills each context, left-padded to one width W = P + N (one compiled shape
  per batch bucket), over the run's mesh when it has one (`multiprocess.generate_on_mesh`); with speculative
  decoding `sampling.generate` drafts and verifies (`spec` keeps each turn's acceptance).
- `CachedTurns` (`env.kv_cache`; on one device or a one-process sampler mesh, its rows along the mesh's batch
  axes): each episode's KV cache lives across turns; a turn appends only
  the ids added since the last one (the observation) with `sampling.continuation.extend`, then decodes with
  `decode_turn`. Rows of finished episodes leave the cache (`models.cache.take_rows`). It re-prefills (as
  `Reprefill` does, into a fresh cache) on the first turn, when the parameters' version changes (async
  episodes: the cache of the old parameters would make μ differ from the new version's log-probs), and when
  the cache's slots run out (the shared write index leaves unused slots behind rows that append less).
  The log-probs equal a re-prefill's up to float rounding (tested), so tokens agree but for near-ties.
  `forget(row)`: that episode's context was rewritten (an eviction, `rollout.evict`); the next turn re-prefills.
  With speculative decoding (`sampler.spec_gamma`) the drafter keeps a cache of its own beside the policy's
  (prefilled, extended and cut to rows with it) and a turn is `speculative.decode_turn`'s draft-and-verify loop:
  it draws what `Reprefill`'s speculative `generate` draws (tokens equal, μ up to rounding, tested) and leaves
  the caches holding exactly the turn. A distilled drafter's cache keeps the weights it was computed with until
  the next re-prefill: that changes acceptance only, never the distribution.
- `SlotTurns` (`rollout.slots` > 0, before `CachedTurns`): continuous batching
  (`sampling.continuous.SlotEngine`, S = `rollout.slots` slots, `rollout.slot_chunk` decode steps per chunk; on
  a one-process sampler mesh its slots along the mesh's batch axes).
  A turn submits each live row's context, left-padded to W as `Reprefill` does, as one request and runs the
  engine until idle; a slot whose row's turn ended is refilled with the next row, so long-tailed turn lengths
  stop costing the longest row's steps for every row. `resident` (`env.kv_cache`): the episode's keys/values stay
  in its slot after its turn, and its next turn feeds only what was appended (`SlotEngine`'s `resident`; it
  re-prefills when the slot was reclaimed, the version changed, or `forget` was called); `resumed` counts those
  turns. `keyed=False` (the harness endpoint, whose rows are requests, not episodes): a row resumes whichever
  parked slot shares the longest prefix with its context (at least half of it). Episode b draws column n of a turn with
  `fold_in(fold_in(key, b), n)` (`generation.request_keys` indexed by episode, not by the row it holds in this
  turn's batch, so a turn's tokens do not depend on which other episodes are live): its tokens equal
  `generate`'s given those per-row keys (log-probs up to float rounding, tested), not `Reprefill`'s batch-key
  draw. The pad rows of a padded batch are copies of the first row's output (not decoded). `submit` / `step`
  queue single turns while others decode: `episodes` uses them for cross-turn refill (an episode's next turn
  queued as soon as its environment answered). `prefills`: the engine's admission batches; `slot_steps` /
  `live_steps`: slot-steps run / those that decoded an unfinished turn (the engine's counters).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import multiprocess
from jaxrl_llm.models.cache import kv_bits, take_rows
from jaxrl_llm.rollout.generation import SPEC_STATS, slot_layout
from jaxrl_llm.sampling import behavior, continuous, prompt_layout, speculative
from jaxrl_llm.sampling.continuation import decode_turn, extend
from jaxrl_llm.sampling.sampler import prefill_grouped
from jaxrl_llm.tasks.tokenizer import pad_left, pad_right

_prefill = jax.jit(prefill_grouped, static_argnames=("model_cfg", "slots", "group_size", "kv_dtype", "kv_window"))


def routes_by_position(routes_BSLk, positions_BS, segment_ids_BS, width: int) -> np.ndarray:
  """[B, width, L, k] host array: each row's expert ids indexed by RoPE position, i.e. by context index (contexts
  start at position 0), read from the slots it fed (segment > 0; later slots win); positions never fed hold
  experts 0..k-1, as `generate`'s unwritten slots do. Works for any slot layout: left-padded rows, a kept cache
  with gaps, the slot engine's."""
  routes_BSLk, pos_BS, seg_BS = np.asarray(routes_BSLk), np.asarray(positions_BS), np.asarray(segment_ids_BS)
  B, _, L, k = routes_BSLk.shape
  out = np.broadcast_to(np.arange(k, dtype=np.int32), (B, width, L, k)).copy()
  for b in range(B):
    s = np.flatnonzero((seg_BS[b] > 0) & (pos_BS[b] < width))
    out[b, pos_BS[b, s]] = routes_BSLk[b, s]
  return out


def _bucket(n: int) -> int:
  """Appended widths are rounded up to a power of two (few compiled `extend` shapes)."""
  return 1 << max(0, n - 1).bit_length()


class Reprefill:
  """Re-prefills every context each turn (module docstring)."""

  def __init__(self, gen, width: int, mesh=None):
    self.gen, self.width, self.mesh = gen, width, mesh
    self.prefills = 0  # one per turn
    self.spec: list[dict] = []  # speculative decoding's metrics of each turn (`sampler.spec_gamma`)
    self.kv_bits: float | None = None  # of the last turn's cache (`cache.kv_bits`)

  def turn(self, params, version: int, rows_b: Sequence[int], contexts: Sequence[Sequence[int]], key, cfg) -> dict:
    del version, rows_b
    self.prefills += 1
    ctx_bW, len_b = pad_left(contexts, self.width, self.gen.sampler_cfg.pad_id)
    got, _ = multiprocess.generate_on_mesh(self.gen.generate_fn(), params, ctx_bW, len_b, key, self.gen.model_cfg,
                                           cfg, self.mesh)
    if SPEC_STATS[0] in got:
      self.spec.append({k: float(got[k]) for k in SPEC_STATS})
    self.kv_bits = float(got["gen_kv_bits"])
    if got.get("routes_BTLk") is not None:  # MoE: the positions each row fed, at their routes
      got = {**got, "routes_BXLk": routes_by_position(got["routes_BTLk"], got["positions_BT"], got["segment_ids_BT"],
                                                      got["routes_BTLk"].shape[1])}
    return got

  def forget(self, row: int) -> None:
    """Episode `row`'s context changed other than by appending (an eviction): nothing is kept, nothing to do."""


class CachedTurns:
  """Keeps each episode's KV cache across turns (module docstring). Host state: the device cache, which cache
  row holds which episode, how many of each episode's ids it holds, and the version that computed it."""

  def __init__(self, gen, width: int, mesh=None):
    self.gen, self.width, self.mesh = gen, width, mesh
    self.slots = 2 * width  # a re-prefilled context fills `width`; the rest is room for turns and their gaps
    self.cache: dict | None = None
    self.dcache: dict | None = None  # the drafter's kept cache (speculative decoding), same rows and tokens
    self.spec: list[dict] = []  # speculative decoding's metrics of each turn
    self.last_logits_bV = None
    self.row_of: dict[int, int] = {}
    self.cached_len: dict[int, int] = {}
    self.version: int | None = None
    self.prefills = 0  # re-prefills so far (first turn included): tests and metrics

  @property
  def kv_bits(self) -> float | None:
    """Bits per cached key/value element of the kept cache (`cache.kv_bits`; None before the first turn)."""
    return None if self.cache is None else kv_bits(self.cache)

  def turn(self, params, version: int, rows_b: Sequence[int], contexts: Sequence[Sequence[int]], key, cfg) -> dict:
    cfg_decode = dataclasses.replace(cfg, group_size=1)  # the decode loop reads one cache per row
    gamma, N = speculative.gamma_of(cfg, len(rows_b)), cfg.max_new_tokens
    writes = speculative.turn_writes(cfg, gamma) if gamma else N  # plain decoding feeds each token once
    suffixes = [list(c[self.cached_len[b]:]) if b in self.cached_len else None for b, c in zip(rows_b, contexts)]
    E = _bucket(max((len(s) for s in suffixes if s is not None), default=1))
    reuse = (self.cache is not None and version == self.version and all(s is not None for s in suffixes)
             and (self.dcache is not None or not gamma) and int(self.cache["index"]) + E + writes <= self.slots)
    drafter = self.gen.draft_params() if gamma else None
    if reuse:
      take = [self.row_of[b] for b in rows_b]
      cache, dcache, last = self.cache, self.dcache, self.last_logits_bV
      if take != list(range(len(take))) or len(take) != last.shape[0]:
        idx = jnp.asarray(take, jnp.int32)
        cache, last = take_rows(cache, idx), jnp.take(last, idx, axis=0)
        dcache = speculative.drafter_rows(dcache, idx) if gamma else None
      tokens_bE, len_b = pad_right(suffixes, E, self.gen.sampler_cfg.pad_id)
      start_b = np.asarray([self.cached_len[b] for b in rows_b], np.int32)
      logits_bV, cache = extend(params, cache, tokens_bE, len_b, start_b, last, self.gen.model_cfg,
                                cfg.kv_window_arg)
      if gamma:
        dcache = speculative.extend_drafter(params, drafter, dcache, tokens_bE, len_b, start_b,
                                            model_cfg=self.gen.model_cfg, n_layers=cfg.spec_draft_layers)
    else:
      cache, dcache, logits_bV = self._prefill(params, contexts, cfg, gamma, drafter)
    start_b = np.asarray([len(c) for c in contexts], np.int32)
    if gamma:
      out, self.cache, self.dcache, self.last_logits_bV = speculative.decode_turn(
          params, drafter, cache, dcache, logits_bV, start_b, key, self.gen.model_cfg, cfg_decode, gamma)
      self.spec.append({k: float(out[k]) for k in SPEC_STATS})
    else:
      out, self.cache, self.last_logits_bV = decode_turn(params, cache, logits_bV, start_b, key, self.gen.model_cfg,
                                                         cfg_decode)
      self.dcache = None
    out = jax.tree.map(np.asarray, out)
    if "routes_LBSk" in self.cache:  # MoE: every token the kept cache holds was fed once, at its slot
      c = self.cache
      out["routes_BXLk"] = routes_by_position(np.moveaxis(np.asarray(c["routes_LBSk"]), 0, 2), c["positions_BS"],
                                              c["segment_ids_BS"], self.slots)
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

  def _prefill(self, params, contexts, cfg, gamma: int = 0, drafter=None) -> tuple[dict, dict | None, Any]:
    """(cache, the drafter's cache when `gamma` > 0 else None, logits after each context): every row re-prefilled."""
    ctx_bW, len_b = pad_left(contexts, self.width, self.gen.sampler_cfg.pad_id)
    if self.mesh is not None:  # rows along the sampler mesh's batch axes: the cache, and every turn, follow them
      from jaxrl_llm import sharding
      ctx_bW, len_b = jax.device_put((ctx_bW, len_b), sharding.batch_sharding(self.mesh, sharding.SAMPLER,
                                                                             len(contexts)))
    positions_bW, segment_ids_bW = prompt_layout(jnp.asarray(len_b), self.width)
    self.prefills += 1
    # the turn's cache format (full, int8, window), as `generate` keeps it
    cache, logits_bV = _prefill(params, jnp.asarray(ctx_bW), positions_bW, segment_ids_bW,
                                model_cfg=self.gen.model_cfg, slots=self.slots, group_size=cfg.group_size,
                                kv_dtype=cfg.kv_dtype, kv_window=cfg.kv_window_arg)
    dcache = None if not gamma else speculative.prefill_drafter(
        params, drafter, jnp.asarray(ctx_bW), positions_bW, segment_ids_bW, model_cfg=self.gen.model_cfg,
        n_layers=cfg.spec_draft_layers, slots=self.slots)
    return cache, dcache, logits_bV


class SlotTurns:
  """Samples turns with continuous batching (module docstring). Host state: one `SlotEngine`, rebuilt when the
  turn's sampler settings change. `turn` runs one turn to its end; `submit` / `step` / `idle` let a caller queue
  an episode's next turn while other turns decode (`episodes._play_refill`). `mesh`: the sampler's, where the
  parameters live (the engine splits its slots over its batch axes: `generation.slot_layout`); None: one device or
  a replica of its own."""

  _COUNTERS = ("slot_steps", "live_steps", "prefill_calls", "resumed")

  def __init__(self, gen, width: int, slots: int, chunk: int, mesh=None, resident: bool = False,
               keyed: bool = True):
    self.gen, self.width, self.slots, self.chunk, self.mesh = gen, width, slots, chunk, mesh
    self.resident, self.keyed = resident, keyed
    self.engine: continuous.SlotEngine | None = None
    self._counts0 = dict.fromkeys(self._COUNTERS, 0)  # the counters of engines replaced so far
    self._length: dict[Any, int] = {}  # a queued or decoding request's context length (MoE routes by position)

  def _count(self, name: str) -> int:
    return self._counts0[name] + (getattr(self.engine, name) if self.engine is not None else 0)

  # the engines' counters so far (`SlotEngine`'s)
  slot_steps = property(lambda self: self._count("slot_steps"), doc="Slot-steps decoded.")
  live_steps = property(lambda self: self._count("live_steps"), doc="Slot-steps that decoded an unfinished turn.")
  prefills = property(lambda self: self._count("prefill_calls"),
                      doc="Admission batches that prefilled whole contexts (`prefill_slots` calls).")
  resumed = property(lambda self: self._count("resumed"),
                     doc="Turns that continued keys/values resident in a slot (`resident`).")

  @property
  def kv_bits(self) -> float | None:
    """Bits per cached key/value element of the engine's slots (`cache.kv_bits`; None before the first turn)."""
    return None if self.engine is None else self.engine.kv_bits

  @property
  def spec(self) -> list[dict]:
    """Speculative decoding's metrics (`SPEC_STATS`) of the engine's draft-and-verify calls so far ([] without)."""
    got = self.engine.spec_stats() if self.engine is not None else {}
    return [{k: got[k] for k in SPEC_STATS}] if got else []

  @property
  def idle(self) -> bool:
    return self.engine is None or self.engine.idle

  def submit(self, tag: Any, context: Sequence[int], key, row: int, cfg) -> None:
    """Queues one turn: `context` (left-padded to the width) sampled with `cfg`, column n drawn with
    `fold_in(fold_in(key, row), n)`; `step` returns it under `tag`."""
    ctx_1W, len_1 = pad_left([context], self.width, cfg.pad_id)
    self._put(tag, ctx_1W[0], int(len_1[0]), jax.random.fold_in(key, row), cfg, keep=row)

  def step(self, params, version: int) -> list[tuple[Any, dict]]:
    """One engine step (admissions, a decode chunk); the turns that ended in it: (tag, {tokens_N, behavior_logp_N,
    length})."""
    records = behavior.TOPK_FIELDS + behavior.MC_FIELDS
    return [(tag, {"tokens_N": cols["tokens_N"], "behavior_logp_N": cols["behavior_logp_N"],
                   "length": int(cols["mask_N"].sum()), **{k: cols[k] for k in records if k in cols},
                   **self._routes(tag, cols)})
            for tag, cols in self.engine.step(params, version, self.gen.draft_params())]

  def _routes(self, tag: Any, cols: dict) -> dict:
    """MoE: {"routes_XLk": the request's routes by context position} (its slots: the left-padded context of
    `width`, then its columns), else {}."""
    n = self._length.pop(tag, None)
    if "routes_TLk" not in cols or n is None:
      return {}
    W, N = self.width, cols["mask_N"].shape[0]
    pos_T = np.concatenate([np.maximum(np.arange(W) - (W - n), 0), n + np.arange(N)])
    seg_T = np.concatenate([np.arange(W) >= W - n, cols["mask_N"] > 0])
    return {"routes_XLk": routes_by_position(cols["routes_TLk"][None], pos_T[None], seg_T[None], W + N)[0]}

  def turn(self, params, version: int, rows_b: Sequence[int], contexts: Sequence[Sequence[int]], key, cfg) -> dict:
    """One turn of the rows `rows_b` (episode ids): episode b draws with `fold_in(fold_in(key, b), n)`."""
    keys_b = continuous.host_key_rows(_episode_keys(key, jnp.asarray(rows_b, jnp.int32)))  # read once, not per row
    ctx_bW, len_b = pad_left(contexts, self.width, cfg.pad_id)
    first: dict[int, int] = {}  # episode -> its first row (a padded batch repeats its first episode)
    for i, b in enumerate(rows_b):
      if b not in first:
        first[b] = i
        self._put(b, ctx_bW[i], int(len_b[i]), keys_b[i], cfg, keep=b if self.keyed else None)
    routes: dict[int, np.ndarray] = {}
    N = cfg.max_new_tokens
    out = {"tokens_BN": np.full((len(rows_b), N), cfg.pad_id, np.int32),
           "behavior_logp_BN": np.zeros((len(rows_b), N), np.float32), "lengths_B": np.zeros((len(rows_b),), np.int32),
           **{k: np.array(v) for k, v in behavior.init_records(len(rows_b), N, cfg).items()}}
    while not self.idle:
      for b, o in self.step(params, version):
        i = first[b]
        out["tokens_BN"][i], out["behavior_logp_BN"][i] = o["tokens_N"], o["behavior_logp_N"]
        out["lengths_B"][i] = o["length"]
        for k in behavior.TOPK_FIELDS + behavior.MC_FIELDS:
          if k in o:
            out[k][i] = o[k]
        if "routes_XLk" in o:
          routes[i] = o["routes_XLk"]
    if routes:
      out["routes_BXLk"] = np.stack([routes[first[b]] for b in rows_b])
    for i, b in enumerate(rows_b):
      if first[b] != i:
        for k in out:
          out[k][i] = out[k][first[b]]
    return out

  def forget(self, row: int) -> None:
    """Episode `row`'s context changed other than by appending (an eviction): its resident slot, if any, is
    dropped (the engine would also see that the context no longer extends it)."""
    if self.engine is not None:
      self.engine.release(row)

  def _put(self, tag: Any, prompt_W: np.ndarray, length: int, row_key, cfg, keep: Any = None) -> None:
    """Queues one request (a left-padded context and its key; `keep`: its episode, whose keys/values a resident
    engine keeps in the slot for the next turn) on the engine of `cfg`."""
    self._engine(cfg).submit(tag, prompt_W, length, row_key, keep=keep)
    self._length[tag] = length

  def _engine(self, cfg) -> continuous.SlotEngine:
    cfg = dataclasses.replace(cfg, group_size=1)  # the engine prefills each distinct prompt once by itself
    if self.engine is None or self.engine.sampler_cfg != cfg:
      if self.engine is not None:
        if not self.engine.idle:
          raise ValueError("SlotTurns: a turn with other sampler settings while turns are in flight")
        self._counts0 = {name: self._count(name) for name in self._COUNTERS}
      self.engine = continuous.SlotEngine(self.gen.model_cfg, cfg, slots=self.slots, chunk=self.chunk,
                                          width=self.width, layout=slot_layout(self.mesh, self.slots),
                                          resident=self.resident)
    return self.engine


@jax.jit
def _episode_keys(key, rows_b):
  """Row i's key `fold_in(key, rows_b[i])`: an episode's draws depend on its id, not on which rows are live."""
  return jax.vmap(lambda r: jax.random.fold_in(key, r))(rows_b)
