"""The FIFO buffer of groups between rollout workers and the learner, and how a batch is cut from it.

A group is a `Rollout` record of the G completions of one prompt, generated together (by one version,
or by several recorded per token when partial rollouts cross a publish). Its `stats` say which request
it answers: `request_id`, `example_id` (the prompt), `start_version` (the admitted version, that of its
first token) and `reward_errors`. Arrays are host numpy so the buffer never pins device memory and its
snapshots are plain data.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from jaxrl_llm.record import Rollout, concat, from_plain, to_plain


def group_record(r: Rollout, *, request_id: int, example_id: int, start_version: int, **stats) -> Rollout:
  """`r` (the G rows of one request) as a buffer group: its request id on every row, its bookkeeping in stats."""
  return r.replace(request_B=np.full((r.num_rows,), request_id, np.int32)).with_stats(
      request_id=int(request_id), example_id=int(example_id), start_version=int(start_version), **stats)


def lag(group: Rollout, learner_version: int) -> int:
  """Largest per-token lag of a group: learner version − its oldest generating version."""
  return learner_version - group.stat("start_version")


def collate(groups: list[Rollout], learner_version: int) -> Rollout:
  """Concatenates groups into the learner batch (B = n_groups · G), keeping group order.

  `group_B` numbers the groups 0..n-1 (what `advantages.*` expects); `lag_B` is the per-sequence lag of
  the oldest token. `routes_BTLk` (R3) and `prox_logp_BN` are kept when every group carries them.
  """
  G_B = [g.num_rows for g in groups]
  return concat(groups, stats={"reward_errors": sum(int(g.stat("reward_errors")) for g in groups)}).replace(
      group_B=np.repeat(np.arange(len(groups), dtype=np.int32), G_B),
      lag_B=np.repeat(np.array([lag(g, learner_version) for g in groups], np.int32), G_B))


# A group as checkpoints before the record stored it (a Rollout's fields): its bookkeeping fields.
_LEGACY_STATS = ("request_id", "group_id", "start_version", "reward_errors")


def _restore_group(d: dict) -> Rollout:
  r = from_plain(d)
  if "start_version" in d:  # written before the record, as a `Trajectory`'s fields
    return group_record(r, request_id=int(d["request_id"]), example_id=int(d["group_id"]),
                        start_version=int(d["start_version"]), reward_errors=int(d.get("reward_errors") or 0))
  return r


class Buffer:
  """Thread-safe FIFO of groups (finish order). Holds data and two counters, nothing else."""

  def __init__(self, groups: list[Rollout] = (), dropped: int = 0):
    self._groups: collections.deque[Rollout] = collections.deque(groups)
    self.dropped = dropped  # groups discarded because their lag exceeded η when consumed
    self._cond = threading.Condition()

  def __len__(self) -> int:
    with self._cond:
      return len(self._groups)

  def put(self, group: Rollout) -> None:
    with self._cond:
      self._groups.append(group)
      self._cond.notify_all()

  def wait(self, n_groups: int, timeout: float | None) -> bool:
    """Blocks until at least `n_groups` are buffered (True) or `timeout` seconds pass (False)."""
    with self._cond:
      return self._cond.wait_for(lambda: len(self._groups) >= n_groups, timeout)

  def get_batch(self, n_groups: int, learner_version: int, eta: int | None) -> tuple[list[Rollout] | None, int]:
    """Takes the `n_groups` oldest groups whose lag is ≤ η; non-blocking.

    Groups found stale on the way (lag > η) are removed and counted in `dropped`: admission should
    make that impossible, so a non-zero count is a bug signal, not a normal event.
    Returns (groups or None when fewer than n_groups fresh ones are buffered, number dropped now).
    """
    with self._cond:
      stale = [g for g in self._groups if eta is not None and lag(g, learner_version) > eta]
      if stale:
        self._groups = collections.deque(g for g in self._groups if lag(g, learner_version) <= eta)
        self.dropped += len(stale)
      if len(self._groups) < n_groups:
        return None, len(stale)
      return [self._groups.popleft() for _ in range(n_groups)], len(stale)

  def flush(self) -> int:
    """Empties the buffer (its groups are thrown away, not consumed); the number of groups it held."""
    with self._cond:
      n = len(self._groups)
      self._groups.clear()
      return n

  def snapshot(self) -> dict:
    """The buffered groups (as dicts of numpy arrays / ints) and counters, for a checkpoint."""
    with self._cond:
      return {"groups": [to_plain(g) for g in self._groups], "dropped": self.dropped}

  @classmethod
  def restore(cls, snapshot: dict) -> "Buffer":
    """Inverse of `snapshot`: the same groups in the same FIFO order."""
    return cls([_restore_group(g) for g in snapshot["groups"]], int(snapshot["dropped"]))
