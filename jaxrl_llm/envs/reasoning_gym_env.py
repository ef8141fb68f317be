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

Items are generated on first use and kept in a module-level cache keyed by (task, size,
dataset_seed, config), shared by every instance in the process: reasoning-gym's generators make
item i from `Random(dataset_seed + i)` only, so an item does not depend on which others were made,
and search-based generators are slow (countdown ~8 items/s, sudoku ~13/s on a loaded 2-core CPU),
so each item is made once per process. `dataset_items(...)` makes the first n at once (warm-up).
"""

from __future__ import annotations

import json
import threading
from typing import Any

from jaxrl_llm.envs import register

_CACHE: dict[tuple, "_Dataset"] = {}
_CACHE_LOCK = threading.Lock()


def import_reasoning_gym():
  """The reasoning_gym module, or an ImportError that names the extra to install."""
  try:
    import reasoning_gym
  except ImportError as e:
    raise ImportError("the 'reasoning_gym' environment needs reasoning-gym: pip install 'jaxrl_llm[envs]'") from e
  return reasoning_gym


class _Dataset:
  """One reasoning-gym dataset and the items made from it so far (index -> item dict)."""

  def __init__(self, ds):
    self.ds = ds
    self.items: dict[int, dict[str, Any]] = {}
    self.lock = threading.Lock()

  def item(self, i: int) -> dict[str, Any]:
    with self.lock:
      if i not in self.items:
        self.items[i] = self.ds[i]
      return self.items[i]


def plain_config(config: Any) -> dict:
  """`config` as a plain dict (None -> {}; a ConfigDict from a run config -> its dict)."""
  if config is None:
    return {}
  return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def cache_key(task: str, size: int, dataset_seed: int, config: dict | None) -> tuple:
  """The cache key of a dataset: its arguments, with `config` as canonical JSON."""
  return task, int(size), int(dataset_seed), json.dumps(plain_config(config), sort_keys=True, default=repr)


def dataset(task: str, size: int, dataset_seed: int = 0, config: dict | None = None) -> _Dataset:
  """The cached dataset for these arguments, made on first call; a bad task or config is a ValueError
  naming it."""
  key = cache_key(task, size, dataset_seed, config)
  with _CACHE_LOCK:
    if key not in _CACHE:
      rg = import_reasoning_gym()
      if task not in rg.factory.DATASETS:
        raise ValueError(f"reasoning_gym task={task!r} is not a reasoning-gym dataset "
                         f"(e.g. basic_arithmetic, countdown, gsm_symbolic)")
      try:
        ds = rg.create_dataset(task, size=int(size), seed=int(dataset_seed), **plain_config(config))
      except (TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"reasoning_gym task={task!r}: bad config {plain_config(config)!r} "
                         f"({type(e).__name__}: {e})") from e
      _CACHE[key] = _Dataset(ds)
    return _CACHE[key]


def dataset_items(task: str, size: int, dataset_seed: int = 0, config: dict | None = None,
                  n: int | None = None) -> list[dict[str, Any]]:
  """Items 0..n-1 (default: all `size`) of the cached dataset, made now where not made yet."""
  d = dataset(task, size, dataset_seed, config)
  return [d.item(i) for i in range(size if n is None else n)]


def score(ds, item: dict[str, Any], text: str) -> float:
  """The dataset's verifier on `text` (the `<answer>` inside it if any, else all of it, stripped);
  0.0 when the verifier raises."""
  from reasoning_gym.utils import extract_answer
  extracted = extract_answer(text)
  try:
    return float(ds.score_answer(extracted if extracted is not None else text.strip(), item))
  except Exception:  # a verifier bug on odd text scores 0, like a wrong answer
    return 0.0


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
