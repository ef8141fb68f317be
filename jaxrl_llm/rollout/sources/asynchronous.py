"""`async(η)`: rollout worker threads generate groups continuously from the newest published snapshot;
AReaL-style admission (`rollout/admission.py`) keeps every consumed lag ≤ η = `rollout.lag`. Optional
partial rollouts (`rollout.partial_chunk`) switch to newer parameters mid-sequence and record each
token's version. Not bitwise repeatable (which version generates which request depends on timing).

State: the engine's buffered groups, admission counters and request-id cursor (ids in flight are
redone after a resume). `state()` stops the workers (a consistent cut); the next batch restarts them.

Continuous batching (`rollout.slots=S`, `rollout/async_slots.py`): the worker threads are replaced by one slot
worker driving a `sampling.continuous.SlotEngine` of S slots. It admits groups (same admission, same request
ids) while queued + held rows < S, so the slots stay busy without admitting far ahead; rows of one group may
finish in different slots and chunks, and the group is recorded once all G have. Every `rollout.slot_chunk`
decode steps it switches to the newest published snapshot, keeping the cache (PipelineRL; an update stalls
the slots for at most one chunk) and recording each token's version, so `rollout.partial_chunk` is refused
with it; every version a group's tokens carry stays pinned until its π_old is scored. Row g of request r
draws with key g of `request_keys(rollout_key(root, version, r), G)`, not the static worker's per-group key,
so turning slots on changes a seed's samples. Stopping abandons the groups in the slots (redone after a
resume). Metrics `async_slot_steps` / `async_slot_live_steps`: slot-steps run since the previous batch and
those that decoded an unfinished row (1 - live / slot is the share spent on free or finished slots).

Metrics: `async_lag_hist` (this batch's groups by lag 0..η) and `time_learner_idle_frac`, the learner's
time waiting for batches over its wall time, from the second batch's return on (the first wait and the
first learner step hold the compiles; a resumed run starts counting again; 0 until the third batch).

On a mesh the sampler may have devices of its own (`rollout.sampler_devices`: e.g. 2 of 8 for the
workers, 6 for the learner); each publish then reshards the snapshot from the learner's device set to
the sampler's, and admission bounds every lag by η exactly as on one device. On forced CPU devices
both sets share the host's cores, so the idle fraction there measures contention, not overlap; on
GPUs / TPUs the two sets run concurrently and publish is a device-to-device copy over NVLink / ICI.

Over several processes every process runs its own workers on its own devices (`rollout.sampler_devices`
of each process, or its last device when 0) and generates, scores and buffers its share of each batch
(`prompts_per_step / processes` groups; process p takes request ids p, p + n, ...). Snapshots are
replicated onto every process's sampler devices at publish (the main thread, in step with the other
processes); a worker generates from its process's replica alone (`multiprocess.local_view`, taken by the
ParamStore on the main thread when the snapshot is published or restored), so it never runs a program that
spans processes, nor builds arrays from a global snapshot while the learner publishes. The learner's batch
is the processes' batches joined in process order (`merge_processes`); each process's admission bounds the
lags of its share by η, hence every lag of the batch. The checkpointed state is every process's engine
state; it resumes on the same number of processes.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxrl_llm import multiprocess
from jaxrl_llm.record import Rollout, from_plain, to_plain
from jaxrl_llm.rollout import async_engine as ae
from jaxrl_llm.rollout import async_slots, cascade, episodes, scaffold
from jaxrl_llm.rollout.buffer import collate, lag
from jaxrl_llm.rollout.generation import RATE_STATS
from jaxrl_llm.rollout.settings import RolloutSettings
from jaxrl_llm.rollout.sources.base import register


# Continuous batching (`rollout.slots`): the slot worker's counters since the previous batch, as metrics.
SLOT_COUNTERS = {"slot_steps": "async_slot_steps", "live_steps": "async_slot_live_steps"}


def async_engine(ctx, store, state_dict: dict | None) -> ae.AsyncRollout:
  """The run's (not yet started) engine, fresh or continuing from `state_dict`."""
  s = ctx.settings
  score_fn = ctx.score if s.old_logp == "recompute" and s.prox_in_worker else None
  n_proc = jax.process_count()  # config validation: divides prompts_per_step
  kw = dict(batch_groups=s.prompts_per_step // n_proc, eta=s.lag, num_workers=s.num_workers, id_stride=n_proc)
  if s.echo is not None:  # ECHO: a request is one task, a record of 2G rows (its critic and policy groups)
    kw["batch_groups"] //= 2
    fn = ae.make_echo_rollout(ctx.gen, s.echo, group_size=s.group_size, store=store, score_fn=score_fn)
  elif ctx.gen.slots:  # continuous batching: one worker holds many groups (config: single completions, one worker)
    fn = None
    kw.update(num_workers=1, make_worker=async_slots.slot_worker(ctx.gen, group_size=s.group_size, score_fn=score_fn,
                                                                 scaffold=ctx.scaffold))
  elif s.env is not None:
    fn = ae.make_episode_rollout(ctx.gen, s.env, group_size=s.group_size, store=store, score_fn=score_fn)
  else:
    fn = ae.make_group_rollout(ctx.gen, group_size=s.group_size, store=store, chunk_steps=s.partial_chunk or None,
                               score_fn=score_fn, score_at_switch=s.score_at_switch, scaffold=ctx.scaffold)
  if state_dict is not None:
    return ae.AsyncRollout.from_state(state_dict, store, fn, **kw)
  return ae.AsyncRollout(store, fn, next_request_id=jax.process_index(), **kw)


def spec_means(groups: list[Rollout]) -> dict:
  """Speculative decoding's metrics and per-call settings of a batch (`RATE_STATS`): the mean over the groups that
  carry them (each group is one sampler call); {} without speculation or a per-call setting."""
  out = {}
  for k in RATE_STATS:
    vals = [float(g.stat(k)) for g in groups if g.stat(k, None) is not None]
    if vals:
      out[k] = float(np.mean(vals))
  return out


def merge_processes(parts: list[Rollout]) -> Rollout:
  """One batch from the processes' own batches (`Async.next_batch`, `Harness.next_batch`): rows in process order,
  groups renumbered, counts and lag histograms added, `time_*` and `*_max` the largest, rates and `*_mean` the
  processes' mean, request ids and other lists joined."""
  offsets = np.cumsum([0] + [int(p.group_B.max()) + 1 if p.group_B.size else 0 for p in parts[:-1]])
  arrays = {k: np.concatenate([np.asarray(p.arrays()[k]) for p in parts]) for k in parts[0].arrays()}
  arrays["group_B"] = np.concatenate([p.group_B + o for p, o in zip(parts, offsets)]).astype(parts[0].group_B.dtype)
  stats = episodes.merge_stats([p.stats for p in parts])  # episode counters (none without an environment)
  for k, first in parts[0].stats.items():
    vals = [p.stats[k] for p in parts]
    if k in stats:
      continue
    if k == "async_lag_hist":
      stats[k] = np.sum(vals, axis=0).astype(int).tolist()
    elif k == "request_ids":
      stats[k] = sorted(i for v in vals for i in v)
    elif isinstance(first, list):  # per-item records (the harness's episode timelines): joined in process order
      stats[k] = [x for v in vals for x in v]
    elif k.startswith("time_") or k.endswith("_max"):
      stats[k] = max(vals)
    elif k in RATE_STATS or k.endswith("_mean"):  # rates: the processes' mean
      stats[k] = float(np.mean(vals))
    else:  # reward_errors, async_dropped_stale / _buffered / _running: counts
      stats[k] = sum(vals)
  return Rollout(**arrays, stats=stats)


@register("async")
class Async:

  on_policy = False
  per_process_workers = True  # several processes: each generates from its own replica (`multiprocess.local_view`)

  @staticmethod
  def retention(s: RolloutSettings) -> int:
    return s.lag + 1

  def __init__(self, ctx, store):
    self.ctx, self.store = ctx, store
    self.engine: ae.AsyncRollout | None = None  # built by restore or the first batch; started by a batch
    self.running = False
    self.eta = ctx.settings.lag
    self._returned = None  # perf_counter when the previous batch was handed to the learner
    self._batches = 0  # batches handed out by this source
    self._idle_s = self._busy_s = 0.0  # learner waiting / working, from the second batch's return on

  def next_batch(self, step: int, version: int) -> Rollout:
    del step  # which request a batch holds depends on the workers, not the step
    if self.engine is None:
      self.engine = async_engine(self.ctx, self.store, None)
    if not self.running:
      self.engine.start()
      self.running = True
    asked = time.perf_counter()
    groups, st = self.engine.next_batch(version, timeout=600)
    if self._batches >= 2:  # the first wait and the first learner step hold the compiles
      self._busy_s += asked - self._returned
      self._idle_s += st["time_learner_idle_s"]
    self._returned, self._batches = time.perf_counter(), self._batches + 1
    ro = collate(groups, version).with_stats(
        **episodes.merge_stats([{k: v for k, v in g.stats.items() if k.startswith(("env_", "episode_status"))}
                                for g in groups]),
        time_learner_idle_s=st["time_learner_idle_s"], async_dropped_stale=st["dropped_stale"],
        async_flushed=st["flushed"], async_buffered=st["buffered"], async_running=st["running"],
        async_lag_hist=np.bincount([lag(g, version) for g in groups], minlength=self.eta + 1).tolist(),
        time_learner_idle_frac=self._idle_s / max(self._idle_s + self._busy_s, 1e-9),
        **{name: st[k] for k, name in SLOT_COUNTERS.items() if k in st}, **spec_means(groups),
        **(scaffold.merge_stats([g.stats for g in groups]) if self.ctx.scaffold is not None else {}),
        **(cascade.merge_stats([g.stats for g in groups]) if self.ctx.settings.echo is not None else {}),
        request_ids=sorted({int(g.stat("request_id")) for g in groups}))
    if not multiprocess.multi():
      return ro
    return merge_processes([from_plain(p) for p in multiprocess.allgather_host(to_plain(ro))])
  def flush(self) -> int:
    """Throws away this process's buffered groups (`AsyncRollout.flush`: a loss asked for fresher rollouts)."""
    return self.engine.flush() if self.engine is not None else 0

  def state(self) -> dict | None:
    """Stops the workers after their current rollout; the next batch continues from this state."""
    if self.engine is None:
      return None
    self.close()
    st = self.engine.state()
    self.engine = async_engine(self.ctx, self.store, st)
    return {"processes": multiprocess.allgather_host(st)} if multiprocess.multi() else st

  def restore(self, state: dict | None) -> None:
    self.close()
    n_proc = jax.process_count()
    saved = len(state["processes"]) if isinstance(state, dict) and "processes" in state else 1
    if saved != n_proc:
      raise ValueError(f"the async state was saved by {saved} process(es) and this run has {n_proc}: an async run "
                       "resumes on the number of processes that wrote its checkpoint")
    self.engine = async_engine(self.ctx, self.store, state["processes"][jax.process_index()] if n_proc > 1 else state)

  def close(self) -> None:
    if self.running:
      self.running = False
      self.engine.stop()
