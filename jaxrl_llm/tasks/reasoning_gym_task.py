"""reasoning-gym datasets as a single-turn task (`get_task("reasoning_gym", rg_task="gsm_symbolic")`).

Needs the `envs` extra. The task's rows are the `size` items of `rg.create_dataset(rg_task, size=size,
seed=dataset_seed, **json.loads(rg_config))`, made once per process (the dataset cache of
`tasks.reasoning_gym_data`): prompt = the item's question, answer = its reference answer (for SFT).
Splits hold rows out, as for a data file (`Task.rows`).

Reward: the dataset's own verifier (`tasks.reasoning_gym_data.score`) on the completion's `<answer>...</answer>`
when it has one, else on the whole completion, for the item whose question is the prompt (the first
such item when two items ask the same question; 0 for a prompt that is no question of the dataset).
Partial credit: some verifiers score wrong answers above 0 (countdown 0.05 / 0.01), so the reward is
in [0, 1], not binary. Questions use upper case and newlines: a run needs a real tokenizer (the
character tokenizer maps them to unk). Slow generators (countdown ~8 items/s) make large sizes
slow to build: size 1000 of countdown is ~2 minutes.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from jaxrl_llm.tasks import reasoning_gym_data as rgd
from jaxrl_llm.tasks.base import Task, TaskError


def _sample(rng: np.random.Generator, *, rows: tuple[tuple[str, str], ...]) -> dict[str, str]:
  prompt, answer = rows[int(rng.integers(len(rows)))]
  return {"prompt": prompt, "answer": answer}


def _reward(prompt: str, answer: str, completion: str, *, data, by_question: dict) -> float:
  """The verifier's score of `completion` for the item asking `prompt` (module docstring); never raises."""
  del answer  # the verifier accepts any valid answer, not only the reference
  item = by_question.get(prompt) if isinstance(prompt, str) else None
  if item is None or not isinstance(completion, str):
    return 0.0
  return min(1.0, max(0.0, rgd.score(data.ds, item, completion)))


def make_task(rg_task: str, size: int = 1000, dataset_seed: int = 0, rg_config: str = "",
              timeout_s: float = 5.0) -> Task:
  """The task over reasoning-gym dataset `rg_task` (module docstring); `rg_config` is the dataset's
  config as a JSON object ("" = its defaults)."""
  try:
    config = json.loads(rg_config) if rg_config else {}
  except json.JSONDecodeError as e:
    raise TaskError(f"rg_config={rg_config!r} is not JSON ({e})", "rg_config") from e
  if not isinstance(config, dict):
    raise TaskError(f"rg_config={rg_config!r} must be a JSON object", "rg_config")
  if isinstance(size, bool) or not isinstance(size, int) or size < 2:
    raise TaskError(f"size={size!r} must be an int >= 2 (a split holds rows out)", "size")
  try:
    data = rgd.dataset(rg_task, size, dataset_seed, config)
  except ValueError as e:
    raise TaskError(str(e), "rg_config" if "config" in str(e) else "rg_task") from e
  items = rgd.dataset_items(rg_task, size, dataset_seed, config)
  by_question: dict = {}
  for it in items:
    by_question.setdefault(it["question"], it)
  rows = tuple((it["question"], str(it["answer"])) for it in items)
  kwargs = dict(rg_task=rg_task, size=size, dataset_seed=dataset_seed, rg_config=rg_config, timeout_s=float(timeout_s))
  return Task(
      name="reasoning_gym",
      make_example=functools.partial(_sample, rows=rows),
      reward=functools.partial(_reward, data=data, by_question=by_question),
      max_prompt_len=max(len(p) for p, _ in rows),
      max_answer_len=max(len(a) for _, a in rows),
      kwargs=tuple(sorted(kwargs.items())),
      rows=rows,
      reward_executor="thread",  # the verifiers are Python; the dataset is not sent to worker processes
      reward_timeout_s=float(timeout_s),
  )
