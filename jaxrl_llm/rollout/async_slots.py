"""Continuous batching in the async source: one worker thread keeps a `continuous.SlotEngine` of S slots busy.

The per-group workers (`async_engine.GroupWorker`) each decode one group of G rows as a static batch, until its
longest row stops. With `rollout.slots=S` the engine runs one `SlotWorker` instead; each `step()`:
  1. takes the newest published snapshot as the decode snapshot (PipelineRL keep-cache: the slots keep the
     keys/values older versions wrote, an in-flight update stalls them for at most one chunk of
     `rollout.slot_chunk` decode steps, and every token records the version that sampled it in `versions_BN`);
  2. admits groups at that version while the engine has room (queued + held rows < S: the slots stay busy, and
     no group waits long in the queue, since a group admitted early is staler when consumed): per group
     `AsyncRollout.try_admit` (AReaL admission and the request id, retried ids first, as the per-group
     workers), then its G rows (prompt `prompt_for_request`, row g drawing with key g of
     `generation.request_keys(rollout_key(root, version, request id), G)`) into the engine's queue;
  3. runs one `SlotEngine.step`; a group whose G rows have all finished (in any slots and chunks) is recorded
     as `make_group_rollout` records it (`Generation.finish`, π_old at each token's version with `score_fn`,
     `group_record` with the admitted version as `start_version`) and delivered to the buffer.

Pins: a group holds its admitted snapshot (admission bounds the lag of that, its oldest version), plus every
decode snapshot it was in the engine for, until it is recorded (π_old needs them, `prox_at_versions`).
Tokens are sampled by the admitted version or newer ones, so every lag stays ≤ η.

Keys: a row's tokens depend on its key alone (`sampling.continuous`), so without a publish a group equals
`generate` given the same per-row keys (not the per-group key of `make_group_rollout`'s static batch).

Stop / errors: the thread stops after its current step; `close()` abandons the groups still in the engine
(admission counts them rejected, their ids stay in flight and are redone after a resume) and releases every pin.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout import collect
from jaxrl_llm.rollout.async_engine import (AsyncRollout, prompt_for_request, prox_at_versions, rollout_key,
                                             worker_params)
from jaxrl_llm.rollout.buffer import group_record
from jaxrl_llm.rollout.generation import Generation, request_keys
from jaxrl_llm.rollout.param_store import Snapshot
from jaxrl_llm.sampling import continuous


@dataclasses.dataclass
class _Group:
  """A group in the engine: its request, prompts, admitted snapshot, pinned snapshots and finished rows."""
  request_id: int
  example: dict
  prompts: collect.Prompts
  admitted: Snapshot
  pins: dict  # version -> Snapshot this group acquired (the admitted one included)
  rows: dict = dataclasses.field(default_factory=dict)  # row -> the columns `SlotEngine.step` returned for it
  pats: tuple | None = None  # Pats: (which rows saw a card, the card's stats) when the run has a scaffold


class SlotWorker:
  """The async engine's one worker under continuous batching (see the module docstring)."""

  def __init__(self, engine: AsyncRollout, gen: Generation, *, group_size: int, score_fn: Callable | None = None,
               scaffold=None):
    if gen.slots < 1:
      raise ValueError(f"SlotWorker needs Generation.slots >= 1, got {gen.slots}")
    self.engine, self.store, self.gen, self.G, self.score_fn = engine, engine.store, gen, group_size, score_fn
    self.scaffold = scaffold  # Pats: cards on the admitted groups' prompts, updated from the recorded groups
    width = gen.width if scaffold is None else scaffold.s.prompt_width
    self.slots = continuous.SlotEngine(gen.model_cfg, gen.sampler_cfg, slots=gen.slots, chunk=gen.slot_chunk,
                                       width=width)
    self.groups: dict[int, _Group] = {}  # request id -> group in the engine
    self.decode: Snapshot | None = None  # the snapshot the next chunk decodes with (pinned)
    self._counters = {"slot_steps": 0, "live_steps": 0}

  def step(self) -> bool:
    """Newest snapshot → admit → one decode chunk → deliver finished groups; False when nothing ran."""
    self._take_newest()
    admitted = self._admit()
    if self.slots.idle:
      return admitted
    v = self.decode.version
    for g in self.groups.values():  # every group in the engine may sample tokens at v in this step
      if v not in g.pins:
        g.pins[v] = self.store.acquire(v)
    for (rid, row), cols in self.slots.step(worker_params(self.decode), v, self.gen.draft_params()):
      g = self.groups[rid]
      g.rows[row] = cols
      if len(g.rows) == self.G:
        self._deliver(g)
    self._counters = {"slot_steps": self.slots.slot_steps, "live_steps": self.slots.live_steps}
    return True

  def counters(self) -> dict:
    """Slot-steps run (S per decode step) and those that decoded an unfinished row, cumulative."""
    return dict(self._counters)

  def close(self) -> None:
    """Abandons the groups in the engine (ids redone after a resume) and releases every pin."""
    try:
      for g in list(self.groups.values()):
        self.engine.abandon(g.admitted.version)
        self._release(g)
      self.groups.clear()
    finally:
      if self.decode is not None:
        self.store.release(self.decode)
        self.decode = None

  def _take_newest(self) -> None:
    newest = self.store.acquire()
    if self.decode is not None and newest.version <= self.decode.version:
      self.store.release(newest)
      return
    if self.decode is not None:
      self.store.release(self.decode)
    self.decode = newest

  def _admit(self) -> bool:
    """Admits groups at the decode version while queued + held rows < S and admission allows."""
    snap, admitted = self.decode, False
    while len(self.slots.queue) + self.slots.held < self.slots.slots:
      rid = self.engine.try_admit(snap.version)
      if rid is None:
        break
      try:
        example = prompt_for_request(self.gen.train_examples, rid, self.gen.seed)
        prompts = collect.encode_prompts([example] * self.G, self.gen.width, self.gen.encoder)
        pats = None
        if self.scaffold is not None:
          prompts, carded_G, shown = self.scaffold.apply(self.gen.encoder, prompts, self.G)
          pats = (carded_G, shown)
        keys = request_keys(rollout_key(self.gen.key_root, snap.version, rid), self.G)
      except BaseException:
        self.engine.abandon(snap.version)
        raise
      held = self.store.acquire(snap.version)
      self.groups[rid] = _Group(rid, example, prompts, held, {snap.version: held}, pats=pats)  # `close` abandons it
      for row, key in enumerate(continuous.host_key_rows(keys)):
        self.slots.submit((rid, row), prompts.tokens_BP[row], int(prompts.len_B[row]), key)
      admitted = True
    return admitted

  def _record(self, g: _Group) -> Rollout:
    """The finished group as `make_group_rollout` records it."""
    p = g.prompts
    out = continuous.assemble_requests([g.rows[r] for r in range(self.G)], p.tokens_BP, p.len_B,
                                       self.gen.sampler_cfg)
    out.update(self.slots.spec_stats())  # speculation: the engine's rates so far (its calls serve many groups)
    out["gen_kv_bits"] = self.slots.kv_bits
    group = self.gen.finish(out, p.examples, out["versions_BN"])
    if g.pats is not None:
      carded_G, stats = g.pats
      group = group.with_stats(**stats, **self.scaffold.update(p.examples, np.asarray(out["tokens_BN"]),
                                                               group.reward_B, carded_G, self.G,
                                                               self.gen.encoder.tokenizer))
    if self.score_fn is not None:
      group = group.replace(prox_logp_BN=prox_at_versions(self.score_fn, self.store, g.admitted, group))
    return group_record(group, request_id=g.request_id, example_id=int(g.example["example_id"]),
                        start_version=g.admitted.version)

  def _deliver(self, g: _Group) -> None:
    record = self._record(g)  # raises: the group stays in the engine's books, `close` abandons it
    del self.groups[g.request_id]
    try:
      self.engine.deliver(record, g.request_id, g.admitted.version)  # abandons it when the put fails
    finally:
      self._release(g)

  def _release(self, g: _Group) -> None:
    for snap in g.pins.values():
      self.store.release(snap)
    g.pins.clear()


def slot_worker(gen: Generation, *, group_size: int, score_fn: Callable | None = None,
                scaffold=None) -> Callable[[AsyncRollout], SlotWorker]:
  """`AsyncRollout(make_worker=...)` for continuous batching (`Generation.slots` slots; run one such worker)."""
  return lambda engine: SlotWorker(engine, gen, group_size=group_size, score_fn=score_fn, scaffold=scaffold)
