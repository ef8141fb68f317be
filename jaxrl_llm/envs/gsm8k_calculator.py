"""GSM8K with a calculator tool: the policy may call `calculator` before it answers (a `ToolEnv`).

`reset(seed)` picks a problem of the file `path` (GSM8K layout: `question`, `answer` ending in `#### N`;
default the 50-problem sample shipped in `envs/data/`, MIT licence, see its README) from the seed and asks
it with `instruction`. Each turn the policy either calls the calculator (Hermes `<tool_call>` blocks; the
result comes back as a tool message) or answers; the answer is scored by the math checker
(`tasks.math_answer`: its final answer, e.g. after "####", equal to the reference). At most
`max_tool_calls` calls per episode.

`calculator(expression)` evaluates numbers (decimals allowed), + - * /, unary minus and parentheses
exactly (fractions), with a recursive-descent parser bounded in length, depth and digits: the policy's text is never
`eval`ed. `heldout` > 0: the file's last `heldout` problems are played only by the held-out evaluation's seeds (>=
2**31, in order: evaluation episode i plays problem i mod `heldout`), the others only by training seeds, so an
evaluation measures problems the policy never trained on. `sandbox` (True, or `envs.sandbox.Limits` fields, e.g.
`env.kwargs.sandbox={"cpu_s": 2}`) runs each call in a limited process of its own (`envs.sandbox`); the parser's own
bounds make that a demonstration here.
"""

from __future__ import annotations

import fractions
import os
import pathlib
import re
from typing import Any

import numpy as np

from jaxrl_llm.envs import register
from jaxrl_llm.envs.tools import ToolEnv
from jaxrl_llm.tasks import math_answer
from jaxrl_llm.tasks.math_data import load_rows

DEFAULT_PATH = pathlib.Path(__file__).with_name("data") / "gsm8k_sample.jsonl"
# The held-out evaluation's seeds start here (`episode_eval.EVAL_SEED_BASE`; training and demonstration seeds lie
# below): with `heldout` > 0 they play the file's last problems, which no training seed draws.
HELDOUT_SEED_BASE = 2**31
INSTRUCTION = ("Use the calculator tool for arithmetic. When you know the answer, reply without a tool call and "
               "end with the final answer after \"####\".")
MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 16
MAX_NUMBER_CHARS = 15
_TOKEN_RE = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(.))")


def _tokens(expression: str) -> list[str]:
  out = []
  for number, other in _TOKEN_RE.findall(expression):
    if number:
      if len(number) > MAX_NUMBER_CHARS:
        raise ValueError(f"number too long: {number[:20]}...")
      out.append(number)
    elif other.strip():
      if other not in "+-*/()":
        raise ValueError(f"unsupported character {other!r} (numbers, + - * / and parentheses only)")
      out.append(other)
  return out


def evaluate(expression: str) -> fractions.Fraction:
  """The exact value of an arithmetic expression (module docstring); ValueError saying what is wrong."""
  if not isinstance(expression, str) or not expression.strip():
    raise ValueError("empty expression")
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  toks = _tokens(expression.replace(",", ""))  # "1,234" is a number (thousands separators go)
  pos = 0

  def peek():
    return toks[pos] if pos < len(toks) else None

  def take():
    nonlocal pos
    pos += 1
    return toks[pos - 1]

  def expr(depth):
    value = term(depth)
    while peek() in ("+", "-"):
      value = value + term(depth) if take() == "+" else value - term(depth)
    return value

  def term(depth):
    value = factor(depth)
    while peek() in ("*", "/"):
      op, rhs = take(), factor(depth)
      if op == "/" and rhs == 0:
        raise ValueError("division by zero")
      value = value * rhs if op == "*" else value / rhs
    return value

  def factor(depth):
    if depth > MAX_DEPTH:
      raise ValueError(f"nested deeper than {MAX_DEPTH}")
    t = peek()
    if t is None:
      raise ValueError("unexpected end of expression")
    take()
    if t == "-":
      return -factor(depth + 1)
    if t == "(":
      value = expr(depth + 1)
      if peek() != ")":
        raise ValueError("missing )")
      take()
      return value
    if t[0].isdigit() or t[0] == ".":
      return fractions.Fraction(t)
    raise ValueError(f"unexpected {t!r}")

  value = expr(0)
  if pos != len(toks):
    raise ValueError(f"unexpected {toks[pos]!r}")
  return value


def format_number(value: fractions.Fraction) -> str:
  """An integer as is; otherwise a decimal with at most 6 places, trailing zeros dropped."""
  if value.denominator == 1:
    return str(value.numerator)
  text = f"{float(value):.6f}".rstrip("0").rstrip(".")
  return "0" if text == "-0" else text


def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression.

  Args:
    expression: numbers with + - * / and parentheses, for example "(48 + 24) / 2".
  """
  return format_number(evaluate(expression))


@register("gsm8k_calculator")
class GSM8KCalculator(ToolEnv):
  """The environment of the module docstring."""

  def __init__(self, path: str = "", max_tool_calls: int = 4, instruction: str = INSTRUCTION, sandbox: Any = None,
               heldout: int = 0):
    super().__init__([calculator], max_tool_calls=max_tool_calls, sandbox=sandbox)
    self.rows, _ = load_rows("gsm8k", os.fspath(path) or str(DEFAULT_PATH))
    if not 0 <= heldout < len(self.rows):
      raise ValueError(f"heldout={heldout}: must be in [0, {len(self.rows)}) (the file has {len(self.rows)} problems)")
    self.heldout = heldout
    self.instruction = instruction
    self.answer = None

  def first_message(self, seed: int) -> str:
    seed, n_train = int(seed), len(self.rows) - self.heldout
    if self.heldout and seed >= HELDOUT_SEED_BASE:  # an evaluation seed: the held-out problems, in order
      question, self.answer = self.rows[n_train + (seed - HELDOUT_SEED_BASE) % self.heldout]
      return f"{question} {self.instruction}" if self.instruction else question
    question, self.answer = self.rows[int(np.random.default_rng(seed).integers(n_train))]
    return f"{question} {self.instruction}" if self.instruction else question

  def score(self, answer_text: str) -> float:
    if self.answer is None:
      raise RuntimeError("step before reset")
    return math_answer.math_reward_with_status(self.answer, answer_text)[0]
