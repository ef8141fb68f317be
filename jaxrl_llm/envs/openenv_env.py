"""OpenEnv environments (`openenv-core` 0.3) as text environments: `envs.get("openenv", environment="pkg.mod:MyEnv")`.

Needs the `openenv` extra (`pip install 'jaxrl_llm[openenv]'`); openenv is imported when an instance is made, so
importing this module never needs it.

An OpenEnv environment is a server-side `openenv.core.env_server.Environment`: `reset(seed=...)` and `step(action)`
return a pydantic `Observation` carrying `done` and `reward`; actions are pydantic `Action` models. The adapter plays
one either

- in-process (`environment="pkg.mod:MyEnv"`: the class, or any factory returning an instance), or
- over HTTP (`base_url="http://host:port"`: a running OpenEnv server, e.g. `uvicorn pkg.app:app` or
  `openenv serve`), one WebSocket session per instance through OpenEnv's own `GenericEnvClient`; the server must
  allow as many concurrent sessions as a batch has rows (`create_app(..., max_concurrent_envs=N)`).

Text in, text out:
- the policy's action text fills one field of the action (`action_field`; in-process the default is the action
  class's only required `str` field, over HTTP it must be named, since the client sends a plain dict);
- the policy sees the observation's fields other than `done`, `reward` and `metadata`: the one named by
  `observation_field`, else the only one there is, else `name: value` lines in the model's field order;
- the step reward is the observation's `reward` (None counts 0); `done` ends the episode;
- an action the `Action` model rejects (a pydantic ValidationError in-process, the server's VALIDATION_ERROR answer
  over HTTP) is an `InvalidAction`: the episode ends with return 0 and is counted as invalid
  (`jaxrl_llm.rollout.episodes`); anything else the environment raises is an error there, as for every environment.

Seeds: `reset(seed)` passes the runner's seed as OpenEnv's `seed` (a GRPO group's G episodes share one), plus
`reset_kwargs`; an environment that ignores its seed breaks the group's shared start, as anywhere.
"""

from __future__ import annotations

import importlib
import typing
from typing import Any

from jaxrl_llm.envs import InvalidAction, register

_HIDDEN = ("done", "reward", "metadata")


def _load(ref: str, what: str):
  module, sep, attr = ref.partition(":")
  if not sep or not module or not attr:
    raise ValueError(f"openenv {what}={ref!r}: expected 'package.module:Name'")
  obj = getattr(importlib.import_module(module), attr, None)
  if obj is None:
    raise ValueError(f"openenv {what}={ref!r}: module {module!r} has no {attr!r}")
  return obj


def _action_class(env) -> type:
  """The Action model an in-process environment takes: `Environment[ActT, ObsT, StateT]`'s first parameter, else
  the annotation of `step`'s action argument."""
  from openenv.core.env_server.types import Action
  for klass in type(env).__mro__:
    for base in getattr(klass, "__orig_bases__", ()):
      args = typing.get_args(base)
      if args and isinstance(args[0], type) and issubclass(args[0], Action):
        return args[0]
  hint = typing.get_type_hints(type(env).step).get("action")
  if isinstance(hint, type) and issubclass(hint, Action):
    return hint
  raise ValueError(f"openenv: cannot tell the Action class of {type(env).__name__} (neither Environment[ActT, ...] "
                   "nor an annotated step(action)); name it with action='package.module:ActionClass'")


def _text_field(action_cls: type) -> str:
  required = [n for n, f in action_cls.model_fields.items() if f.is_required() and f.annotation is str]
  if len(required) != 1:
    raise ValueError(f"openenv: {action_cls.__name__} has {len(required)} required str fields "
                     f"({', '.join(required) or 'none'}); name the one the policy's text fills with action_field=")
  return required[0]


def render(fields: dict, observation_field: str = "") -> str:
  """The text the policy sees for an observation's fields (module docstring)."""
  shown = {k: v for k, v in fields.items() if k not in _HIDDEN}
  if observation_field:
    if observation_field not in shown:
      raise ValueError(f"openenv observation_field={observation_field!r}: the observation has "
                       f"{', '.join(shown) or 'no fields'}")
    return str(shown[observation_field])
  if len(shown) == 1:
    return str(next(iter(shown.values())))
  return "\n".join(f"{k}: {v}" for k, v in shown.items())


@register("openenv")
class OpenEnv:
  """An OpenEnv environment played in-process or over HTTP (module docstring).

  Args:
    environment: 'package.module:EnvClass' (or a factory) to play in-process.
    base_url: a running OpenEnv server to play over HTTP instead.
    action: 'package.module:ActionClass' (in-process: default read from the environment).
    action_field: the action field the policy's text fills.
    observation_field: the observation field shown to the policy.
    reset_kwargs: keyword arguments of every `reset` besides the seed.
  """

  def __init__(self, environment: str = "", base_url: str = "", action: str = "", action_field: str = "",
               observation_field: str = "", reset_kwargs: dict | None = None):
    if bool(environment) == bool(base_url):
      raise ValueError("openenv: give exactly one of environment='package.module:EnvClass' (in-process) or "
                       "base_url='http://host:port' (a running server)")
    self.observation_field, self.reset_kwargs = observation_field, dict(reset_kwargs or {})
    if environment:
      self.env, self.client = _load(environment, "environment")(), None
      self.action_cls = _load(action, "action") if action else _action_class(self.env)
      self.action_field = action_field or _text_field(self.action_cls)
    else:
      if not action_field:
        raise ValueError("openenv base_url=...: name the action field the policy's text fills (action_field=)")
      from openenv.core import GenericEnvClient
      self.env, self.action_cls, self.action_field = None, None, action_field
      self.client = GenericEnvClient(base_url=base_url).sync()
      self.client.connect()

  def _result(self, obs) -> tuple[str, float, bool]:
    if self.client is not None:  # a StepResult whose observation is a dict
      fields, reward, done = dict(obs.observation or {}), obs.reward, obs.done
    else:
      fields, reward, done = obs.model_dump(), obs.reward, obs.done
    return render(fields, self.observation_field), float(reward or 0.0), bool(done)

  def reset(self, seed: int) -> str:
    if self.client is not None:
      return self._result(self.client.reset(seed=int(seed), **self.reset_kwargs))[0]
    return self._result(self.env.reset(seed=int(seed), **self.reset_kwargs))[0]

  def step(self, action_text: str) -> tuple[str, float, bool]:
    if self.client is not None:
      try:
        return self._result(self.client.step({self.action_field: action_text}))
      except RuntimeError as e:  # the server's rejection of the action, as OpenEnv's client reports it
        if "(code: VALIDATION_ERROR)" in str(e):
          raise InvalidAction(str(e)) from None
        raise
    from pydantic import ValidationError
    try:
      action = self.action_cls(**{self.action_field: action_text})
    except ValidationError as e:
      raise InvalidAction(f"{self.action_cls.__name__}: {e.errors()[0].get('msg', e)}") from None
    return self._result(self.env.step(action))

  def close(self) -> None:
    target = self.client if self.client is not None else self.env
    close = getattr(target, "close", None)
    if close is not None:
      close()
