"""Asynchronous rollouts (DESIGN §3 `async(η)`): worker threads generate groups while the learner trains.

Each worker loop: acquire the newest ParamStore snapshot → ask admission → take the next request id →
generate one GRPO group (prompt and sampling key are functions of the request id and version) →
score → put into the FIFO buffer → release the snapshot. The learner calls `next_batch`, which
blocks until B groups are buffered, and re-raises any worker exception.

Request ids are handed out in increasing order; ids that were in flight when a run stopped are
handed out again first after a resume (`state()` / `from_state`), so none is lost or duplicated.
Which version generates which id depends on thread timing: this mode is concurrent, not bitwise
reproducible (use `fixed_lag` for that).

A thread runs a worker (`step()` until stopped, then `close()`): by default a `GroupWorker`, the loop
above; `make_worker` swaps in another (continuous batching: `rollout.async_slots.SlotWorker`, one thread
keeping many groups in flight), which admits, delivers and abandons groups through `try_admit`,
`deliver` and `abandon`, so admission and request ids stay this engine's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import warnings
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.keys import fold_in
from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout import cascade, collect, episodes, old_logp
from jaxrl_llm.rollout.admission import Admission
from jaxrl_llm.rollout.buffer import Buffer, group_record, lag
from jaxrl_llm.rollout.episodes import EnvSettings
from jaxrl_llm.rollout.generation import Generation
from jaxrl_llm.rollout.param_store import ParamStore, Snapshot
from jaxrl_llm.sampling import partial as partial_lib

RolloutFn = Callable[[Snapshot, int], Rollout]


class Worker(Protocol):
  """What a rollout thread runs: `step()` until the engine stops (False: admission refused and nothing ran,
  the thread then waits), then `close()` (abandon what is still in flight; also after an error).
  `counters()`: cumulative host counters the engine reports with each batch (e.g. slot usage)."""

  def step(self) -> bool: ...

  def close(self) -> None: ...

  def counters(self) -> dict: ...


class GroupWorker:
  """The default worker: one admitted group at a time through the engine's `rollout_fn`."""

  def __init__(self, engine: "AsyncRollout"):
    self.engine = engine

  def step(self) -> bool:
    return self.engine._one_rollout()

  def close(self) -> None:
    pass

  def counters(self) -> dict:
    return {}


def prompt_for_request(train_examples, request_id: int, seed: int) -> dict:
  """The example of a request: a pure function of (seed, request id), so resume redraws it exactly."""
  rng = np.random.default_rng([seed, 13, request_id])
  return train_examples[int(rng.integers(len(train_examples)))]


def rollout_key(root: jax.Array, version: int, request_id: int) -> jax.Array:
  """Sampling key of a request: derived from (root, generating version, request id), never shared."""
  return fold_in(fold_in(root, version), request_id)


