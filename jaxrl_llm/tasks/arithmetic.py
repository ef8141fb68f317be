"""Multi-digit integer arithmetic: prompt ``"12+47="``, answer ``"59"``, completion answer + EOS.

Operands have exactly ``num_digits`` digits (0..9 when ``num_digits == 1``). ``ops`` is a string
over ``"+-*"``; each example draws one op uniformly, so ``ops="+-"`` mixes addition and
subtraction (answers may then be negative, e.g. ``"12-47="`` → ``"-35"``). The default, 2-digit
addition, is learnable in part by a ~100k-parameter transformer with SFT + RL in minutes on CPU.

``partial_credit=True`` (shaping, for the smallest test configs): a wrong completion scores
``0.5 × (characters equal to the answer's at the same position) / max(len(answer), len(completion))``,
so even a barely trained policy earns varied rewards and a non-zero RL gradient; only an exact
answer scores 1 (accuracy, ``reward >= 1``, is unchanged).

``style="chat"`` phrases the same problem as a question for an instruct model
(``"What is 12 + 47? Reply with only the number."``) and scores a free-form completion by the last
integer in it (``"12 + 47 = 59."`` scores 1); the answer (SFT target) stays ``"59"``. The task
``arithmetic_chat`` (``make_chat_task``) is the same with the style fixed, so a config can switch
between it and a data-file task (``gsm8k``) by ``task.name`` alone.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from jaxrl_llm.tasks.base import Task

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# Bound on completion length considered: anything longer is wrong without reading it.
_MAX_COMPLETION_CHARS = 1024
STYLES = ("raw", "chat")
CHAT_QUESTION = "What is {a} {op} {b}? Reply with only the number."
# A number in free-form text: optional sign (not a minus between two digits, as in "5-3"), digits with
# optional thousands commas, optional decimal part (so "59.5" is read whole, not as "5").
_NUMBER_RE = re.compile(r"(?:(?<![0-9])-)?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|(?:(?<![0-9])-)?[0-9]+(?:\.[0-9]+)?",
                        re.ASCII)


def make_example(rng: np.random.Generator, *, num_digits: int, ops: str,
                 style: str = "raw") -> dict[str, str]:
  """Draws one example: two ``num_digits``-digit operands and an op from ``ops``.

  The draws do not depend on ``style``: the same rng state gives the same problem in both styles.
  """
  lo = 0 if num_digits == 1 else 10 ** (num_digits - 1)
  a, b = (int(x) for x in rng.integers(lo, 10 ** num_digits, size=2))
  op = ops[int(rng.integers(len(ops)))]
  prompt = CHAT_QUESTION.format(a=a, op=op, b=b) if style == "chat" else f"{a}{op}{b}="
  return {"prompt": prompt, "answer": str(_APPLY[op](a, b))}


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



def last_integer(text: str) -> int | None:
  """The last number in ``text`` if it is an integer (``"1,234"`` → 1234), else None.

  None when there is no number or the last one has a decimal part (``"59.5"``, ``"59.0"``).
  """
  found = _NUMBER_RE.findall(text)
  if not found or "." in found[-1]:
    return None
  return int(found[-1].replace(",", ""))


def chat_reward(prompt: str, answer: str, completion: str) -> float:
  """1.0 if the last number in a free-form completion is the integer ``answer``, else 0.0.

  ``"The answer is 59."``, ``"12 + 47 = 59"`` and ``"59"`` score 1; ``"59 or 60"``, ``"59.5"`` and
  a completion without a number score 0. Non-string or oversized input scores 0; never raises.
  """
  del prompt
  if not isinstance(completion, str) or not isinstance(answer, str):
    return 0.0
  if len(completion) > _MAX_COMPLETION_CHARS:
    return 0.0
  got = last_integer(completion)
  try:
    return 1.0 if got is not None and got == int(answer) else 0.0
  except ValueError:
    return 0.0


def make_task(num_digits: int = 2, ops: str = "+", style: str = "raw", partial_credit: bool = False) -> Task:
  """The arithmetic task with ``num_digits``-digit operands and operators from ``ops``.

  ``style``: ``"raw"`` (``"12+47="``, exact-match reward) or ``"chat"`` (a natural-language question,
  last-integer reward; for instruct models with a chat template).
  """
  if not isinstance(num_digits, int) or not 1 <= num_digits <= 9:
    raise ValueError(f"num_digits must be an int in [1, 9], got {num_digits!r}")
  if not ops or set(ops) - set(_APPLY):
    raise ValueError(f"ops must be a non-empty string over {''.join(_APPLY)!r}, got {ops!r}")
  if style not in STYLES:
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")
  # Longest answer: a carry digit for "+", a sign for "-", twice the digits for "*".
  answer_len = max({"+": num_digits + 1, "-": num_digits + 1, "*": 2 * num_digits}[op]
                   for op in ops)
  prompt_len = 2 * num_digits + 2
  if style == "chat":
    prompt_len = len(CHAT_QUESTION.format(a="9" * num_digits, op="+", b="9" * num_digits))
  # "raw" keeps the kwargs (and so the TFDS config names) of datasets built before `style` existed.
  kwargs = ((("num_digits", num_digits), ("ops", ops)) + ((("style", style),) if style != "raw" else ())
            + ((("partial_credit", True),) if partial_credit else ()))
  return Task(
      name="arithmetic",
      make_example=functools.partial(make_example, num_digits=num_digits, ops=ops, style=style),
      reward=chat_reward if style == "chat" else partial_reward if partial_credit else reward,
      max_prompt_len=prompt_len,
      max_answer_len=answer_len,
      kwargs=kwargs,
  )


def make_chat_task(num_digits: int = 2, ops: str = "+") -> Task:
  """``arithmetic`` with ``style="chat"``, registered as its own task ``arithmetic_chat``."""
  task = make_task(num_digits, ops, style="chat")
  return dataclasses.replace(task, name="arithmetic_chat",
                             kwargs=tuple(kv for kv in task.kwargs if kv[0] != "style"))
