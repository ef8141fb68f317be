"""`fixed_lag`: the batch of learner step t is generated at the start of step max(0, t - k), k = `rollout.lag`.

A pipeline k batches deep: step t generates step t + k's batch with the current version (and, under
`rollout.old_logp="recompute"`, scores its π_old with that version's learner copy at once), queues it,
and trains on the batch step t - k queued. Step 0 fills the pipeline: steps 0..k all come from version 0,
so the lag is min(t, k) in versions (fewer when non-finite updates were skipped: a skipped step publishes
nothing). The store keeps one snapshot; the queue holds k batches of tokens and log-probs (kilobytes,
where k + 1 parameter snapshots were hundreds of MB each on the 135M model and would be GBs on a 7B one).

Deterministic and bitwise repeatable for a seed: prompts depend on (seed, t), the sampling key on
(seed, generating version, t). State: the queued batches (plain arrays), so a resumed run trains on
exactly what the uninterrupted one would. The last k steps still generate ahead, batches only a longer
run consumes (k extra sampler calls per run): a run resumed with a larger `num_steps` continues exactly.
"""

from __future__ import annotations

import time

import numpy as np

from jaxrl_llm import multiprocess
from jaxrl_llm.errors import RunError
from jaxrl_llm.record import Rollout, from_plain, to_plain
from jaxrl_llm.rollout import old_logp
from jaxrl_llm.rollout.settings import RolloutSettings
from jaxrl_llm.rollout.sources.base import Stateless, register
from jaxrl_llm.rollout.sources.common import sync_rollout


@register("fixed_lag")
class FixedLag(Stateless):

  @staticmethod
  def lag_of(s: RolloutSettings) -> int:
    return s.lag

  def __init__(self, ctx, store):
    self.ctx, self.store, self.lag = ctx, store, self.lag_of(ctx.settings)
    self.queue: dict[int, Rollout] = {}  # learner step -> its batch, generated k steps ahead

  def behavior_version(self, version: int) -> int:
    """The version that generates fresh data at learner version `version` under a snapshot-per-version
    scheme (replay over fixed_lag keeps k + 1 snapshots and uses this)."""
    return max(0, version - self.lag)

  def _generate(self, step: int, version: int) -> Rollout:
    ro = sync_rollout(self.ctx, self.store, [step], version, version)[0]
    if self.lag > 0 and self.ctx.settings.old_logp == "recompute":
      # π_old is this version's learner copy: score it now, before the snapshot is dropped.
      ro = ro.replace(prox_logp_BN=multiprocess.to_host(old_logp.at_generation(self.ctx.score, self.store, ro)))
    return ro

  def next_batch(self, step: int, version: int) -> Rollout:
    # Ahead even past `num_steps`: a run resumed with a larger `num_steps` then continues exactly.
    missing = [s for s in range(step, step + self.lag + 1) if s not in self.queue]
    early = [s for s in missing if s < step + self.lag]  # due from an earlier step: only a fresh start has none
    if step > 0 and early:
      raise RunError(f"fixed_lag: no queued batch for step(s) {early} (the checkpoint holds no rollout queue: "
                     "written by an older jaxrl_llm?); start the run in a new workdir")
    t0, tokens = time.perf_counter(), 0.0
    for s in missing:
      self.queue[s] = self._generate(s, version)
      tokens += float(self.queue[s].mask_BN.sum())
    ro = self.queue.pop(step)
    # Timings are this step's: the generation it ran (for a later step), not the batch's own.
    return ro.replace(lag_B=np.full_like(ro.lag_B, version - int(ro.versions_BN.flat[0]))).with_stats(
        time_generate_s=time.perf_counter() - t0 if missing else 0.0, generated_tokens=tokens)

  def state(self) -> dict:
    return {"queue": [[s, to_plain(self.queue[s])] for s in sorted(self.queue)]}

  def restore(self, state: dict | None) -> None:
    self.queue = {} if state is None else {int(s): from_plain(ro) for s, ro in state["queue"]}