def make_group_rollout(gen: Generation, *, group_size: int, store: ParamStore | None = None,
                       chunk_steps: int | None = None, reprefill: bool = False,
                       score_fn: Callable | None = None, score_at_switch: bool = False, scaffold=None) -> RolloutFn:
  """The standard `rollout_fn(snapshot, request_id) -> Rollout`: one prompt, G completions, as a buffer
  group (`buffer.group_record`), generated and scored by the run's `Generation` (`gen.finish`).

  With `chunk_steps` (partial rollouts) the group decodes in chunks and switches to the newest
  snapshot of `store` between chunks (keeping the KV cache unless `reprefill`); `versions_BN`
  records the version of every token. Otherwise the whole group uses the admitted snapshot.
  `gen.keep_routes` (MoE, routing replay R3): the group carries the sampler's expert ids `routes_BTLk`.
  `score_fn` (`learner.make_score_fn`, for `old_logp=recompute`): the worker also scores π_old of
  every token with the learner-dtype snapshot of its generating version (`prox_logp_BN`), so the
  learner does not spend a forward per distinct version of its batch. `score_at_switch` (partial rollouts, the
  missing-old-logits paper's interruption route): each version's tokens are scored when it stops sampling (at the
  switch, while its snapshot is still pinned), so π_old stays exact when the store no longer keeps that version
  by the time the group finishes (the snapshot route, `prox_at_versions`, then leaves the group to the learner).
  A snapshot generates from its `worker_params`, made when it was published (several processes: each
  process's own replica, `ParamStore(view=multiprocess.local_view)`); a worker builds no arrays from it.
  Workers run on their own process's devices: `gen.mesh` is not used here. `scaffold` (Pats,
  `rollout.scaffold.Scaffold`): the group's prompt gets its card, if any, and the scored group updates the cards
  (its stats travel with the group).
  """
  if chunk_steps is not None and store is None:
    raise ValueError("partial rollouts (chunk_steps) need the ParamStore to poll for new versions")

  def rollout(snap: Snapshot, request_id: int) -> Rollout:
    example = prompt_for_request(gen.train_examples, request_id, gen.seed)
    p = collect.encode_prompts([example] * group_size, gen.width, gen.encoder)
    pats = {}
    if scaffold is not None:
      p, carded_G, pats = scaffold.apply(gen.encoder, p, group_size)
    key = rollout_key(gen.key_root, snap.version, request_id)
    args = (jnp.asarray(p.tokens_BP), jnp.asarray(p.len_B), key)
    at_switch = None
    if chunk_steps is None:
      # a distilled speculative drafter drafts with its newest parameters (unpinned: they change speed, never μ)
      out = gen.generate_fn()(worker_params(snap), *args, gen.model_cfg, gen.sampler_cfg)
      versions_GN = np.full(out["mask_BN"].shape, snap.version, np.int32)
    else:
      poller, at_switch = store_poller(store), None
      if score_fn is not None and score_at_switch:
        at_switch = _SwitchScores(score_fn, lambda v: snap if v == snap.version else poller.held(v))
      out = partial_lib.generate_partial(snap.version, worker_params(snap), poller, *args, gen.model_cfg,
                                         gen.sampler_cfg, chunk_steps=chunk_steps, reprefill=reprefill,
                                         draft_params=gen.draft_params(), on_version_end=at_switch)
      versions_GN = np.asarray(out["versions_BN"])
    group = gen.finish(jax.tree.map(np.asarray, out), p.examples, versions_GN)  # scored here: no other process
    if scaffold is not None:
      pats.update(scaffold.update(p.examples, np.asarray(out["tokens_BN"]), group.reward_B, carded_G, group_size,
                                  gen.encoder.tokenizer))
      group = group.with_stats(**pats)
    if at_switch is not None:
      group = group.replace(prox_logp_BN=at_switch.prox_BN)
    elif score_fn is not None:
      group = group.replace(prox_logp_BN=prox_at_versions(score_fn, store, snap, group))
    return group_record(group, request_id=request_id, example_id=int(example["example_id"]),
                        start_version=snap.version)

  return rollout


def make_echo_rollout(gen: Generation, echo, *, group_size: int, store: ParamStore | None = None,
                      score_fn: Callable | None = None) -> RolloutFn:
  """`rollout_fn(snapshot, request_id) -> Rollout` for ECHO (`rollout.cascade`): the request's task as one record
  of 2G rows, its G diagnoses then its G refinements, all three sampler calls with the admitted snapshot (key
  `rollout_key(root, version, request_id)`); its echo metrics travel in its stats (`cascade.merge_stats`).
  `score_fn`: π_old of every row at the snapshot's version, as in `make_group_rollout`."""
  def rollout(snap: Snapshot, request_id: int) -> Rollout:
    example = prompt_for_request(gen.train_examples, request_id, gen.seed)
    params = worker_params(snap)

    def sample(p, key, g):  # on this worker's devices, from the pinned snapshot (no mesh, no other process)
      cfg = dataclasses.replace(gen.sampler_cfg, group_size=g)
      out = gen.generate_fn()(params, jnp.asarray(p.tokens_BP), jnp.asarray(p.len_B), key, gen.model_cfg, cfg)
      return jax.tree.map(np.asarray, out), None

    key = rollout_key(gen.key_root, snap.version, request_id)
    record, r0 = cascade.cascade(gen, params, [example], group_size, key, snap.version, echo, sample)
    record = record.with_stats(**cascade.task_stats(record, r0, group_size))
    if score_fn is not None:
      record = record.replace(prox_logp_BN=prox_at_versions(score_fn, store, snap, record))
    return group_record(record, request_id=request_id, example_id=int(example["example_id"]),
                        start_version=snap.version)

  return rollout


