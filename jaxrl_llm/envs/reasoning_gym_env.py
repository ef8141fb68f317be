"""reasoning-gym tasks as a single-turn text environment (`envs.get("reasoning_gym", task="countdown")`).

Needs the `envs` extra (`pip install 'jaxrl_llm[envs]'`); reasoning_gym is imported when a dataset is
first made, so importing this module never needs it.

- `reset(seed)`: item `seed % size` of the dataset `rg.create_dataset(task, size=size, seed=dataset_seed,
  **config)`; returns its question.
- `step(answer_text)` -> `("", score, True)`: one turn. The score is the dataset's own verifier,
  `dataset.score_answer(extracted, item)`, where `extracted` is the text inside the last
  `<answer>...</answer>` of the action (`reasoning_gym.utils.extract_answer`) when there is one, else
  the whole action stripped (a model prompted to answer bare, like the tiny character model, is
  scored on its text). `score` lies in [0, 1] but is not binary: some verifiers give partial credit
  to wrong answers (measured, countdown: 0.05 for a well-formed expression of the wrong value, 0.01
  for a format violation; gsm_symbolic: 0.01 for a wrong number), so a return above 0 does not mean
  solved. A verifier that raises scores 0.

Items come from the per-process dataset cache of `tasks.reasoning_gym_data` (each item made once, shared
with the `reasoning_gym` task); `dataset_items(...)` makes the first n at once (warm-up).
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.envs import register
from jaxrl_llm.tasks.reasoning_gym_data import dataset, dataset_items, score  # noqa: F401  (dataset_items: a warm-up)


@register("reasoning_gym")
class ReasoningGym:
  """A single-turn reasoning-gym task (module docstring).

  Args:
    task: a reasoning-gym dataset name ("basic_arithmetic", "countdown", "gsm_symbolic", ...).
    size: items in the dataset; `reset(seed)` plays item `seed % size`.
    dataset_seed: the dataset's own seed (item i is made from `dataset_seed + i`).
    config: the dataset's config fields, passed to `rg.create_dataset` (e.g. {"min_terms": 2}).
  """

  def __init__(self, task: str = "basic_arithmetic", size: int = 1000, dataset_seed: int = 0,
               config: dict | None = None):
    if size < 1:
      raise ValueError(f"reasoning_gym size={size}: must be >= 1")
    self.task, self.size = task, int(size)
    self.data = dataset(task, size, dataset_seed, config)
    self.item: dict[str, Any] | None = None

  def reset(self, seed: int) -> str:
    self.item = self.data.item(int(seed) % self.size)
    return self.item["question"]

  def step(self, action_text: str) -> tuple[str, float, bool]:
    if self.item is None:
      raise RuntimeError("step before reset (or after the single turn)")
    item, self.item = self.item, None
    return "", score(self.data.ds, item, action_text), True
