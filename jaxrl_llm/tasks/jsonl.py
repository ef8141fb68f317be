"""User data as JSONL (``{"prompt": ..., "answer": ...}`` per line) with the math-answer reward.

Loading never crashes on bad rows: invalid UTF-8, invalid JSON, a non-object row, a missing key or
a wrong type skip the row and record ``(line_number, reason)`` in the report (1-based line
numbers; blank lines are ignored). ``answer`` may be a string or a number (stored as text).
The ``jsonl`` task (``make_task``) reads its file through ``math_data.load_rows`` (parquet works
too; over-long prompts are dropped or truncated and counted; a missing file or missing columns
raise ``TaskError`` naming both) and splits by held-out rows (``base.num_held_out``).

The reward is the one of every math task, ``math_answer.math_reward``: the completion's final answer
(the last ``\\boxed{}``, ``#### N`` or ``Answer: X`` line, else its last number) against ``answer``,
equal after normalisation or equal under math-verify on LaTeX only (model output is never executed);
``timeout_s`` bounds each call (in a run: the smaller of it and ``reward.timeout_s``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

from jaxrl_llm.tasks import math_answer, math_data
from jaxrl_llm.tasks.base import Task, TaskError


@dataclasses.dataclass(frozen=True)
class JsonlReport:
  """What ``load_jsonl`` kept and skipped: ``bad_lines`` holds ``(line_number, reason)``."""
  path: str
  num_ok: int
  bad_lines: tuple[tuple[int, str], ...]

  @property
  def num_bad(self) -> int:
    return len(self.bad_lines)


def _row_error(row: Any, prompt_key: str, answer_key: str) -> str | None:
  if not isinstance(row, dict):
    return f"row is a {type(row).__name__}, not an object"
  for key in (prompt_key, answer_key):
    if key not in row:
      return f"missing key {key!r}"
  if not isinstance(row[prompt_key], str) or not row[prompt_key]:
    return f"{prompt_key!r} must be a non-empty string"
  answer = row[answer_key]
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    return f"{answer_key!r} must be a string or a number, got {type(answer).__name__}"
  return None


def parse_jsonl_lines(lines: Sequence[bytes], *, prompt_key: str = "prompt",
                      answer_key: str = "answer",
                      path: str = "<lines>") -> tuple[list[dict[str, Any]], JsonlReport]:
  """Parses raw lines; returns rows ``{"prompt", "answer", "line"}`` and the report."""
  rows, bad = [], []
  for line_no, raw in enumerate(lines, start=1):
    row, error = math_data.decode_json_line(raw)
    if error is not None:
      bad.append((line_no, error))
      continue
    if row is None:  # blank line
      continue
    error = _row_error(row, prompt_key, answer_key)
    if error is not None:
      bad.append((line_no, error))
      continue
    rows.append({"prompt": row[prompt_key], "answer": str(row[answer_key]), "line": line_no})
  return rows, JsonlReport(path=path, num_ok=len(rows), bad_lines=tuple(bad))


def load_jsonl(path: str | os.PathLike, *, prompt_key: str = "prompt",
               answer_key: str = "answer") -> tuple[list[dict[str, Any]], JsonlReport]:
  """Reads a JSONL file; malformed rows are skipped, counted and logged (one warning)."""
  with open(path, "rb") as f:
    rows, report = parse_jsonl_lines(f.read().splitlines(), prompt_key=prompt_key,
                                     answer_key=answer_key, path=os.fspath(path))
  if report.bad_lines:
    shown = ", ".join(f"line {n}: {why}" for n, why in report.bad_lines[:5])
    logging.getLogger(__name__).warning("%s: skipped %d malformed rows (%s%s)", report.path,
                                        report.num_bad, shown,
                                        ", ..." if report.num_bad > 5 else "")
  return rows, report


def make_task(path: str, prompt_key: str = "prompt", answer_key: str = "answer",
              timeout_s: float = 5.0, max_prompt_chars: int = 2048,
              long_prompts: str = "drop") -> Task:
  """A Task over the rows of a JSONL (or parquet) file, rewarded by ``math_answer.math_reward``.

  Examples are drawn uniformly; splits hold rows out (``Task.rows``). Prompts longer than
  ``max_prompt_chars`` are dropped or truncated (``long_prompts``) and counted; see
  ``math_data.load_rows``. Raises ``TaskError`` naming the path and the expected columns when the
  file is missing, lacks the columns, or holds no valid row.
  """
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
    raise TaskError(f"timeout_s={timeout_s!r} must be a number > 0", "timeout_s")
  rows, _ = math_data.load_rows("jsonl", path, prompt_key=prompt_key, answer_key=answer_key,
                                max_prompt_chars=max_prompt_chars, long_prompts=long_prompts)
  return math_data.file_task(
      "jsonl", rows, math_answer.MathReward(float(timeout_s)),
      dict(answer_key=answer_key, path=os.fspath(path), prompt_key=prompt_key,
           timeout_s=timeout_s, max_prompt_chars=max_prompt_chars, long_prompts=long_prompts))
