"""reasoning-gym datasets, made once per process and shared: the `reasoning_gym` task and environment read them.

Needs the `envs` extra (`pip install 'jaxrl_llm[envs]'`); reasoning_gym is imported when a dataset is first
made. Items are generated on first use and kept in a module-level cache keyed by (task, size, dataset_seed,
config): reasoning-gym's generators make item i from `Random(dataset_seed + i)` only, so an item does not
depend on which others were made, and search-based generators are slow (countdown ~8 items/s, sudoku ~13/s on
a loaded 2-core CPU), so each item is made once per process. `dataset_items(...)` makes the first n at once.
`score` is the dataset's own verifier on the `<answer>` of a text (else the whole text).
"""

from __future__ import annotations

import json
import threading
from typing import Any

_CACHE: dict[tuple, "_Dataset"] = {}
_CACHE_LOCK = threading.Lock()


def import_reasoning_gym():
  """The reasoning_gym module, or an ImportError that names the extra to install."""
  try:
    import reasoning_gym
  except ImportError as e:
    raise ImportError("the reasoning_gym task and environment need reasoning-gym: pip install 'jaxrl_llm[envs]'") from e
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
