"""A verifiers (0.4, `verifiers.v1`) taskset written as a verifiers user writes one: 2-digit sums, scored by an
async `@vf.reward`. configs/verifiers_tiny.py trains it through `jaxrl_llm.serve.verifiers_env` (taskset id: this
module's name). Not a `jaxrl_llm.envs` environment: verifiers runs it, the endpoint serves its model calls.

Task i: the prompt "a+b=" with a, b drawn from 0..99 by `random.Random(i)` (the arithmetic task's raw prompt, so the
tiny model's SFT warm start reads it); `SumsConfig.num_tasks` of them. Reward: 1 when the reply (stripped) is the
sum, else 0.5 × the share of the sum's digits the reply has in place (the arithmetic task's `partial_credit`:
varied rewards in a group).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf


def score(reply: str, answer: int) -> float:
  """1 for exactly `answer`, else 0.5 × the share of its digits in place."""
  want, got = str(answer), reply.strip()
  if got == want:
    return 1.0
  return 0.5 * sum(a == b for a, b in zip(want, got)) / len(want)


class SumsData(vf.TaskData):
  answer: int = 0


class SumsTask(vf.Task[SumsData]):

  @vf.reward(weight=1.0)
  async def correct(self, trace: vf.Trace) -> float:
    return score(trace.last_reply or "", self.data.answer)


class SumsConfig(vf.TasksetConfig):
  num_tasks: int = 100


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):

  def load(self) -> list[SumsTask]:
    out = []
    for i in range(self.config.num_tasks):
      rng = random.Random(i)
      a, b = rng.randint(0, 99), rng.randint(0, 99)
      out.append(SumsTask(SumsData(prompt=f"{a}+{b}=", answer=a + b), self.config.task))
    return out


__all__ = ["SumsTaskset"]
