"""Multi-digit integer arithmetic: prompt ``"12+47="``, answer ``"59"``, completion answer + EOS.

Operands have exactly ``num_digits`` digits (0..9 when ``num_digits == 1``). ``ops`` is a string
over ``"+-*"``; each example draws one op uniformly, so ``ops="+-"`` mixes addition and
subtraction (answers may then be negative, e.g. ``"12-47="`` → ``"-35"``). The default, 2-digit
addition, is learnable in part by a ~100k-parameter transformer with SFT + RL in minutes on CPU.

``partial_credit=True`` (shaping, for the smallest test configs): a wrong completion scores
``0.5 × (characters equal to the answer's at the same position) / max(len(answer), len(completion))``,
so even a barely trained policy earns varied rewards and a non-zero RL gradient; only an exact
answer scores 1 (accuracy, ``reward >= 1``, is unchanged).
"""

from __future__ import annotations

import functools

import numpy as np

from jaxrl_llm.tasks.base import Task

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# Bound on completion length considered: anything longer is wrong without reading it.
_MAX_COMPLETION_CHARS = 1024


def make_example(rng: np.random.Generator, *, num_digits: int, ops: str) -> dict[str, str]:
  """Draws one example: two ``num_digits``-digit operands and an op from ``ops``."""
  lo = 0 if num_digits == 1 else 10 ** (num_digits - 1)
  a, b = (int(x) for x in rng.integers(lo, 10 ** num_digits, size=2))
  op = ops[int(rng.integers(len(ops)))]
  return {"prompt": f"{a}{op}{b}=", "answer": str(_APPLY[op](a, b))}


def reward(prompt: str, answer: str, completion: str) -> float:
  """1.0 if the completion (whitespace-stripped, text before EOS) equals ``answer``, else 0.0.

  The match is exact over ASCII: ``" 59 "`` scores 1, ``"059"``, ``"59.0"`` and fullwidth
  ``"５９"`` score 0. Non-string or oversized input scores 0; never raises.
  """
  del prompt  # the answer already determines the reward
  if not isinstance(completion, str) or not isinstance(answer, str):
    return 0.0
  if len(completion) > _MAX_COMPLETION_CHARS:
    return 0.0
  return 1.0 if completion.strip() == answer else 0.0


def partial_reward(prompt: str, answer: str, completion: str) -> float:
  """``reward``, but a wrong completion earns 0.5 × its fraction of answer characters in place (< 0.5)."""
  full = reward(prompt, answer, completion)
  if full == 1.0 or not isinstance(completion, str) or not isinstance(answer, str):
    return full
  got = completion.strip()[:_MAX_COMPLETION_CHARS]
  same = sum(1 for a, b in zip(answer, got) if a == b)
  return 0.5 * same / max(len(answer), len(got), 1)


def make_task(num_digits: int = 2, ops: str = "+", partial_credit: bool = False) -> Task:
  """The arithmetic task with ``num_digits``-digit operands and operators from ``ops``."""
  if not isinstance(num_digits, int) or not 1 <= num_digits <= 9:
    raise ValueError(f"num_digits must be an int in [1, 9], got {num_digits!r}")
  if not ops or set(ops) - set(_APPLY):
    raise ValueError(f"ops must be a non-empty string over {''.join(_APPLY)!r}, got {ops!r}")
  # Longest answer: a carry digit for "+", a sign for "-", twice the digits for "*".
  answer_len = max({"+": num_digits + 1, "-": num_digits + 1, "*": 2 * num_digits}[op]
                   for op in ops)
  return Task(
      name="arithmetic",
      make_example=functools.partial(make_example, num_digits=num_digits, ops=ops),
      reward=partial_reward if partial_credit else reward,
      max_prompt_len=2 * num_digits + 2,
      max_answer_len=answer_len,
      kwargs=(("num_digits", num_digits), ("ops", ops)) + ((("partial_credit", True),) if partial_credit else ()),
  )
