"""Experience replay of GRPO groups (Arnal et al. 2026, spec B7) with staleness-aware sampling.

The sampler pushes groups into a FIFO of `capacity` groups; the learner samples `n` distinct groups
per step without removing them, so a group can be consumed several times (at most `reuse_limit`
times; 0 = unlimited). Sampling weights are ∝ `recency ** lag` (lag = learner version − the group's
generating version; recency 1 = uniform, smaller favours fresh groups).

Over-stale groups (lag > `max_lag`; `max_lag = -1` means no bound) follow a policy:
  drop        removed when found, counted in `dropped_stale`, never sampled
  keep        sampled like any other group
  downweight  sampled; the learner multiplies the group's advantages by decay ** (lag − max_lag)

Host-side and single-threaded (sync / fixed_lag modes): numpy arrays only, and deterministic given
the numpy Generator passed to `sample`, so runs repeat bit for bit and resume exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxrl_llm.config import REPLAY_STALE_POLICIES as STALE_POLICIES
from jaxrl_llm.record import Rollout, concat, from_plain, rows, to_plain

# Weight of a sampled row by policy, from its excess lag over max_lag (0 when not over-stale).
_WEIGHT_FNS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "drop": lambda over_B, decay: np.where(over_B > 0, 0.0, 1.0),  # never sampled: weight 0 by definition
    "keep": lambda over_B, decay: np.ones(over_B.shape),
    "downweight": lambda over_B, decay: np.power(float(decay), over_B),
}


def stale_weight(lag_B, max_lag: int, policy: str, decay: float) -> np.ndarray:
  """Advantage multiplier per row: 1 unless lag > max_lag (max_lag < 0: no bound), then by `policy`."""
  lag_B = np.asarray(lag_B)
  over_B = np.zeros(lag_B.shape, np.int64) if max_lag < 0 else np.maximum(lag_B - max_lag, 0)
  return _WEIGHT_FNS[policy](over_B, decay).astype(np.float32)


def is_over_stale(lag: int, max_lag: int) -> bool:
  return max_lag >= 0 and lag > max_lag


@dataclasses.dataclass
class Group:
  """A buffer entry: the G rows of one prompt as generated (a record), and the buffer's bookkeeping of them.

  The record holds what the generation gave (tokens, masks, μ, versions, rewards, routes; π_old when
  `old_logp=recompute` scored it at push time: it depends only on the generating version, so a replayed
  group is never rescored and its snapshot need not be kept); lags and group ids are set when sampled.
  """
  rollout: Rollout
  version: int  # generating version (every token of the group)
  step: int  # learner step whose sampler call generated it
  group_id: int = -1  # unique, assigned by ReplayBuffer.push in push order
  uses: int = 0  # times sampled so far


def split_groups(ro: Rollout, group_size: int, version: int, step: int) -> list[Group]:
  """Cuts a rollout (B = n · G rows) into its n groups, copying the rows (the buffer owns them)."""
  gen = ro.replace(lag_B=None, group_B=None)
  return [Group(rows(gen, i, i + group_size), int(version), int(step)) for i in range(0, ro.num_rows, group_size)]


def collate(groups: list[Group], learner_version: int, max_lag: int, policy: str, decay: float) -> Rollout:
  """The learner batch of sampled groups: rows concatenated in the given order, per-row lag (learner
  version − group version), advantage weights, groups numbered 0..n-1; `stats` names the buffer's ids."""
  G_B = [g.rollout.num_rows for g in groups]
  lag_B = np.repeat(np.array([learner_version - g.version for g in groups], np.int32), G_B)
  return concat([g.rollout for g in groups]).replace(
      lag_B=lag_B, adv_weight_B=stale_weight(lag_B, max_lag, policy, decay),
      group_B=np.repeat(np.arange(len(groups), dtype=np.int32), G_B),
      stats={"replay_group_ids": [g.group_id for g in groups]})


