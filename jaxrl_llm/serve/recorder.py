"""The recorder: every served call under its episode id, and a finished episode as one learner row.

An episode opens with its first call (or `open`, which the harness source calls before starting the harness) and
ends when its reward is reported (`reward`). Each call keeps its prompt ids, completion ids, μ's log-probs and the
version that sampled it, plus (chat calls) the `chat.Turn` a later call may extend.

`episode_row` packs an episode into one row of width P + N (`record_layout`'s convention: the first prompt
left-padded into the P columns, the rest compact after it, padding at the end):
- "extended" (each call's prompt starts with the previous call's prompt + completion, the normal chat case): the
  last call's prompt + completion, once; mask 1 exactly on the served completion tokens, 0 on everything the
  harness wrote (`env_mask_BN` 1 there); each completion token carries its call's version, a harness token the
  version of the call it answers;
- "split" (the harness rewrote its history): each call is its own packed segment (segment ids 1, 2, ...,
  positions restarting), so each completion is trained on exactly the context it was sampled with; every segment
  shares the episode's reward.
An episode longer than P + N tokens cannot be a row (`TooLong`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import numpy as np

from jaxrl_llm.serve.chat import Turn


@dataclasses.dataclass
class Call:
  """One served call of an episode."""
  prompt_ids: list[int]
  completion_ids: list[int]
  logprobs: list[float]
  version: int
  turn: Turn | None = None  # chat calls: what a later call may extend
  records: dict | None = None  # μ's records of each completion token ({name: [len(completion_ids), ...]})
  routes: np.ndarray | None = None  # MoE: [len(prompt_ids) + len(completion_ids), L, k] expert ids by position


@dataclasses.dataclass
class Episode:
  """An episode's served calls, reward, why it is invalid (None: valid) and its timeline: `events`, one dict per
  thing that happened to it in order, `t` seconds after it opened (`Recorder.note`)."""
  id: str
  calls: list[Call] = dataclasses.field(default_factory=list)
  reward: float | None = None
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  invalid: str | None = None
  events: list[dict] = dataclasses.field(default_factory=list)
  t0: float = dataclasses.field(default_factory=time.monotonic)


EXPIRED_KEPT = 100_000  # expired ids remembered (a few MB): older ones are answered as unknown (404)


class UnknownEpisode(KeyError):
  """No open episode has this id."""


class EpisodeEnded(ValueError):
  """The episode's reward was already reported: no more calls or rewards."""


class EpisodeExpired(EpisodeEnded):
  """The episode overran its time limit (`serve.timeout_s`) and was closed: later calls are refused (408)."""


class TooLong(ValueError):
  """An episode's tokens do not fit the learner row."""


class Recorder:
  """Open episodes by id (thread-safe). `auto_open`: a call with a new id opens its episode (standalone serving);
  the harness source opens its episodes itself and turns it off, so a stray id is an unknown episode."""

  def __init__(self, auto_open: bool = True):
    self.auto_open = auto_open
    self._episodes: dict[str, Episode] = {}
    self._expired: dict[str, None] = {}  # ids closed at their deadline (insertion-ordered; the newest EXPIRED_KEPT)
    self._lock = threading.Lock()

  def open(self, episode_id: str) -> Episode:
    with self._lock:
      ep = self._episodes.get(episode_id)
      if ep is None:
        ep = self._episodes[episode_id] = Episode(episode_id)
      return ep

  def get(self, episode_id: str, may_open: bool = True) -> Episode:
    """The open episode `episode_id` (opened here when `auto_open` and `may_open`); UnknownEpisode / EpisodeEnded
    otherwise."""
    with self._lock:
      ep = self._episodes.get(episode_id)
      if ep is None and episode_id in self._expired:
        raise EpisodeExpired(f"episode {episode_id!r} overran its time limit and was closed")
      if ep is None and self.auto_open and may_open:
        ep = self._episodes[episode_id] = Episode(episode_id)
    if ep is None:
      raise UnknownEpisode(episode_id)
    if ep.done.is_set():
      raise EpisodeEnded(f"episode {episode_id!r} has ended (its reward was reported)")
    return ep

  def history(self, episode_id: str) -> list[Turn]:
    ep = self.get(episode_id)
    with self._lock:
      return [c.turn for c in ep.calls if c.turn is not None]

  def record(self, episode_id: str, call: Call, **event) -> None:
    """Appends a served call (and its `event` details to the timeline)."""
    ep = self.get(episode_id)
    with self._lock:
      ep.calls.append(call)
      self._note(ep, "call", version=call.version, prompt_tokens=len(call.prompt_ids),
                 completion_tokens=len(call.completion_ids), **event)

  def reward(self, episode_id: str, reward: float) -> None:
    """Ends the episode with `reward` (an episode never called is unknown, even with `auto_open`)."""
    ep = self.get(episode_id, may_open=False)
    with self._lock:
      ep.reward = float(reward)
      self._note(ep, "reward", reward=float(reward))
    ep.done.set()

  def invalidate(self, episode_id: str, reason: str) -> None:
    """Marks an open episode invalid (its calls do not form a valid conversation): the harness source drops it. An
    unknown or ended id is left alone (the refused call says why)."""
    with self._lock:
      ep = self._episodes.get(episode_id)
      if ep is not None and not ep.done.is_set():
        ep.invalid = ep.invalid or reason
        self._note(ep, "invalid", reason=reason)

  @staticmethod
  def _note(ep: Episode, kind: str, **detail) -> None:
    ep.events.append({"t": round(time.monotonic() - ep.t0, 6), "event": kind, **detail})

  def pop(self, episode_id: str, expired: bool = False) -> Episode | None:
    """Removes the episode (finished or not) and returns it; None when it is unknown. `expired`: it overran its
    time limit, so its later calls and reward are refused as such (`EpisodeExpired`), not as unknown."""
    with self._lock:
      if expired:
        self._expired[episode_id] = None
        while len(self._expired) > EXPIRED_KEPT:
          del self._expired[next(iter(self._expired))]
      return self._episodes.pop(episode_id, None)


