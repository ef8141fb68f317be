"""The Task interface, deterministic train/test split generation, and SFT examples.

A task is a frozen tuple of plain functions and sizes; nothing in it holds state:

  make_example(rng: np.random.Generator) -> {"prompt": str, "answer": str}
  reward(prompt: str, answer: str, completion: str) -> float in [0, 1], never raises

``answer`` is the reference completion (for countdown: one valid expression), without EOS.
Splits are generated from ``(seed, split)``: the test split is ``num_test`` distinct prompts, and
the train split draws examples (repeats allowed: small tasks have few distinct prompts) skipping
every test prompt, so train and test are disjoint by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_llm.tasks import tokenizer as tok

SPLIT_CODES = {"train": 0, "test": 1}
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
  """
  name: str
  make_example: Callable[[np.random.Generator], dict[str, str]]
  reward: Callable[[str, str, str], float]
  max_prompt_len: int
  max_answer_len: int
  kwargs: tuple[tuple[str, Any], ...] = ()


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
  use the same ``num_test`` for both splits.
  """
  _rng(seed, split)  # validates the split name before any work
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
  i.e. exactly the completion that earns reward 1.
  """
  examples = split_examples(task, "train", seed=seed, num_train=n, num_test=num_test)
  return [(prompt_ids(ex["prompt"]), target_ids(ex["answer"])) for ex in examples]
