"""The Task interface, deterministic train/test split generation, and SFT examples.

A task is a frozen tuple of plain functions and sizes; nothing in it holds state:

  make_example(rng: np.random.Generator) -> {"prompt": str, "answer": str}
  reward(prompt: str, answer: str, completion: str) -> float in [0, 1], never raises

``answer`` is the reference completion (for countdown: one valid expression), without EOS.
Splits are generated from ``(seed, split)``: the test split is ``num_test`` distinct prompts, and
the train split draws examples (repeats allowed: small tasks have few distinct prompts) skipping
every test prompt, so train and test are disjoint by construction.

A task over a data file (``rows`` set) splits its rows instead: a seeded permutation holds out
``num_test`` rows, and the train split is every other row whose prompt is not held out, in file
order (``num_train`` does not apply). ``num_held_out`` resolves the ``task.held_out`` config field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_llm.tasks import tokenizer as tok

SPLIT_CODES = {"train": 0, "test": 1}
# Held-out rows of a data-file task when ``task.held_out`` is 0 (auto): 10%, at least 1, at most this.
AUTO_HELD_OUT_MAX = 500
# Held-out prompts of a generated task when ``task.held_out`` is 0 (auto).
GENERATED_HELD_OUT = 500
# Generation gives up after this many draws per requested example (a too-small prompt space).
_MAX_DRAWS_PER_EXAMPLE = 200


@dataclasses.dataclass(frozen=True)
class Task:
  """A verifiable task.

  Attributes:
    name: registry name.
    make_example: ``rng -> {"prompt": str, "answer": str}``; deterministic given the rng state.
    reward: ``(prompt, answer, completion) -> float`` in [0, 1]; accepts any string, never raises.
    max_prompt_len: upper bound on ``len(prompt)`` in characters (= char tokens, without BOS).
    max_answer_len: upper bound on ``len(answer)`` in characters (without EOS).
    kwargs: the keyword arguments the task was made with, as sorted ``(key, value)`` pairs; they
      identify the data distribution (TFDS config names hash them).
    rows: for a task over a data file, its examples as ``(prompt, answer)`` pairs in file order
      (splits hold rows out instead of generating prompts); None for generated tasks.
    reward_executor: where ``reward.executor="auto"`` runs the reward: ``"thread"`` for rewards that
      are a few string operations, ``"process"`` (killable workers) for rewards that may run unbounded
      inside C code, such as sympy evaluating ``10^{10^{10^{10}}}``.
    reward_timeout_s: the task's own time limit per reward call (e.g. ``task.kwargs.timeout_s``) or
      None; a run enforces one limit per call, the smaller of this and ``reward.timeout_s``.
  """
  name: str
  make_example: Callable[[np.random.Generator], dict[str, str]]
  reward: Callable[[str, str, str], float]
  max_prompt_len: int
  max_answer_len: int
  kwargs: tuple[tuple[str, Any], ...] = ()
  rows: tuple[tuple[str, str], ...] | None = dataclasses.field(default=None, compare=False,
                                                                repr=False)
  reward_executor: str = "thread"
  reward_timeout_s: float | None = None


def num_held_out(task: Task, held_out: float = 0, num_train: int = 5000) -> int:
  """Size of the test split from the ``task.held_out`` config field.

  ``held_out`` >= 1 is a count; in (0, 1) a fraction of the data file's rows (of ``num_train`` for
  generated tasks); 0 is automatic: 10% of a file's rows (at least 1, at most
  ``AUTO_HELD_OUT_MAX``), or ``GENERATED_HELD_OUT`` prompts for generated tasks. Raises ValueError
  when the value is not one of these or leaves a data file without training rows.
  """
  if isinstance(held_out, bool) or not isinstance(held_out, (int, float)) or not (
      held_out == 0 or 0 < held_out < 1 or (held_out >= 1 and float(held_out).is_integer())):
    raise ValueError(f"held_out={held_out!r} must be 0 (auto), a fraction in (0, 1) or a whole count >= 1")
  pool = num_train if task.rows is None else len(task.rows)
  if held_out == 0:
    count = (GENERATED_HELD_OUT if task.rows is None
             else min(AUTO_HELD_OUT_MAX, max(1, math.ceil(0.1 * pool))))
  elif held_out < 1:
    count = max(1, round(held_out * pool))
  else:
    count = int(held_out)
  if task.rows is not None and count >= pool:
    raise ValueError(f"held_out={held_out!r} holds out {count} of the {pool} rows of task "
                     f"{task.name!r}, leaving none to train on")
  return count


def _row_split(task: Task, split: str, seed: int, num_test: int) -> list[dict[str, str]]:
  n = len(task.rows)
  if not 1 <= num_test < n:
    raise ValueError(f"task {task.name!r}: a test split of {num_test} rows needs at least "
                     f"{num_test + 1} rows, the data has {n}")
  perm = np.random.default_rng([int(seed), 2]).permutation(n)
  test_idx = sorted(int(i) for i in perm[:num_test])
  if split == "test":
    idx = test_idx
  else:
    held = {task.rows[i][0] for i in test_idx}
    idx = sorted(int(i) for i in perm[num_test:] if task.rows[int(i)][0] not in held)
    if not idx:
      raise ValueError(f"task {task.name!r}: every training row repeats a held-out prompt")
  return [{"prompt": task.rows[i][0], "answer": task.rows[i][1]} for i in idx]


class TaskError(ValueError):
  """Bad task arguments or data file; ``kwarg`` names the task argument at fault (e.g. ``"path"``)."""

  def __init__(self, message: str, kwarg: str | None = None):
    super().__init__(message)
    self.kwarg = kwarg


def _rng(seed: int, split: str) -> np.random.Generator:
  if split not in SPLIT_CODES:
    raise ValueError(f"unknown split {split!r}; valid splits: {sorted(SPLIT_CODES)}")
  return np.random.default_rng([int(seed), SPLIT_CODES[split]])


def _test_examples(task: Task, num_test: int, seed: int) -> list[dict[str, str]]:
  rng = _rng(seed, "test")
  seen, out = set(), []
  for _ in range(_MAX_DRAWS_PER_EXAMPLE * max(num_test, 1)):
    if len(out) == num_test:
      break
    ex = task.make_example(rng)
    if ex["prompt"] not in seen:
      seen.add(ex["prompt"])
      out.append(ex)
  if len(out) < num_test:
    raise ValueError(f"task {task.name!r} has fewer than {num_test} distinct prompts")
  return out


def _train_examples(task: Task, num_train: int, seed: int,
                    excluded: set[str]) -> list[dict[str, str]]:
  rng = _rng(seed, "train")
  out = []
  for _ in range(_MAX_DRAWS_PER_EXAMPLE * max(num_train, 1)):
    if len(out) == num_train:
      break
    ex = task.make_example(rng)
    if ex["prompt"] not in excluded:
      out.append(ex)
  if len(out) < num_train:
    raise ValueError(f"task {task.name!r}: the test split covers (almost) every prompt")
  return out


def split_examples(task: Task, split: str, *, seed: int = 0, num_train: int = 5000,
                   num_test: int = 500) -> list[dict[str, Any]]:
  """Generates one split deterministically from ``(task.kwargs, seed, num_test)``.

  Returns dicts ``{"prompt": str, "answer": str, "example_id": int}`` with ``example_id`` the index
  in the split. The train split excludes the prompts of the ``num_test``-example test split, so
  use the same ``num_test`` for both splits. A data-file task (``task.rows``) holds out
  ``num_test`` rows and trains on all the others (``num_train`` is ignored).
  """
  _rng(seed, split)  # validates the split name before any work
  if task.rows is not None:
    examples = _row_split(task, split, seed, num_test)
    return [dict(prompt=ex["prompt"], answer=ex["answer"], example_id=i)
            for i, ex in enumerate(examples)]
  test = _test_examples(task, num_test, seed)
  if split == "test":
    examples = test
  else:
    examples = _train_examples(task, num_train, seed, {ex["prompt"] for ex in test})
  return [dict(prompt=ex["prompt"], answer=ex["answer"], example_id=i)
          for i, ex in enumerate(examples)]


def prompt_ids(prompt: str) -> list[int]:
  """Char-tokenizer ids of a prompt: BOS then one id per character (a run encodes through its
  ``tasks.encoder.Encoder``, whose default is exactly this)."""
  return tok.encode(prompt, add_bos=True)


def target_ids(answer: str) -> list[int]:
  """Char-tokenizer ids of a reference completion: the answer then EOS (``Encoder.target_ids``)."""
  return tok.encode(answer, add_eos=True)


def score_completions(task: Task, prompts: Sequence[str | bytes], answers: Sequence[str | bytes],
                      completion_ids_BN: np.ndarray, tokenizer: tok.Tokenizer = tok.CHAR_TOKENIZER) -> np.ndarray:
  """``reward_B`` float32 for sampled completion ids ``[B, N]``.

  Each row is decoded up to its first stop id (``tokenizer.stop_ids``; special tokens dropped) and
  scored by ``task.reward``; prompts and answers may be the ``bytes`` fields of a pipeline batch.
  """
  text = lambda s: s.decode() if isinstance(s, bytes) else s
  return np.asarray([task.reward(text(p), text(a), tok.completion_text(tokenizer, ids))
                     for p, a, ids in zip(prompts, answers, np.asarray(completion_ids_BN))],
                    dtype=np.float32)


def sft_examples(task: Task, n: int, seed: int = 0,
                 num_test: int = 500) -> list[tuple[list[int], list[int]]]:
  """``n`` SFT pairs ``(prompt_tokens, target_tokens)`` from the train split (no test prompts).

  ``prompt_tokens`` is BOS + prompt characters; ``target_tokens`` is the reference answer + EOS,
  i.e. exactly the completion that earns reward 1. A data-file task cycles through its train rows.
  """
  examples = split_examples(task, "train", seed=seed, num_train=n, num_test=num_test)
  examples = [examples[i % len(examples)] for i in range(n)]
  return [(prompt_ids(ex["prompt"]), target_ids(ex["answer"])) for ex in examples]
