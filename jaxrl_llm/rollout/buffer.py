"""Trajectory groups and the FIFO buffer between rollout workers and the learner.

A `Trajectory` is one GRPO group: the G completions of one prompt, generated together (by one
version, or by several recorded per token when partial rollouts cross a publish). Arrays are host
numpy so the buffer never pins device memory and snapshots are plain data.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, NamedTuple

import numpy as np


class Trajectory(NamedTuple):
  """One group of G completions (T = P + N: left-padded prompt, then completion; sampler layout)."""
  request_id: int  # unique id of the rollout; decides the prompt and the sampling key
  group_id: int  # id of the prompt the G completions share (its example_id)
  start_version: int  # version admitted and used for the first token (= min of versions_GN)
  sequence_GT: np.ndarray  # int32
  positions_GT: np.ndarray  # int32
  segment_ids_GT: np.ndarray  # int32, 1 on real tokens
  tokens_GN: np.ndarray  # int32 completion tokens
  mask_GN: np.ndarray  # float32, 1 on completion tokens incl. EOS
  behavior_logp_GN: np.ndarray  # float32 log μ of each sampled token
  versions_GN: np.ndarray  # int32 version that generated each token
  reward_G: np.ndarray  # float32
  prompt: Any = None  # the example dict (prompt / answer / example_id)
  # MoE routing replay (R3): int32 [G, T, L, k] expert ids of every fed token, as the sampler routed it
  # (sampling.generate's `routes_BTLk`); None for dense models, with replay off, and in pre-R3 checkpoints.
  routes_GTLk: np.ndarray | None = None
  # float32 [G, N] π_old scored by the worker at each token's generating version (`old_logp=recompute`);
  # None when not scored (other strategies, pre-existing checkpoints): the learner computes it.
  prox_logp_GN: np.ndarray | None = None
  reward_errors: int = 0  # reward calls of this group that raised, timed out or returned a bad value


def lag(group: Trajectory, learner_version: int) -> int:
  """Largest per-token lag of a group: learner version − its oldest generating version."""
  return learner_version - group.start_version


def collate(groups: list[Trajectory], learner_version: int) -> dict:
  """Concatenates groups into learner-batch arrays (B = n_groups · G), keeping group order.

  `group_id_B` numbers the groups 0..n-1 (what `advantages.*` expects); `lag_B` is the per-sequence
  lag of the oldest token. `routes_BTLk` (R3) and `prox_logp_BN` are present when every group carries them.
  """
  cat = lambda name: np.concatenate([getattr(g, name) for g in groups], axis=0)
  G_B = [g.reward_G.shape[0] for g in groups]
  routes = {"routes_BTLk": cat("routes_GTLk")} if all(g.routes_GTLk is not None for g in groups) else {}
  prox = {"prox_logp_BN": cat("prox_logp_GN")} if all(g.prox_logp_GN is not None for g in groups) else {}
  return {
      **routes, **prox,
      "sequence_BT": cat("sequence_GT"), "positions_BT": cat("positions_GT"), "segment_ids_BT": cat("segment_ids_GT"),
      "tokens_BN": cat("tokens_GN"), "mask_BN": cat("mask_GN"), "behavior_logp_BN": cat("behavior_logp_GN"),
      "versions_BN": cat("versions_GN"), "reward_B": cat("reward_G"),
      "group_id_B": np.repeat(np.arange(len(groups), dtype=np.int32), G_B),
      "lag_B": np.repeat(np.array([lag(g, learner_version) for g in groups], np.int32), G_B),
      "request_id_B": np.repeat(np.array([g.request_id for g in groups], np.int64), G_B),
      "reward_errors": sum(int(g.reward_errors) for g in groups),
  }


class Buffer:
  """Thread-safe FIFO of groups (finish order). Holds data and two counters, nothing else."""

  def __init__(self, groups: list[Trajectory] = (), dropped: int = 0):
    self._groups: collections.deque[Trajectory] = collections.deque(groups)
    self.dropped = dropped  # groups discarded because their lag exceeded η when consumed
    self._cond = threading.Condition()

  def __len__(self) -> int:
    with self._cond:
      return len(self._groups)

  def put(self, group: Trajectory) -> None:
    with self._cond:
      self._groups.append(group)
      self._cond.notify_all()

  def wait(self, n_groups: int, timeout: float | None) -> bool:
    """Blocks until at least `n_groups` are buffered (True) or `timeout` seconds pass (False)."""
    with self._cond:
      return self._cond.wait_for(lambda: len(self._groups) >= n_groups, timeout)

  def get_batch(self, n_groups: int, learner_version: int, eta: int | None) -> tuple[list[Trajectory] | None, int]:
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

  def snapshot(self) -> dict:
    """The buffered groups (as dicts of numpy arrays / ints) and counters, for a checkpoint."""
    with self._cond:
      return {"groups": [g._asdict() for g in self._groups], "dropped": self.dropped}

  @classmethod
  def restore(cls, snapshot: dict) -> "Buffer":
    """Inverse of `snapshot`: the same groups in the same FIFO order."""
    return cls([Trajectory(**g) for g in snapshot["groups"]], int(snapshot["dropped"]))