def extends(calls: Sequence[Call]) -> bool:
  """Whether every call's prompt starts with the previous call's prompt + completion."""
  for a, b in zip(calls, calls[1:]):
    prev = a.prompt_ids + a.completion_ids
    if b.prompt_ids[:len(prev)] != prev:
      return False
  return True


def _segments(calls: Sequence[Call]) -> list[list[Call]]:
  """One segment holding every call when they extend each other, else one segment per call."""
  return [list(calls)] if extends(calls) else [[c] for c in calls]


def episode_row(calls: Sequence[Call], P: int, N: int, pad_id: int) -> dict:
  """The episode as one row (module docstring): numpy arrays `sequence_T`, `positions_T`, `segment_ids_T` [P + N]
  and `mask_N`, `behavior_logp_N`, `versions_N`, `env_mask_N` [N], plus `split` (bool: packed per call). When every
  call carries them: μ's records by name ([N, ...], on the completion tokens; `Call.records`) and `routes_TLk` (the
  expert ids each token was fed with; a token several calls fed keeps the last call's, as episodes' turns do;
  columns no call fed hold experts 0..k-1, as the sampler's unfed last column does).

  Raises TooLong when the tokens do not fit, ValueError for an episode without calls."""
  if not calls:
    raise ValueError("an episode without calls has no row")
  ids, pos, seg, pol, logp, ver = [], [], [], [], [], []
  names = sorted(set.intersection(*(set(c.records or {}) for c in calls)))
  recs: dict[str, list] = {n: [] for n in names}  # per token of `ids` (None: not a completion token)
  routes = [] if all(c.routes is not None for c in calls) else None
  segments = _segments(calls)
  for s, group in enumerate(segments, start=1):
    last = group[-1]
    toks = last.prompt_ids + last.completion_ids
    pol_t, logp_t = np.zeros(len(toks), bool), np.zeros(len(toks), np.float32)
    ver_t = np.full(len(toks), group[0].version, np.int32)
    rec_t = {n: [None] * len(toks) for n in names}
    routes_t = [None] * len(toks)
    for c in group:  # the completion of every call sits right after its own prompt in the last call's ids
      a, b = len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)
      pol_t[a:b], logp_t[a:b] = True, c.logprobs
      ver_t[a:] = c.version  # its tokens and the harness tokens answering it
      for n in names:
        rec_t[n][a:b] = list(c.records[n])
      if routes is not None:
        routes_t[:b] = list(c.routes[:b])
    for n in names:
      recs[n] += rec_t[n]
    if routes is not None:
      routes += routes_t
    ids += toks
    pos += list(range(len(toks)))
    seg += [s] * len(toks)
    pol += pol_t.tolist()
    logp += logp_t.tolist()
    ver += ver_t.tolist()
  k = min(len(calls[0].prompt_ids), P)  # the first prompt's first k ids fill the P columns (right-aligned)
  if len(ids) - k > N:
    raise TooLong(f"the episode has {len(ids)} tokens; its row holds {k} prompt + {N} more (serve.max_context)")
  T = P + N
  out = {"sequence_T": np.full(T, pad_id, np.int32), "positions_T": np.zeros(T, np.int32),
         "segment_ids_T": np.zeros(T, np.int32), "mask_N": np.zeros(N, np.float32),
         "behavior_logp_N": np.zeros(N, np.float32), "versions_N": np.full(N, ver[-1], np.int32),
         "env_mask_N": np.zeros(N, np.float32), "split": len(segments) > 1}
  cols = np.concatenate([np.arange(P - k, P), P + np.arange(len(ids) - k)]).astype(np.int64)
  out["sequence_T"][cols] = ids
  out["positions_T"][cols] = pos
  out["segment_ids_T"][cols] = seg
  r = cols[k:] - P  # response columns of tokens k.. (policy tokens are never in the prompt region)
  assert not any(pol[:k]), "a completion token in the first prompt"
  out["mask_N"][r] = np.asarray(pol[k:], np.float32)
  out["behavior_logp_N"][r] = np.asarray(logp[k:], np.float32)
  out["versions_N"][r] = ver[k:]
  out["env_mask_N"][r] = 1.0 - np.asarray(pol[k:], np.float32)
  for n, per_token in recs.items():
    like = np.asarray(calls[0].records[n])  # [tokens, ...]: the trailing shape and dtype
    a = np.full((N,) + like.shape[1:], pad_id if "ids" in n else 0, like.dtype)
    for j, x in enumerate(per_token[k:]):
      if x is not None:
        a[r[j]] = x
    out[n] = a
  if routes is not None:
    shape = calls[0].routes.shape[1:]  # [L, k]
    out["routes_TLk"] = np.broadcast_to(np.arange(shape[1], dtype=np.int32), (T,) + shape).copy()
    for j, x in enumerate(routes):
      if x is not None:
        out["routes_TLk"][cols[j]] = x
  return out
