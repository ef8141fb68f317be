"""Text environments for multi-turn episodes: a registry and the `Env` interface.

An environment is text only (it imports no models, sampler, rollout or loop; `.importlinter`):

  env = envs.get("guess_number", max_turns=4)
  first = env.reset(seed)              # the first message(s): a str, or a list of message dicts
  obs, reward, done = env.step("7")    # the policy's action text -> (observation, step reward, done)

Messages. `reset(seed)` returns a str (one user message) or a list of `{"role": "system" | "user",
"content": str}` dicts; an observation is a str (one user message) or a list of `{"role": "user" | "tool",
"content": str}` dicts. The runner renders them through the policy's chat template (or as raw text for
base models and the character tokenizer): `tasks.encoder.Encoder.episode_prompt_ids` / `observation_ids`.
`step` may return a fourth element `info`: a dict of this step's counters (numbers; others are ignored),
summed over the batch's steps into the stats as `env_<key>` (e.g. `env_tool_calls`); an optional attribute
`counters` (a tuple of those keys) makes every batch's stats carry each of them, 0 where no step reported it.

Tools. An environment with an attribute `tools` (a list of JSON schemas, `envs.tools.tool_schema`) has them
shown to the policy: passed to a chat template that renders tools, else described in the system message
(`tasks.encoder.hermes_tools_text`). `envs.tools.ToolEnv` runs the Hermes-format calls of an action
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and answers with tool messages;
`gsm8k_calculator` is one (GSM8K with a calculator). `envs.mcp_tools` serves an MCP server's tools to one.

`verifiers_sums` is no environment of this registry: a verifiers taskset, played through the endpoint
(`serve.verifiers_env`, configs/verifiers_tiny.py).

Environments from outside the package need no registration here: `env.name` also takes
`package.module:factory` (a class or function in any importable module), or the name an installed package
gives its factory under the entry-point group `jaxrl_llm.envs` (docs/agents.md shows both).

An episode's return is the sum of its step rewards. `reset(seed)` must be deterministic in the seed:
the G episodes of a GRPO group start from one seed, hence one state. An action the environment cannot
read raises `InvalidAction`: the episode ends with return 0 and is counted ("invalid"), as an
environment that raises anything else ("error"), returns something malformed ("error") or overruns its
time limit ("timeout") is (`jaxrl_llm.rollout.episodes`). One instance plays one episode at a time (the
runner makes one per row); an optional `close()` is called when the runner's batch is formed (release a
simulator process or a server connection there), under the same time limit, on every instance: also on one
whose `reset` / `step` overran its limit and may still be running in its thread, so `close` must tolerate a
call in progress (ScienceWorld's defers the release until the call returns).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Protocol


class InvalidAction(ValueError):
  """Raised by `Env.step` for an action it cannot read (a malformed action)."""


Message = dict  # {"role": str, "content": str}


class Env(Protocol):
  """A text environment (module docstring). Optional attribute `tools: list[dict]` (JSON schemas)."""

  def reset(self, seed: int) -> str | list[Message]:
    ...

  def step(self, action_text: str) -> (tuple[str | list[Message], float, bool]
                                       | tuple[str | list[Message], float, bool, dict]):
    ...


_FACTORIES: dict[str, Callable[..., Env]] = {}
_RESOLVED: dict[str, Callable[..., Env]] = {}  # plug-in names already imported (`_factory`)
# Installed packages register environments under this entry-point group, e.g. in their pyproject.toml:
#   [project.entry-points."jaxrl_llm.envs"]
#   my_env = "my_package.envs:make_env"
ENTRY_POINT_GROUP = "jaxrl_llm.envs"


def register(name: str):
  """Decorator: registers an environment factory (a class or a function returning an `Env`) under `name`."""
  def deco(factory):
    old = _FACTORIES.get(name)
    # The same definition executed again (a config file that defines an environment is loaded twice when a bad flag
    # is reported) replaces itself; another factory under a taken name is an error.
    if old is not None and old is not factory and _origin(old) != _origin(factory):
      raise ValueError(f"environment {name!r} is already registered (by {_origin(old)[1]} in {_origin(old)[0]})")
    _FACTORIES[name] = factory
    return factory
  return deco


def _origin(factory) -> tuple[str, str]:
  """(the file that defines `factory`, its qualified name): equal for one definition executed twice, whatever
  module name it was loaded under (config files are loaded by path under more than one)."""
  fn = factory if inspect.isfunction(factory) else None
  if inspect.isclass(factory):
    fn = next((v for v in vars(factory).values() if inspect.isfunction(v)), None)
  where = fn.__code__.co_filename if fn is not None else getattr(factory, "__module__", "?")
  return where, getattr(factory, "__qualname__", repr(factory))


def _entry_points() -> dict:
  from importlib import metadata  # local: scanned on demand, so a package installed after import is seen
  return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
  """Names accepted by `get` (besides `package.module:factory`): registered ones and installed entry points."""
  return sorted(set(_FACTORIES) | set(_entry_points()))


def _factory(name: str) -> Callable[..., Env]:
  """The factory of environment `name`: a registered name, an installed package's entry point (`ENTRY_POINT_GROUP`),
  or `package.module:factory` (any importable module: on PYTHONPATH, the working directory of `python -m
  jaxrl_llm`, or installed), imported once. A ValueError says what is missing."""
  f = _FACTORIES.get(name) or _RESOLVED.get(name)
  if f is not None:
    return f
  if ":" in name:
    module, _, attr = name.partition(":")
    try:
      mod = importlib.import_module(module)
    except ImportError as e:
      raise ValueError(f"environment {name!r}: cannot import module {module!r} ({type(e).__name__}: {e}); "
                       "it must be importable (on PYTHONPATH, or installed)") from None
    f = getattr(mod, attr, None)
    if not callable(f):
      raise ValueError(f"environment {name!r}: module {module!r} has no callable {attr!r}")
  else:
    ep = _entry_points().get(name)
    if ep is None:
      raise ValueError(f"unknown environment {name!r}; valid names: {', '.join(names())}, or 'package.module:factory'")
    try:
      f = ep.load()
    except Exception as e:  # noqa: BLE001 -- an installed package's code: anything can go wrong in it
      raise ValueError(f"environment {name!r} (entry point {ep.value!r}) does not load: "
                       f"{type(e).__name__}: {e}") from None
  _RESOLVED[name] = f
  return f


def kwarg_names(name: str) -> list[str]:
  """Keyword arguments the environment `name` takes."""
  return list(inspect.signature(_factory(name)).parameters)


def get(name: str, **kwargs: Any) -> Env:
  """A new instance of the environment `name` (`_factory`); an argument it does not take is an error naming it."""
  accepted = kwarg_names(name)
  for k in kwargs:
    if k not in accepted:
      raise ValueError(f"environment {name!r} takes no argument {k!r} (its arguments: {', '.join(accepted) or 'none'})")
  return _factory(name)(**kwargs)


from jaxrl_llm.envs import guess_number  # noqa: E402,F401  (registers the toy environment)
from jaxrl_llm.envs import gsm8k_calculator  # noqa: E402,F401  (registers GSM8K with a calculator tool)
from jaxrl_llm.envs.tools import MalformedToolCall, ToolCall, ToolEnv, parse_tool_calls, tool_schema  # noqa: E402,F401
# Package-backed environments (the `envs` extra): these modules import textarena / reasoning_gym only when an
# instance is made, so they register without the packages and a missing package is an ImportError at `get`.
from jaxrl_llm.envs import reasoning_gym_env, textarena_env  # noqa: E402,F401
from jaxrl_llm.envs import scienceworld_env  # noqa: E402,F401  (ScienceWorld: needs Java too)
from jaxrl_llm.envs import openenv_env  # noqa: E402,F401  (OpenEnv environments: the `openenv` extra)
