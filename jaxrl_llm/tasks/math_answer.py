"""Final-answer extraction for math completions and the math-verify reward built on it.

Extraction (``extract_answer``), first match wins, always the *last* occurrence in the text:
  1. ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (MATH, "put your answer in \\boxed{}");
  2. ``#### N`` (GSM8K); the rest of that line;
  3. ``Answer: X`` (DAPO's "last line of the form Answer: $Answer"); the rest of that line;
  4. the last plain number (``-3``, ``0.5``, ``1/2``, ``1,234``).
The extracted text is normalised (``normalize``: surrounding ``$`` and spaces, a final ``.``, and
thousands separators of plain numbers go), so ``#### 1,234.`` reads as ``1234``.

The reward compares the extracted completion answer with the reference: equal normalised strings
score 1; otherwise both are parsed by math-verify **as LaTeX only** (``$...$``) and compared
symbolically (``\\boxed{1/2}`` equals ``0.5``). The plain-expression path of math-verify goes
through ``sympy.parse_expr``, which evaluates Python code, so it is never used: model output is
never executed.

Bounded before sympy evaluates: an answer longer than ``MAX_SYMBOLIC_CHARS`` or nested deeper than
``MAX_SYMBOLIC_DEPTH`` braces is compared as a string only (parsing a 3000-deep ``\\frac`` takes
minutes), and so is a parsed expression whose numbers could reach more than ``MAX_DIGITS`` digits
(``10^{10^{10^{10}}}``, ``100000!``): sympy would compute them in C, holding the GIL. In a run the
reward also runs in a killable worker process (``Task.reward_executor``), under one time limit.
"""

from __future__ import annotations

import logging
import math
import re

from jaxrl_llm.tasks import reward as reward_lib

# math-verify warns on every call that its own (signal-based) timeouts are off; they are off on
# purpose (calls run under reward.call_with_timeout, off the main thread).
logging.getLogger("math_verify").setLevel(logging.ERROR)

# Answers sit at the end of a completion, and parsing cost grows with length.
MAX_COMPLETION_CHARS = 4096
# Limits of the symbolic comparison (see the module docstring); past them, equal strings still score 1.
MAX_SYMBOLIC_CHARS = 1000
MAX_SYMBOLIC_DEPTH = 24
MAX_DIGITS = 100_000  # 10^{100000} compares in milliseconds; 2^{2^{20}} (315k digits) takes 0.1 s
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_BARE_RE = re.compile(r"\\boxed +([^\s$]+)")  # "\boxed 5": no braces (a few MATH solutions)
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_RE = re.compile(r"answer[ \t]*:[ \t]*([^\n]*)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|-?[0-9]+(?:\.[0-9]+)?(?:/[0-9]+)?",
                        re.ASCII)
_THOUSANDS_RE = re.compile(r"-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?", re.ASCII)


def last_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None.

  ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; unclosed and empty boxes are skipped.
  """
  for m in reversed(list(_BOX_RE.finditer(text))):
    depth, start = 1, m.end()
    for i in range(start, len(text)):
      if text[i] == "{":
        depth += 1
      elif text[i] == "}":
        depth -= 1
        if depth == 0:
          break
    if depth == 0 and text[start:i].strip():
      return text[start:i]
  bare = _BOX_BARE_RE.findall(text)
  return bare[-1] if bare else None


def normalize(answer: str) -> str:
  """Surface normalisation of an extracted answer: spaces, ``$``, a final ``.``, ``1,234`` -> ``1234``."""
  s = answer.strip()
  for _ in range(2):
    s = s.strip().strip("$").strip()
    if s.endswith(".") and not s.endswith(".."):
      s = s[:-1]
  s = s.replace("\\!", "")
  if _THOUSANDS_RE.fullmatch(s):
    s = s.replace(",", "")
  return s


def _line_answer(line: str) -> str:
  """The answer on a ``#### ...`` / ``Answer: ...`` line: the line if it is a number or LaTeX
  (``2\\sqrt{3}``), else its first number (``72 dollars`` -> ``72``), else the line."""
  s = normalize(line)
  if _NUMBER_RE.fullmatch(s) or any(c in s for c in "\\^{}"):
    return s
  m = _NUMBER_RE.search(s.replace("$", ""))
  return normalize(m.group(0)) if m else s


def extract_answer(text: str) -> str | None:
  """The final answer of a completion or a reference solution (see the module docstring), or None."""
  if not isinstance(text, str):
    return None
  boxed = last_boxed(text)
  if boxed is not None:
    return normalize(boxed)
  for pattern in (_HASH_RE, _ANSWER_RE):
    found = [x for x in pattern.findall(text) if x.strip()]
    if found:
      return _line_answer(found[-1])
  numbers = _NUMBER_RE.findall(text)
  return normalize(numbers[-1]) if numbers else None


def gsm8k_answer(solution: str) -> str | None:
  """GSM8K reference: the text after the last ``####`` (``#### 1,234`` -> ``1234``), else None."""
  found = _HASH_RE.findall(solution) if isinstance(solution, str) else []
  found = [x for x in found if x.strip()]
  return _line_answer(found[-1]) if found else None


