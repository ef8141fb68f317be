"""`staged` (μ-GRPO): the rollouts of a stage of k = `rollout.lag` learner steps are generated at once by
the version at the stage start, then consumed one learner step at a time (lag 0, 1, …, k-1 within a stage).

State: the stage's generating version. The stage's rollouts are not saved: a run resumed mid-stage
regenerates them (prompts depend on (seed, step), the key on (seed, version, stage start)), identically.
"""

from __future__ import annotations

import numpy as np

from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout.sources.base import Stateless, register
from jaxrl_llm.rollout.sources.common import sync_rollout


@register("staged")
class Staged(Stateless):

  @staticmethod
  def retention(s) -> int:
    return s.lag + 1  # a stage cut by a resume is regenerated from its starting version

  def __init__(self, ctx, store):
    self.ctx, self.store, self.k = ctx, store, ctx.settings.lag
    self.stage_version = 0
    self.stage: dict[int, Rollout] = {}  # the current stage's rollouts by learner step

  def next_batch(self, step: int, version: int) -> Rollout:
    k = self.k
    if step % k == 0:
      self.stage_version = version
    if step % k == 0 or not self.stage:  # a stage starts (or is regenerated after a resume mid-stage)
      first = step - step % k
      steps = list(range(first, first + k))
      self.stage = dict(zip(steps, sync_rollout(self.ctx, self.store, steps, version, self.stage_version)))
    ro = self.stage.pop(step)
    return ro.replace(lag_B=np.full_like(ro.lag_B, version - self.stage_version))

  def state(self) -> dict:
    return {"stage_version": int(self.stage_version)}

  def restore(self, state: dict | None) -> None:
    self.stage_version = 0 if state is None else int(state["stage_version"])
    self.stage = {}