class ReplayBuffer:
  """FIFO of groups with sampling without removal. Holds data and counters, nothing else."""

  def __init__(self, capacity: int, reuse_limit: int = 0, recency: float = 1.0, policy: str = "keep",
               max_lag: int = -1, decay: float = 1.0, groups: list[Group] = (), next_id: int = 0,
               counters: dict | None = None):
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1, got {capacity}")
    if policy not in STALE_POLICIES:
      raise ValueError(f"policy must be one of {STALE_POLICIES}, got {policy!r}")
    if not recency > 0:
      raise ValueError(f"recency must be > 0, got {recency}")
    self.capacity, self.reuse_limit, self.recency = capacity, reuse_limit, recency
    self.policy, self.max_lag, self.decay = policy, max_lag, decay
    self._groups: list[Group] = list(groups)  # oldest first
    self._next_id = next_id
    self.counters = {"evicted_capacity": 0, "evicted_reuse": 0, "dropped_stale": 0, **(counters or {})}

  def __len__(self) -> int:
    return len(self._groups)

  @property
  def groups(self) -> list[Group]:
    """The buffered groups, oldest first (read-only view for tests and metrics)."""
    return list(self._groups)

  def push(self, groups: list[Group]) -> None:
    """Appends groups (ids assigned in order) and evicts the oldest beyond capacity."""
    for g in groups:
      g.group_id, self._next_id = self._next_id, self._next_id + 1
      self._groups.append(g)
    over = max(0, len(self._groups) - self.capacity)
    self._groups = self._groups[over:]
    self.counters["evicted_capacity"] += over

  def drop_stale(self, learner_version: int) -> int:
    """Under `drop`, removes groups whose lag exceeds max_lag; returns how many."""
    if self.policy != "drop":
      return 0
    keep = [g for g in self._groups if not is_over_stale(learner_version - g.version, self.max_lag)]
    dropped = len(self._groups) - len(keep)
    self._groups = keep
    self.counters["dropped_stale"] += dropped
    return dropped

  def available(self, learner_version: int) -> int:
    """Groups that `sample` may pick at this version (drops over-stale ones first under `drop`)."""
    self.drop_stale(learner_version)
    return len(self._groups)  # groups that reached the reuse limit were removed when sampled

  def weights(self, learner_version: int) -> np.ndarray:
    """Normalised sampling probabilities ∝ recency ** lag of the buffered groups (oldest first)."""
    lag_n = np.array([learner_version - g.version for g in self._groups], np.float64)
    logw_n = lag_n * np.log(self.recency)  # log space: a tiny recency at a large lag must not underflow to 0/0
    w_n = np.exp(logw_n - logw_n.max())
    return w_n / w_n.sum()

  def sample(self, rng: np.random.Generator, n: int, learner_version: int) -> list[Group]:
    """n distinct groups, drawn without replacement ∝ recency ** lag, returned oldest first.

    Increments their use counters and removes those that reached `reuse_limit`. Raises when fewer
    than n groups are available (the caller generates more first).
    """
    if self.available(learner_version) < n:
      raise ValueError(f"replay holds {len(self._groups)} sampleable groups, {n} requested")
    idx = np.sort(rng.choice(len(self._groups), size=n, replace=False, p=self.weights(learner_version)))
    picked = [self._groups[int(i)] for i in idx]
    for g in picked:
      g.uses += 1
    spent = {g.group_id for g in picked if self.reuse_limit and g.uses >= self.reuse_limit}
    self._groups = [g for g in self._groups if g.group_id not in spent]
    self.counters["evicted_reuse"] += len(spent)
    return picked

  def state(self) -> dict:
    """The buffer's data (groups as dicts of numpy arrays and ints, id cursor, counters) for a checkpoint."""
    return {"groups": [{"rollout": to_plain(g.rollout), "version": g.version, "step": g.step,
                        "group_id": g.group_id, "uses": g.uses} for g in self._groups],
            "next_id": self._next_id, "counters": dict(self.counters)}

  @classmethod
  def from_state(cls, state: dict, capacity: int, **settings) -> "ReplayBuffer":
    """Inverse of `state` under the run's settings (those of `__init__`): same groups, order, ids, counters."""
    groups = [Group(from_plain(g["rollout"] if "rollout" in g else g["arrays"]),  # "arrays": before the record
                    int(g["version"]), int(g["step"]), int(g["group_id"]), int(g["uses"])) for g in state["groups"]]
    return cls(capacity, **settings, groups=groups, next_id=int(state["next_id"]), counters=dict(state["counters"]))