def _parse_latex(text: str) -> list:
  from math_verify import LatexExtractionConfig, parse  # lazy: the sympy import is slow
  return parse(f"${text.replace('$', '')}$", extraction_config=[LatexExtractionConfig()],
               parsing_timeout=None)


def _brace_depth(text: str) -> int:
  depth = deepest = 0
  for ch in text:
    if ch == "{":
      depth += 1
      deepest = max(deepest, depth)
    elif ch == "}":
      depth -= 1
  return deepest


def _digits_bound(expr) -> float:
  """An upper bound on the decimal digits of any number sympy may compute from `expr` (inf: too many
  to bound). Symbols count as small; a power's exponent and a factorial's argument must be small numbers."""
  import sympy  # lazy, as math-verify
  if isinstance(expr, sympy.Rational):  # Integer too
    return max(int(expr.p).bit_length(), int(expr.q).bit_length()) * 0.30103 + 1
  if not isinstance(expr, sympy.Basic) or not expr.args:
    return 1.0
  if isinstance(expr, sympy.Pow):
    base, exp = _digits_bound(expr.args[0]), _digits_bound(expr.args[1])
    return math.inf if exp > 6 else 10.0 ** exp * base
  if isinstance(expr, (sympy.factorial, sympy.gamma, sympy.factorial2, sympy.subfactorial)):
    n = _digits_bound(expr.args[0])
    return math.inf if n > 6 else 10.0 ** n * n
  return sum(_digits_bound(a) for a in expr.args)


def _symbolic_ok(text: str) -> bool:
  return len(text) <= MAX_SYMBOLIC_CHARS and _brace_depth(text) <= MAX_SYMBOLIC_DEPTH


def _bounded(parsed: list) -> bool:
  return all(_digits_bound(x) <= MAX_DIGITS for x in parsed)


def _score(answer: str, completion: str) -> float:
  pred = extract_answer(completion[-MAX_COMPLETION_CHARS:])
  if pred is None or not pred:
    return 0.0
  gold = normalize(answer)
  if pred == gold:
    return 1.0
  if not (_symbolic_ok(gold) and _symbolic_ok(pred)):
    return 0.0
  from math_verify import verify  # lazy
  gold_p, pred_p = _parse_latex(gold), _parse_latex(pred)
  if not gold_p or not pred_p or not (_bounded(gold_p) and _bounded(pred_p)):
    return 0.0
  return 1.0 if verify(gold_p, pred_p, timeout_seconds=None) else 0.0


def math_reward_with_status(answer: str, completion: str, timeout_s: float = 5.0) -> tuple[float, str]:
  """``(reward, status)``: 1.0 when the completion's final answer equals ``answer``.

  Under ``timeout_s`` when called on its own; inside a run's reward call (already time-limited) the
  check runs inline, bounded by that one limit (``reward.call_with_timeout``).
  """
  if not isinstance(answer, str) or not isinstance(completion, str):
    return 0.0, "error"
  return reward_lib.call_with_timeout(_score, (answer, completion), timeout_s)


def math_reward(prompt: str, answer: str, completion: str, *, timeout_s: float = 5.0) -> float:
  """Task-style reward ``(prompt, answer, completion) -> {0.0, 1.0}``; never raises."""
  del prompt
  return math_reward_with_status(answer, completion, timeout_s)[0]


class MathReward:
  """`math_reward` with its time limit, as a picklable object for the data tasks' ``Task.reward``.

  Unpickling it (in a reward worker process, before the worker reports that it started) imports
  math-verify and sympy, so a worker's first call does not spend its time limit on those imports.
  """

  def __init__(self, timeout_s: float = 5.0):
    self.timeout_s = float(timeout_s)

  def __call__(self, prompt: str, answer: str, completion: str) -> float:
    return math_reward(prompt, answer, completion, timeout_s=self.timeout_s)

  def __eq__(self, other) -> bool:
    return isinstance(other, MathReward) and other.timeout_s == self.timeout_s

  def __hash__(self) -> int:
    return hash((MathReward, self.timeout_s))

  def __repr__(self) -> str:
    return f"MathReward(timeout_s={self.timeout_s})"

  def __getstate__(self) -> dict:
    return {"timeout_s": self.timeout_s}

  def __setstate__(self, state: dict) -> None:
    self.timeout_s = float(state["timeout_s"])
    import math_verify  # noqa: F401  # pylint: disable=unused-import,import-outside-toplevel  # warm: see the docstring