def episode_seed(seed: int, request_id: int) -> int:
  """The environment seed of an async episode group: a pure function of (run seed, request id), so a request
  redone after a resume starts its G episodes from the same state."""
  return int(np.random.default_rng([seed, 0x45505, 1, request_id]).integers(0, 2**31 - 1))


def make_episode_rollout(gen: Generation, env: EnvSettings, *, group_size: int, store: ParamStore | None = None,
                         score_fn: Callable | None = None, score_at_switch: bool = False) -> RolloutFn:
  """`rollout_fn(snapshot, request_id) -> Rollout` for multi-turn episodes (`rollout.episodes.run_episodes`):
  one group of G episodes from the environment seed of the request (`episode_seed`).

  The first turn generates from the admitted snapshot; with `env.newest_each_turn` every later turn generates from
  the newest published snapshot (`store_poller`: what an agent served by an updating engine sees), so an
  episode may span several versions, each token's recorded in `versions_BN`. Admission bounds the lag of the
  admitted (oldest) version, hence of every policy token. `score_fn`: π_old of every token at its generating
  version, as in `make_group_rollout`.
  """
  if env.newest_each_turn and store is None:
    raise ValueError("env.newest_each_turn needs the ParamStore to poll for new versions")

  def rollout(snap: Snapshot, request_id: int) -> Rollout:
    seed = episode_seed(gen.seed, request_id)
    key = rollout_key(gen.key_root, snap.version, request_id)
    group = episodes.run_episodes(gen, worker_params(snap), [seed], group_size, env, key, snap.version,
                                  width=env.prompt_width, poll=store_poller(store) if env.newest_each_turn else None,
                                  on_mesh=False)
    if score_fn is not None:
      group = group.replace(prox_logp_BN=prox_at_versions(score_fn, store, snap, group))
    return group_record(group, request_id=request_id, example_id=seed, start_version=snap.version)

  return rollout


class _SwitchScores:
  """`generate_partial(on_version_end=)` for the interruption route: the tokens a version sampled, scored by its
  learner-dtype copy while it is held (`snapshot(version)`), gathered into `prox_BN`."""

  def __init__(self, score_fn: Callable, snapshot: Callable[[int], Snapshot | None]):
    self.score_fn, self.snapshot = score_fn, snapshot
    self.prox_BN: np.ndarray | None = None

  def __call__(self, version: int, out: dict) -> None:
    snap = self.snapshot(version)
    if snap is None:  # the poller releases a superseded snapshot only at the call after the switch
      raise RuntimeError(f"partial rollout: version {version} stopped sampling but its snapshot is not held")
    mask = np.asarray(out["mask_BN"])
    routes = out.get("routes_BTLk")
    logp = np.asarray(self.score_fn(old_logp.learner_copy(snap), out["sequence_BT"], out["positions_BT"],
                                    out["segment_ids_BT"], jnp.asarray(mask), routes))
    mine = (np.asarray(out["versions_BN"]) == version) & (mask > 0)
    self.prox_BN = np.where(mine, logp, 0.0 if self.prox_BN is None else self.prox_BN).astype(np.float32)


