"""Verifiable tasks: registry, character tokenizer, rewards, data pipelines.

  task = get_task("arithmetic", num_digits=2)
  ex = task.make_example(np.random.default_rng(0))      # {"prompt": "12+47=", "answer": "59"}
  task.reward(ex["prompt"], ex["answer"], "59")           # 1.0

Data-file tasks (``jsonl``, ``gsm8k``, ``math``, ``dapo``; see ``math_data``) read a JSONL or
parquet file given as ``path=``. A keyword argument set to None means "the task's default", so one
config section (``config.task.kwargs``, every task's arguments as typed placeholders, see
``kwargs_config``) serves every task; an argument the task does not take is an error naming it.

Importing this package is light (numpy only): TFDS, grain, pyarrow and math-verify are imported by
the modules that need them (``tfds_builders``, ``pipeline``, parquet files, rewards) when first used.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable

from jaxrl_llm.tasks import arithmetic, countdown, jsonl, math_data, reasoning_gym_task
from jaxrl_llm.tasks.base import (Task, TaskError, num_held_out, prompt_ids, score_completions,
                                  sft_examples, split_examples, target_ids)

_FACTORIES: dict[str, Callable[..., Task]] = {
    "arithmetic": arithmetic.make_task,
    "arithmetic_chat": arithmetic.make_chat_task,
    "countdown": countdown.make_task,
    "jsonl": jsonl.make_task,
    "gsm8k": math_data.make_gsm8k_task,
    "math": math_data.make_math_task,
    "dapo": math_data.make_dapo_task,
    "reasoning_gym": reasoning_gym_task.make_task,  # the `envs` extra
}


def task_names() -> list[str]:
  """Names accepted by ``get_task``."""
  return sorted(_FACTORIES)


def task_kwarg_names(name: str) -> list[str]:
  """Keyword arguments the task ``name`` takes."""
  if name not in _FACTORIES:
    raise ValueError(f"unknown task {name!r}; valid names: {', '.join(task_names())}")
  return list(inspect.signature(_FACTORIES[name]).parameters)


def resolve_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
  """The arguments ``get_task`` passes: None values (= the task's default) dropped.

  Raises TaskError (``kwarg`` set) for an argument the task does not take, and for a required
  argument left unset.
  """
  accepted = task_kwarg_names(name)
  out = {k: v for k, v in kwargs.items() if v is not None}
  for k in out:
    if k not in accepted:
      raise TaskError(f"task {name!r} takes no argument {k!r} (its arguments: {', '.join(accepted)})", k)
  for k, p in inspect.signature(_FACTORIES[name]).parameters.items():
    if p.default is inspect.Parameter.empty and k not in out:
      raise TaskError(f"task {name!r} needs the argument {k!r}", k)
  return out


def config_task_kwargs(name: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """Splits a config's ``task.kwargs`` for task ``name``: (the set arguments it takes, the set ones
  only other tasks take).

  A config carries every task's arguments, so switching ``task.name`` on the command line leaves the
  config file's settings for its own task behind (``configs/tiny.py``'s arithmetic shaping under
  ``--config.task.name=jsonl``); those are set aside, not errors. A name that no task takes stays in
  the first dict, so ``get_task`` still refuses it.
  """
  accepted, known = set(task_kwarg_names(name)), set(kwarg_types())
  given = {k: v for k, v in kwargs.items() if v is not None}
  foreign = {k: v for k, v in given.items() if k not in accepted and k in known}
  return {k: v for k, v in given.items() if k not in foreign}, foreign


def get_task(name: str, **kwargs: Any) -> Task:
  """Builds the task registered as ``name`` with its keyword arguments (None = the default).

  Raises ValueError naming the valid tasks when ``name`` is unknown, and TaskError (a ValueError)
  for an argument the task does not take, a bad value, or a bad data file.
  """
  resolved = resolve_kwargs(name, kwargs)  # first: it names the valid tasks for an unknown name
  return _FACTORIES[name](**resolved)


@functools.lru_cache(maxsize=1)
def kwarg_types() -> dict[str, type]:
  """Type of every task argument across the registry (from defaults, else annotations).

  An argument name shared by several tasks has one type (checked), so one config field serves all.
  """
  types: dict[str, type] = {}
  for name, fn in _FACTORIES.items():
    hints = typing.get_type_hints(fn)
    for k, p in inspect.signature(fn).parameters.items():
      t = type(p.default) if p.default is not inspect.Parameter.empty else hints[k]
      if types.setdefault(k, t) is not t:
        raise TypeError(f"task argument {k!r} is {types[k].__name__} in one task and "
                        f"{t.__name__} in {name!r}")
  return types


def kwargs_config():
  """``config.task.kwargs``: every task argument as a typed None placeholder (= the task default).

  Set the ones the chosen task takes (``--config.task.kwargs.path=...``); a set argument the task
  does not take is an error naming it.
  """
  import ml_collections  # local: importing the package stays light
  return ml_collections.ConfigDict({k: ml_collections.config_dict.placeholder(t)
                                    for k, t in sorted(kwarg_types().items())})


__all__ = ["Task", "TaskError", "get_task", "task_names", "task_kwarg_names", "resolve_kwargs", "config_task_kwargs",
           "kwarg_types", "kwargs_config", "num_held_out", "sft_examples", "split_examples",
           "prompt_ids", "target_ids", "score_completions"]
