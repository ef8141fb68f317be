"""Text environments for multi-turn episodes: a registry and the `Env` interface.

An environment is text only (it imports no models, sampler, rollout or loop; `.importlinter`):

  env = envs.get("guess_number", max_turns=4)
  first = env.reset(seed)              # the first user message / observation text
  obs, reward, done = env.step("7")    # the policy's action text -> (observation text, step reward, done)

An episode's return is the sum of its step rewards. `reset(seed)` must be deterministic in the seed:
the G episodes of a GRPO group start from one seed, hence one state. An action the environment cannot
read raises `InvalidAction`: the episode ends with return 0 and is counted ("invalid"), as an
environment that raises anything else ("error") or overruns its time limit ("timeout") is
(`jaxrl_llm.rollout.episodes`). One instance plays one episode at a time (the runner makes one per row).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol


class InvalidAction(ValueError):
  """Raised by `Env.step` for an action it cannot read (a malformed action)."""


class Env(Protocol):
  """A text environment (module docstring)."""

  def reset(self, seed: int) -> str:
    ...

  def step(self, action_text: str) -> tuple[str, float, bool]:
    ...


_FACTORIES: dict[str, Callable[..., Env]] = {}


def register(name: str):
  """Decorator: registers an environment factory (a class or a function returning an `Env`) under `name`."""
  def deco(factory):
    if name in _FACTORIES and _FACTORIES[name] is not factory:
      raise ValueError(f"environment {name!r} is already registered")
    _FACTORIES[name] = factory
    return factory
  return deco


def names() -> list[str]:
  """Names accepted by `get`."""
  return sorted(_FACTORIES)


def kwarg_names(name: str) -> list[str]:
  """Keyword arguments the environment `name` takes."""
  if name not in _FACTORIES:
    raise ValueError(f"unknown environment {name!r}; valid names: {', '.join(names())}")
  return list(inspect.signature(_FACTORIES[name]).parameters)


def get(name: str, **kwargs: Any) -> Env:
  """A new instance of the environment `name`; an argument it does not take is an error naming it."""
  accepted = kwarg_names(name)
  for k in kwargs:
    if k not in accepted:
      raise ValueError(f"environment {name!r} takes no argument {k!r} (its arguments: {', '.join(accepted) or 'none'})")
  return _FACTORIES[name](**kwargs)


from jaxrl_llm.envs import guess_number  # noqa: E402,F401  (registers the toy environment)
# Package-backed environments (the `envs` extra): these modules import textarena / reasoning_gym only when an
# instance is made, so they register without the packages and a missing package is an ImportError at `get`.
from jaxrl_llm.envs import reasoning_gym_env, textarena_env  # noqa: E402,F401
from jaxrl_llm.envs import scienceworld_env  # noqa: E402,F401  (ScienceWorld: needs Java too)