def prox_at_versions(score_fn: Callable, store: ParamStore | None, held: Snapshot, group: Rollout) -> np.ndarray | None:
  """π_old of a finished group: each token scored by the learner-dtype copy of the version that generated it
  (`old_logp.score_at_versions`, the learner's `recompute` on a worker).

  `held` (the admitted snapshot) is pinned by the caller; other versions (partial rollouts) are pinned
  here. None when one of them is no longer held (the learner then recomputes, or drops the group as stale).
  """
  @contextlib.contextmanager
  def pinned(v: int):
    if v == held.version:
      yield held
      return
    if store is None:
      raise KeyError(v)
    with old_logp.store_pin(store)(v) as snap:
      yield snap

  seq = old_logp.rollout_seq(group)
  routes = None if group.routes_BTLk is None else jnp.asarray(group.routes_BTLk)
  try:
    return np.asarray(old_logp.score_at_versions(score_fn, group.versions_BN, group.mask_BN, seq, routes, pinned))
  except KeyError:  # freed: leave π_old to the learner
    return None


def worker_params(snap: Snapshot):
  """The parameters a worker thread generates from: the snapshot's `worker_params`, made on the publishing
  thread before the snapshot became visible (`params` for a snapshot built without them)."""
  return snap.params if snap.worker_params is None else snap.worker_params


class StorePoller:
  """A `generate_partial` poll over a ParamStore: pins the newest snapshot when it is newer (its `worker_params`,
  as in `make_group_rollout`).

  A snapshot pinned at a switch is released at the next call (the next switch's, or the end's): one call later
  than the switch that superseded it, so `generate_partial(on_version_end=)` can still score with it (`held`).
  The admitted snapshot stays the worker's to release.
  """

  def __init__(self, store: ParamStore):
    self.store = store
    self.pinned: list[Snapshot] = []  # the last is the current version's; earlier ones are released next call

  def __call__(self, current_version: int | None):
    while len(self.pinned) > (0 if current_version is None else 1):  # superseded at an earlier switch
      self.store.release(self.pinned.pop(0))
    if current_version is None or self.store.latest_version <= current_version:  # the end, or nothing newer
      return None
    snap = self.store.acquire()
    self.pinned.append(snap)
    return snap.version, worker_params(snap)

  def held(self, version: int) -> Snapshot | None:
    return next((s for s in self.pinned if s.version == version), None)


def store_poller(store: ParamStore) -> StorePoller:
  return StorePoller(store)


