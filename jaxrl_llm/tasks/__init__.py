"""Verifiable tasks: registry, character tokenizer, rewards, data pipelines.

  task = get_task("arithmetic", num_digits=2)
  ex = task.make_example(np.random.default_rng(0))      # {"prompt": "12+47=", "answer": "59"}
  task.reward(ex["prompt"], ex["answer"], "59")           # 1.0

Importing this package is light (numpy only): TFDS, grain and math-verify are imported by the
modules that need them (``tfds_builders``, ``pipeline``, ``jsonl`` rewards) when first used.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxrl_llm.tasks import arithmetic, countdown, jsonl
from jaxrl_llm.tasks.base import (Task, prompt_ids, score_completions, sft_examples,
                                  split_examples, target_ids)

_FACTORIES: dict[str, Callable[..., Task]] = {
    "arithmetic": arithmetic.make_task,
    "countdown": countdown.make_task,
    "jsonl": jsonl.make_task,
}


def task_names() -> list[str]:
  """Names accepted by ``get_task``."""
  return sorted(_FACTORIES)


def get_task(name: str, **kwargs: Any) -> Task:
  """Builds the task registered as ``name`` with its keyword arguments.

  Raises ValueError naming the valid tasks when ``name`` is unknown.
  """
  if name not in _FACTORIES:
    raise ValueError(f"unknown task {name!r}; valid names: {', '.join(task_names())}")
  return _FACTORIES[name](**kwargs)


__all__ = ["Task", "get_task", "task_names", "sft_examples", "split_examples", "prompt_ids",
           "target_ids", "score_completions"]
