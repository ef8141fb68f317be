"""`async(η)`: rollout worker threads generate groups continuously from the newest published snapshot;
AReaL-style admission (`rollout/admission.py`) keeps every consumed lag ≤ η = `rollout.lag`. Optional
partial rollouts (`rollout.partial_chunk`) switch to newer parameters mid-sequence and record each
token's version. Not bitwise repeatable (which version generates which request depends on timing).

State: the engine's buffered groups, admission counters and request-id cursor (ids in flight are
redone after a resume). `state()` stops the workers (a consistent cut); the next batch restarts them.

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
from jaxrl_llm.rollout import async_engine as ae
from jaxrl_llm.rollout.buffer import collate, lag
from jaxrl_llm.rollout.sources.base import register
from jaxrl_llm.rollout.sources.common import reward_policy


def async_engine(run, store, state_dict: dict | None) -> ae.AsyncRollout:
  """The run's (not yet started) engine, fresh or continuing from `state_dict`."""
  c = run.c
  fn = ae.make_group_rollout(run.task, run.train_examples, width=run.P, group_size=c.rollout.group_size, seed=c.seed,
                             key_root=run.k_sample, model_cfg=run.sampler_model_cfg, sampler_cfg=run.samp_cfg,
                             store=store, chunk_steps=c.rollout.partial_chunk or None,
                             keep_routes=c.model.routing_replay,  # R3: collate then hands routes_BTLk to make_batch
                             score_fn=run.score if c.rollout.old_logp == "recompute" and c.rollout.prox_in_worker else None,
                             encoder=run.encoder, reward_policy=reward_policy(c))
  n_proc = jax.process_count()  # config validation: divides prompts_per_step
  kw = dict(batch_groups=c.rollout.prompts_per_step // n_proc, eta=c.rollout.lag, num_workers=c.rollout.num_workers,
            id_stride=n_proc)
  if state_dict is not None:
    return ae.AsyncRollout.from_state(state_dict, store, fn, **kw)
  return ae.AsyncRollout(store, fn, next_request_id=jax.process_index(), **kw)


def merge_processes(parts: list[dict]) -> dict:
  """One batch from the processes' own batches (`Async.next_batch` fields): rows in process order, groups
  renumbered, counts and lag histograms added, `time_*` of the slowest process, request ids joined."""
  out = {}
  for k, first in parts[0].items():
    vals = [p[k] for p in parts]
    if k == "group_id_B":
      offsets = np.cumsum([0] + [int(v.max()) + 1 if v.size else 0 for v in vals[:-1]])
      out[k] = np.concatenate([v + o for v, o in zip(vals, offsets)]).astype(first.dtype)
    elif isinstance(first, np.ndarray):
      out[k] = np.concatenate(vals)
    elif k == "async_lag_hist":
      out[k] = np.sum(vals, axis=0).astype(int).tolist()
    elif k == "request_ids":
      out[k] = sorted(i for v in vals for i in v)
    elif k.startswith("time_"):
      out[k] = max(vals)
    else:  # reward_errors, async_dropped_stale / _buffered / _running: counts
      out[k] = sum(vals)
  return out


@register("async")
class Async:

  @staticmethod
  def retention(c) -> int:
    return c.rollout.lag + 1

  def __init__(self, run, store):
    self.run, self.store = run, store
    self.engine: ae.AsyncRollout | None = None  # built by restore or the first batch; started by a batch
    self.running = False
    self.eta = run.c.rollout.lag
    self._returned = None  # perf_counter when the previous batch was handed to the learner
    self._batches = 0  # batches handed out by this source
    self._idle_s = self._busy_s = 0.0  # learner waiting / working, from the second batch's return on

  def next_batch(self, step: int, version: int) -> dict:
    del step  # which request a batch holds depends on the workers, not the step
    if self.engine is None:
      self.engine = async_engine(self.run, self.store, None)
    if not self.running:
      self.engine.start()
      self.running = True
    asked = time.perf_counter()
    groups, st = self.engine.next_batch(version, timeout=600)
    if self._batches >= 2:  # the first wait and the first learner step hold the compiles
      self._busy_s += asked - self._returned
      self._idle_s += st["time_learner_idle_s"]
    self._returned, self._batches = time.perf_counter(), self._batches + 1
    ro = collate(groups, version)
    ro.update(time_learner_idle_s=st["time_learner_idle_s"], async_dropped_stale=st["dropped_stale"],
              async_buffered=st["buffered"], async_running=st["running"],
              async_lag_hist=np.bincount([lag(g, version) for g in groups], minlength=self.eta + 1).tolist(),
              time_learner_idle_frac=self._idle_s / max(self._idle_s + self._busy_s, 1e-9))
    ro["request_ids"] = sorted({int(g.request_id) for g in groups})
    return merge_processes(multiprocess.allgather_host(ro)) if multiprocess.multi() else ro

  def state(self) -> dict | None:
    """Stops the workers after their current rollout; the next batch continues from this state."""
    if self.engine is None:
      return None
    self.close()
    st = self.engine.state()
    self.engine = async_engine(self.run, self.store, st)
    return {"processes": multiprocess.allgather_host(st)} if multiprocess.multi() else st

  def restore(self, state: dict | None) -> None:
    self.close()
    n_proc = jax.process_count()
    saved = len(state["processes"]) if isinstance(state, dict) and "processes" in state else 1
    if saved != n_proc:
      raise ValueError(f"the async state was saved by {saved} process(es) and this run has {n_proc}: an async run "
                       "resumes on the number of processes that wrote its checkpoint")
    self.engine = async_engine(self.run, self.store, state["processes"][jax.process_index()] if n_proc > 1 else state)

  def close(self) -> None:
    if self.running:
      self.running = False
      self.engine.stop()
