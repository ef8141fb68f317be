"""Countdown: reach a target with ``+ - *`` over given numbers, each used at most once.

Prompt ``"countdown 3 5 7 -> 22:"``; a correct completion is e.g. ``"3*5+7"``. Instances are
solvable by construction: the target is the value of a random expression tree over all the
numbers, and that expression (with minimal parentheses) is the reference answer used for SFT.

Reward (``expr.parse_expression``, never ``eval``):
  1.0            the completion is a well-formed expression, uses only the given numbers, each at
                 most as often as it appears, and evaluates to the target;
  format_reward  well-formed and uses only allowed numbers, but the value is wrong (default 0.0,
                 i.e. binary reward; e.g. 0.1 gives a partial-format reward);
  0.0            anything else (malformed, other numbers, division, unicode, too long, ...).
"""

from __future__ import annotations

import collections
import functools
import re

import numpy as np

from jaxrl_llm.tasks import expr
from jaxrl_llm.tasks.base import Task

_PROMPT_RE = re.compile(r"countdown ((?:[0-9]{1,6} )+)-> ([0-9]{1,9}):")
_PREC = {"+": 1, "-": 1, "*": 2}
_NUMBER_PREC = 3
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_MAX_ATTEMPTS = 1000


def _combine(left, right, op):
  """Joins two ``(value, text, precedence)`` nodes, adding only the parentheses needed."""
  lv, lt, lp = left
  rv, rt, rp = right
  p = _PREC[op]
  if lp < p:
    lt = f"({lt})"
  # Right operand of "-" needs parentheses at equal precedence: a-(b+c) != a-b+c.
  if rp < p or (rp == p and op == "-"):
    rt = f"({rt})"
  return _APPLY[op](lv, rv), f"{lt}{op}{rt}", p


def make_example(rng: np.random.Generator, *, min_count: int, max_count: int, max_number: int,
                 max_target: int, ops: str) -> dict[str, str]:
  """Draws numbers and a random expression over all of them; its value (in [1, max_target]) is
  the target and its text the reference answer."""
  for _ in range(_MAX_ATTEMPTS):
    count = int(rng.integers(min_count, max_count + 1))
    numbers = [int(x) for x in rng.integers(1, max_number + 1, size=count)]
    nodes = [(n, str(n), _NUMBER_PREC) for n in (numbers[i] for i in rng.permutation(count))]
    # Combining random adjacent pairs gives random tree shapes over a random number order.
    while len(nodes) > 1:
      i = int(rng.integers(len(nodes) - 1))
      op = ops[int(rng.integers(len(ops)))]
      nodes[i:i + 2] = [_combine(nodes[i], nodes[i + 1], op)]
    value, text, _ = nodes[0]
    if 1 <= value <= max_target:
      return {"prompt": f"countdown {' '.join(map(str, numbers))} -> {value}:", "answer": text}
  raise ValueError("could not draw a countdown instance with a target in [1, max_target]")


def parse_prompt(prompt: str) -> tuple[tuple[int, ...], int] | None:
  """``(numbers, target)`` from a countdown prompt, or None when it is not one."""
  if not isinstance(prompt, str) or len(prompt) > 256:
    return None
  m = _PROMPT_RE.fullmatch(prompt)
  if m is None:
    return None
  return tuple(int(x) for x in m.group(1).split()), int(m.group(2))


def reward(prompt: str, answer: str, completion: str, *, format_reward: float = 0.0) -> float:
  """Countdown reward (see the module docstring); accepts any input and never raises."""
  del answer  # any valid expression counts, not only the reference
  instance = parse_prompt(prompt)
  if instance is None or not isinstance(completion, str) or len(completion) > 256:
    return 0.0
  parsed = expr.parse_expression(completion.strip())
  if parsed is None:
    return 0.0
  numbers, target = instance
  value, literals = parsed
  if collections.Counter(literals) - collections.Counter(numbers):
    return 0.0
  return 1.0 if value == target else float(format_reward)


def make_task(min_count: int = 3, max_count: int = 4, max_number: int = 9,
              max_target: int = 999, ops: str = "+-*", format_reward: float = 0.0) -> Task:
  """The countdown task: ``min_count..max_count`` numbers in ``1..max_number``."""
  if not 2 <= min_count <= max_count <= 6:
    raise ValueError(f"need 2 <= min_count <= max_count <= 6, got {min_count}, {max_count}")
  if not 1 <= max_number <= 999 or not 1 <= max_target <= 10**6:
    raise ValueError("max_number must be in [1, 999] and max_target in [1, 1e6]")
  if not ops or set(ops) - set(_APPLY) or "+" not in ops:
    # "+" guarantees positive targets exist, so generation always terminates.
    raise ValueError(f"ops must be a string over '+-*' containing '+', got {ops!r}")
  if not 0.0 <= format_reward <= 1.0:
    raise ValueError(f"format_reward must be in [0, 1], got {format_reward}")
  digits = len(str(max_number))
  return Task(
      name="countdown",
      make_example=functools.partial(make_example, min_count=min_count, max_count=max_count,
                                     max_number=max_number, max_target=max_target, ops=ops),
      reward=functools.partial(reward, format_reward=format_reward),
      max_prompt_len=len("countdown  -> :") + max_count * (digits + 1) + len(str(max_target)),
      # numbers + operators + at most one parenthesis pair per operator.
      max_answer_len=max_count * digits + (max_count - 1) * 3,
      kwargs=(("format_reward", format_reward), ("max_count", max_count),
              ("max_number", max_number), ("max_target", max_target), ("min_count", min_count),
              ("ops", ops)),
  )