class AsyncRollout:
  """Rollout worker threads + admission + buffer; the learner only calls `next_batch`.

  Args:
    store: the ParamStore the learner publishes into (version 0 must be published before `start`).
    rollout_fn: `(snapshot, request_id) -> Rollout`, e.g. `make_group_rollout(...)` (None with `make_worker`).
    batch_groups: B, groups per learner step.
    eta: staleness bound η (None = unbounded).
    num_workers: rollout threads.
    admission, buffer: restored state (default: fresh).
    next_request_id, retry_request_ids: restored request-id cursor and ids to redo first.
    id_stride: the step between this engine's request ids (the number of processes running engines).
    poll_s: how often a worker refused by admission re-checks (it is also woken by the learner).
    make_worker: `engine -> Worker` run by each of the `num_workers` threads (default: `GroupWorker`).
  """

  def __init__(self, store: ParamStore, rollout_fn: RolloutFn | None, *, batch_groups: int, eta: int | None,
               num_workers: int = 1, admission: Admission | None = None, buffer: Buffer | None = None,
               max_running: int | None = None, next_request_id: int = 0, retry_request_ids=(),
               poll_s: float = 0.02, id_stride: int = 1, make_worker: Callable[["AsyncRollout"], Worker] | None = None):
    self.store = store
    self.rollout_fn = rollout_fn
    self.batch_groups = batch_groups
    self.eta = eta
    self.admission = admission or Admission(batch_groups, eta, max_running)
    self.buffer = buffer or Buffer()
    self.num_workers = num_workers
    self.poll_s = poll_s
    self._next_id = next_request_id
    self.id_stride = id_stride  # several processes: process p takes ids p, p + n, p + 2n, ... (disjoint)
    self._retry = collections.deque(sorted(retry_request_ids))
    self._in_flight: set[int] = set()
    self._errors: list[BaseException] = []
    self._stop = threading.Event()
    self._wake = threading.Condition()
    self._lock = threading.Lock()
    self._threads: list[threading.Thread] = []
    self.make_worker = make_worker or GroupWorker
    self._workers: list[Worker] = []
    self._counted: dict = {}  # the workers' counters at the previous batch
    self.generated = 0  # groups put into the buffer by this engine
    self.flushed = 0  # groups thrown away by `flush`

  # ---- worker side ----

  def _take_request_id(self) -> int:
    with self._lock:
      if self._retry:
        rid = self._retry.popleft()
      else:
        rid, self._next_id = self._next_id, self._next_id + self.id_stride
      self._in_flight.add(rid)
      return rid

  def try_admit(self, version: int) -> int | None:
    """Admits one group generated from `version` and hands out its request id; None when admission refuses.
    The group then counts as running until `deliver` or `abandon`."""
    if not self.admission.try_start(version):
      return None
    return self._take_request_id()

  def deliver(self, group: Rollout, request_id: int, version: int) -> None:
    """Puts an admitted group (started at `version`) into the buffer; a failed put abandons it."""
    try:
      self.buffer.put(group)  # put before finish: the group is counted as running until it is in the FIFO
    except BaseException:
      self.abandon(version)
      raise
    self.admission.finish(version, accepted=True)
    with self._lock:
      self._in_flight.discard(request_id)
      self.generated += 1

  def abandon(self, version: int) -> None:
    """Ends an admitted group that produced nothing; its request id stays in flight (redone after a resume)."""
    self.admission.finish(version, accepted=False)

  def _one_rollout(self) -> bool:
    """Runs one admitted rollout; False when admission refused (nothing started)."""
    snap = self.store.acquire()
    try:
      rid = self.try_admit(snap.version)
      if rid is None:
        return False
      try:
        group = self.rollout_fn(snap, rid)
      except BaseException:
        self.abandon(snap.version)
        raise
      self.deliver(group, rid, snap.version)
      return True
    finally:
      self.store.release(snap)

  def new_worker(self) -> Worker:
    """A worker of this engine (`make_worker`); its counters join the batch stats. `start` runs one per thread; a
    test may step one by hand instead (deterministic: no threads)."""
    w = self.make_worker(self)
    self._workers.append(w)
    return w

  def _work(self, worker: Worker) -> None:
    try:
      try:
        while not self._stop.is_set():
          if not worker.step():
            with self._wake:
              self._wake.wait(self.poll_s)
      finally:
        worker.close()
    except BaseException as e:  # surfaced to the learner by next_batch / stop
      with self._lock:
        self._errors.append(e)
      self._stop.set()

  # ---- learner side ----

  def start(self) -> "AsyncRollout":
    if self._threads:
      raise RuntimeError("AsyncRollout already started")
    if self.store.latest_version < 0:
      raise RuntimeError("publish version 0 to the ParamStore before starting rollouts")
    workers = [self.new_worker() for _ in range(self.num_workers)]
    self._threads = [threading.Thread(target=self._work, args=(w,), name=f"rollout-{i}", daemon=True)
                     for i, w in enumerate(workers)]
    for t in self._threads:
      t.start()
    return self

  def _raise_if_failed(self) -> None:
    with self._lock:
      if self._errors:
        err = self._errors[0]
        self._errors.clear()
        raise RuntimeError(f"rollout worker failed: {err!r}") from err

  def _notify_workers(self) -> None:
    with self._wake:
      self._wake.notify_all()

  def next_batch(self, learner_version: int, timeout: float | None = None) -> tuple[list[Rollout], dict]:
    """Blocks until `batch_groups` groups with lag ≤ η are buffered; returns them (FIFO) and stats.

    `learner_version` is the version of the parameters this batch will train (the newest published).
    Raises the first worker exception (as the cause of a RuntimeError), or TimeoutError.
    Stats: `time_learner_idle_s` (time spent waiting here), `lag_mean`, `lag_max`, counters, and the
    workers' own counters (`Worker.counters`, summed) since the previous batch.
    """
    t0 = time.perf_counter()
    self.admission.set_version(learner_version)
    self._notify_workers()
    dropped = 0
    while True:
      self._raise_if_failed()
      groups, n = self.buffer.get_batch(self.batch_groups, learner_version, self.eta)
      dropped += n
      if groups is not None:
        break
      if self._stop.is_set() and not self._errors:
        raise RuntimeError("next_batch on a stopped AsyncRollout")
      if timeout is not None and time.perf_counter() - t0 > timeout:
        raise TimeoutError(f"no batch of {self.batch_groups} groups within {timeout} s")
      self.buffer.wait(self.batch_groups, self.poll_s)
    idle = time.perf_counter() - t0
    self.admission.consume(len(groups) + dropped, learner_version)
    self._notify_workers()
    lags = [lag(g, learner_version) for g in groups]
    return groups, {
        **self._worker_counts(),
        "time_learner_idle_s": idle, "lag_mean": float(np.mean(lags)), "lag_max": int(max(lags)),
        "dropped_stale": self.buffer.dropped, "flushed": self.flushed, "buffered": len(self.buffer),
        "running": self.admission.running,
        "accepted": self.admission.accepted, "rejected": self.admission.rejected,
    }

  def flush(self) -> int:
    """Throws away every buffered group (a loss asked for fresher rollouts: f-OPD's adaptive refresh); the workers
    then fill the buffer again from the newest parameters. Returns the number of groups thrown away; groups still
    being generated are kept (they start from a version at least as new as any buffered one)."""
    n = self.buffer.flush()
    self.admission.discard(n)
    self.flushed += n
    self._notify_workers()
    return n

  def _worker_counts(self) -> dict:
    """The workers' counters summed, as increments since the previous call."""
    total: dict = {}
    for w in self._workers:
      for k, v in w.counters().items():
        total[k] = total.get(k, 0) + v
    out = {k: v - self._counted.get(k, 0) for k, v in total.items()}
    self._counted = total
    return out

  def stop(self, timeout: float = 60.0, abandon: bool = False) -> None:
    """Stops the workers after their current step (a group; a decode chunk for a `SlotWorker`, which then
    abandons the groups it holds) and joins them (at most `timeout` s in all).

    Raises a worker exception that `next_batch` has not surfaced yet, or RuntimeError when a worker
    does not finish in time; with `abandon`, workers still running then are left behind with a warning (daemon
    threads: they cannot hold the process; the groups they make are never consumed).
    """
    self._stop.set()
    self._notify_workers()
    deadline = time.monotonic() + timeout
    for t in self._threads:
      t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in self._threads if t.is_alive()]
    self._raise_if_failed()
    if alive and abandon:
      warnings.warn(f"rollout workers still running after {timeout} s were left behind: {alive}", RuntimeWarning,
                    stacklevel=2)
    elif alive:
      raise RuntimeError(f"rollout workers did not stop within {timeout} s: {alive}")

  def __enter__(self) -> "AsyncRollout":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def state(self) -> dict:
    """Resume state (take it when stopped): counters, buffered groups, request-id cursor, ids to redo."""
    with self._lock:
      ids = {"next_request_id": self._next_id, "retry_request_ids": sorted([*self._retry, *self._in_flight])}
    return {"admission": self.admission.state(), "buffer": self.buffer.snapshot(), **ids}

  @classmethod
  def from_state(cls, state: dict, store: ParamStore, rollout_fn: RolloutFn | None, *, batch_groups: int,
                 eta: int | None, **kw: Any) -> "AsyncRollout":
    """An engine that continues from `state()`: same buffer, counters and request ids."""
    adm = Admission.from_state(state["admission"], batch_groups, eta, kw.pop("max_running", None))
    return cls(store, rollout_fn, batch_groups=batch_groups, eta=eta, admission=adm,
               buffer=Buffer.restore(state["buffer"]), next_request_id=int(state["next_request_id"]),
               retry_request_ids=state["retry_request_ids"], **kw)
