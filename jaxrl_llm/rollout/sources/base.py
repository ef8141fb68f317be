"""The batch-source interface and its registry: how the loop learns where the batch of a step comes from.

A source is built as `Source(run, store)` (`run`: the loop's static wiring, `store`: the run's
ParamStore) and then only asked for

  next_batch(step, version) -> rollout dict   the batch the learner trains at `step`, with the newest
                                              published version `version`
  state() -> plain data                      dicts / lists / numpy arrays / numbers / strings / None,
                                              stored in the Orbax checkpoint via `checkpoint.pack_host`;
                                              may quiesce background work (the next batch resumes it)
  restore(state)                              continue from `state()` (before the first `next_batch`)
  close()                                     stop background work (idempotent)

and, on the class, `retention(c) -> int`: how many published snapshots the ParamStore keeps for it.

The rollout dict holds `sequence_BT`, `positions_BT`, `segment_ids_BT`, `mask_BN`, `behavior_logp_BN`,
`reward_B`, `versions_BN` (version that generated each token), `lag_B` (learner version minus generating
version), `reward_errors`; optionally `routes_BTLk`, `prox_logp_BN` (π_old already scored),
`adv_weight_B`, `time_generate_s`, `generated_tokens`, `request_ids`, and metric fields named
`time_*` / `async_*` / `replay_*` that the loop copies into the step's metrics row.

Adding a mode: one file that defines a class and decorates it with `@register("name")`, imported by
`jaxrl_llm.rollout.sources` (or by whoever uses it: registering also makes `rollout.mode="name"` valid).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import ml_collections

from jaxrl_llm import config as config_lib
from jaxrl_llm.rollout.sources.common import replay_on


class BatchSource(Protocol):
  """Where the batches of a run come from (see the module docstring)."""

  def next_batch(self, step: int, version: int) -> dict: ...

  def state(self) -> Any: ...

  def restore(self, state: Any) -> None: ...

  def close(self) -> None: ...


class Stateless:
  """Defaults for a source with no state of its own: nothing to save, restore or stop; one snapshot."""

  @staticmethod
  def retention(c) -> int:
    del c
    return 1

  def state(self) -> None:
    return None

  def restore(self, state: Any) -> None:
    del state

  def close(self) -> None:
    pass


_SOURCES: dict[str, Callable[..., BatchSource]] = {}


def register(name: str, *, mode: bool = True) -> Callable:
  """Class decorator: registers a source under `name`; `mode` (default) also accepts `rollout.mode=name`.

  Sources that are not a mode of their own (replay, chosen by `rollout.replay.capacity`) pass mode=False.
  """
  def deco(cls):
    _SOURCES[name] = cls
    if mode:
      config_lib.register_rollout_mode(name)
    return cls
  return deco


def names() -> list[str]:
  return sorted(_SOURCES)


def get(name: str):
  """The registered source class `name`."""
  if name not in _SOURCES:
    raise KeyError(f"no batch source {name!r}; registered: {', '.join(names())}")
  return _SOURCES[name]


def pick(c: ml_collections.ConfigDict) -> str:
  """The name of the run's source: `replay` when `rollout.replay.capacity` > 0, else `rollout.mode`."""
  return "replay" if replay_on(c) else c.rollout.mode


def retention(c: ml_collections.ConfigDict) -> int:
  """Snapshots the run's ParamStore keeps: what the mode's source needs for lagged generation and π_old."""
  return get(pick(c)).retention(c)
