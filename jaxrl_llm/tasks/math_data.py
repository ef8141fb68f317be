"""Math datasets from the files users download (JSONL or parquet, published column names).

  task = get_task("gsm8k", path="gsm8k/train.jsonl")       # or main/train-00000-of-00001.parquet
  task = get_task("math", path="MATH-500/test.jsonl")      # competition_math or MATH-500 layout
  task = get_task("dapo", path="dapo-math-17k.parquet")    # verl / DAPO prompt + reward_model

Layouts (one row per example; other columns are ignored):
  gsm8k  ``question``, ``answer`` (worked solution ending in a ``#### N`` line; reference = N)
  math   ``problem`` and ``answer`` (MATH-500) or ``solution`` (competition_math; reference = its
         last ``\\boxed{...}``, balanced braces); ``answer`` wins when both are present
  dapo   ``prompt`` (a string, or chat messages ``[{"role", "content"}]``: one user turn, system
         turns are prepended) and ``reward_model`` = ``{"ground_truth", "style"}`` (reference =
         ground_truth); plain ``prompt`` / ``answer`` columns work too. ``prompt_key`` and
         ``answer_key`` (dotted for nested columns, ``""`` = auto) pick other columns.

The prompt is the question, then a space and ``instruction`` (the standard instruction formats
below; ``""`` = none). A row whose prompt exceeds ``max_prompt_chars`` characters is dropped
(``long_prompts="drop"``) or cut to that length (``"truncate"``), and counted: one long row never
sizes the run. Bad rows (invalid JSON or UTF-8, a missing or mistyped field, no reference answer)
are skipped and counted as for JSONL; one warning lists the first few. ``*.parquet`` files are
read with pyarrow, any other file as JSONL. A missing or unreadable file, or missing columns,
raise ``TaskError`` naming the path and the expected columns. Loaded files are cached by (path,
size, mtime, arguments).

Rewards: ``math_answer.math_reward`` (final-answer extraction + math-verify on LaTeX only; model
output is never evaluated as Python).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any, Callable

import numpy as np

from jaxrl_llm.tasks import math_answer
from jaxrl_llm.tasks.base import Task, TaskError

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MAX_PROMPT_CHARS = 2048
LONG_PROMPTS = ("drop", "truncate")


class RowError(Exception):
  """A bad row; the message is the reason recorded in the report."""


@dataclasses.dataclass(frozen=True)
class DataReport:
  """What a loader kept and skipped. ``bad_rows`` holds ``(row, reason)``: 1-based line numbers
  for JSONL, 1-based row numbers for parquet. ``num_long`` prompts exceeded ``max_prompt_chars``
  and were dropped or truncated per ``long_prompts``."""
  path: str
  num_ok: int
  bad_rows: tuple[tuple[int, str], ...]
  num_long: int
  long_prompts: str

  @property
  def num_bad(self) -> int:
    return len(self.bad_rows)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A dataset layout: required columns (each a tuple of alternatives) and a row reader
  ``(row, columns, prompt_key, answer_key) -> (question, answer)`` raising RowError."""
  task: str
  columns: Callable[[str, str], tuple[tuple[str, ...], ...]]
  read: Callable[[dict, frozenset, str, str], tuple[str, str]]


def _text(row: dict, key: str, *, allow_number: bool = False) -> str:
  """``row[key]`` (dotted keys walk nested objects) as a non-empty string."""
  value: Any = row
  for part in key.split("."):
    if not isinstance(value, dict) or part not in value:
      raise RowError(f"missing {key!r}")
    value = value[part]
  if allow_number and isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, str) or not value.strip():
    kind = "string or number" if allow_number else "string"
    raise RowError(f"{key!r} must be a non-empty {kind}, got {type(value).__name__} {str(value)[:20]!r}")
  return value


def _chat_prompt(value: Any, key: str) -> str:
  """A prompt given as chat messages: the user turn, after any system turns."""
  if isinstance(value, str):
    return value
  if not isinstance(value, (list, tuple)) or not value:
    raise RowError(f"{key!r} must be a string or a list of chat messages")
  parts, users = [], 0
  for m in value:
    if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in (
        "system", "user", "assistant"):
      raise RowError(f"{key!r}: each message needs a 'role' (system/user) and a string 'content'")
    if m["role"] == "assistant":
      raise RowError(f"{key!r} has an assistant turn; only single-turn prompts are supported")
    users += m["role"] == "user"
    parts.append(m["content"])
  if users != 1:
    raise RowError(f"{key!r} must hold exactly one user message, got {users}")
  return "\n\n".join(parts)


def _read_gsm8k(row, columns, prompt_key, answer_key):
  del columns, prompt_key, answer_key
  question, solution = _text(row, "question"), _text(row, "answer")
  answer = math_answer.gsm8k_answer(solution)
  if not answer:
    raise RowError("'answer' has no '#### N' final line")
  return question, answer


def _read_math(row, columns, prompt_key, answer_key):
  del columns, prompt_key, answer_key
  problem = _text(row, "problem")
  given = row.get("answer")
  if isinstance(given, (int, float)) and not isinstance(given, bool) or (
      isinstance(given, str) and given.strip()):
    return problem, math_answer.normalize(_text(row, "answer", allow_number=True))
  boxed = math_answer.last_boxed(_text(row, "solution"))
  if not boxed or not boxed.strip():
    raise RowError("'solution' has no \\boxed{...} answer")
  return problem, math_answer.normalize(boxed)


def _dapo_answer_key(answer_key: str, columns: frozenset) -> str:
  if answer_key:
    return answer_key
  return "reward_model.ground_truth" if "reward_model" in columns else "answer"


def _read_dapo(row, columns, prompt_key, answer_key):
  if prompt_key not in row:
    raise RowError(f"missing {prompt_key!r}")
  prompt = _chat_prompt(row[prompt_key], prompt_key)
  if not prompt.strip():
    raise RowError(f"{prompt_key!r} is empty")
  return prompt, math_answer.normalize(_text(row, _dapo_answer_key(answer_key, columns),
                                             allow_number=True))


def _read_plain(row, columns, prompt_key, answer_key):
  del columns
  return _text(row, prompt_key), _text(row, answer_key or "answer", allow_number=True)


def _dapo_columns(prompt_key, answer_key):
  if answer_key:
    return ((prompt_key,), (answer_key.split(".")[0],))
  return ((prompt_key,), ("reward_model", "answer"))


LAYOUTS = {
    "gsm8k": Layout("gsm8k", lambda p, a: (("question",), ("answer",)), _read_gsm8k),
    "math": Layout("math", lambda p, a: (("problem",), ("answer", "solution")), _read_math),
    "dapo": Layout("dapo", _dapo_columns, _read_dapo),
    "jsonl": Layout("jsonl", lambda p, a: ((p,), ((a or "answer").split(".")[0],)), _read_plain),
}


def _describe(columns: tuple[tuple[str, ...], ...]) -> str:
  return ", ".join(" or ".join(repr(c) for c in alts) for alts in columns)


def decode_json_line(raw: bytes | str) -> tuple[Any, str | None]:
  """(the parsed row, None), (None, None) for a blank line, or (None, why it is unreadable)."""
  try:
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
  except UnicodeDecodeError:
    return None, "invalid UTF-8"
  if not text.strip():
    return None, None
  try:
    return json.loads(text), None
  except (ValueError, RecursionError) as e:
    return None, f"invalid JSON: {str(e)[:80]}"


def _read_records(path: str) -> tuple[list[tuple[int, Any]], frozenset]:
  """``[(row_number, row dict or reason str)]`` and the columns seen (parquet: its schema)."""
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq  # lazy: only parquet users pay the import
    try:
      table = pq.read_table(path)
    except Exception as e:  # pylint: disable=broad-except  # pyarrow raises several types
      raise TaskError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e)[:120]})",
                      "path") from None
    return list(enumerate(table.to_pylist(), start=1)), frozenset(table.column_names)
  records, columns = [], set()
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, start=1):
      row, error = decode_json_line(raw)
      if error is not None:
        records.append((line_no, error))
        continue
      if row is None:  # blank line
        continue
      if not isinstance(row, dict):
        records.append((line_no, f"row is a {type(row).__name__}, not an object"))
        continue
      columns.update(row)
      records.append((line_no, row))
  return records, frozenset(columns)


@functools.lru_cache(maxsize=16)
def _load_cached(layout_name: str, path: str, stamp: tuple[int, int], prompt_key: str,
                 answer_key: str, instruction: str, max_prompt_chars: int,
                 long_prompts: str) -> tuple[tuple[tuple[str, str], ...], DataReport]:
  del stamp  # part of the cache key only: a rewritten file is read again
  layout = LAYOUTS[layout_name]
  required = layout.columns(prompt_key, answer_key)
  expects = f"task {layout.task!r} expects a JSONL or parquet file with columns {_describe(required)}"
  records, columns = _read_records(path)
  if not records:
    raise TaskError(f"{path}: the file holds no rows; {expects}", "path")
  missing = [alts for alts in required if not set(alts) & columns]
  if columns and missing:
    found = ", ".join(repr(c) for c in sorted(columns)[:12]) + (", ..." if len(columns) > 12 else "")
    raise TaskError(f"{path}: missing column {_describe(tuple(missing))}; {expects} "
                    f"(the file has {found})", "path")
  rows, bad, num_long = [], [], 0
  for row_no, row in records:
    if isinstance(row, str):
      bad.append((row_no, row))
      continue
    try:
      question, answer = layout.read(row, columns, prompt_key, answer_key)
    except RowError as e:
      bad.append((row_no, str(e)))
      continue
    prompt = f"{question} {instruction}" if instruction else question
    if len(prompt) > max_prompt_chars:
      num_long += 1
      if long_prompts == "drop":
        continue
      prompt = prompt[:max_prompt_chars]
    rows.append((prompt, answer))
  report = DataReport(path=path, num_ok=len(rows), bad_rows=tuple(bad), num_long=num_long,
                      long_prompts=long_prompts)
  log = logging.getLogger(__name__)
  if bad:
    shown = ", ".join(f"row {n}: {why}" for n, why in bad[:5])
    log.warning("%s: skipped %d malformed rows (%s%s)", path, len(bad), shown,
                ", ..." if len(bad) > 5 else "")
  if num_long:
    log.warning("%s: %s %d prompts longer than max_prompt_chars=%d", path,
                "dropped" if long_prompts == "drop" else "truncated", num_long, max_prompt_chars)
  if not rows:
    raise TaskError(f"{path}: no valid rows ({len(bad)} malformed, {num_long} over "
                    f"max_prompt_chars={max_prompt_chars}); {expects}", "path")
  return tuple(rows), report


def load_rows(layout: str, path: str | os.PathLike, *, prompt_key: str = "prompt",
              answer_key: str = "", instruction: str = "",
              max_prompt_chars: int = MAX_PROMPT_CHARS,
              long_prompts: str = "drop") -> tuple[tuple[tuple[str, str], ...], DataReport]:
  """``((prompt, answer), ...)`` of a data file in a layout of ``LAYOUTS`` and its report.

  ``prompt_key`` / ``answer_key`` apply to the ``jsonl`` and ``dapo`` layouts (``answer_key=""``:
  ``answer``, or for ``dapo`` ``reward_model.ground_truth`` when that column exists).
  ``*.parquet`` is read with pyarrow, any other file as JSONL. Raises TaskError (``kwarg`` names
  the argument at fault) for a missing or unreadable file, missing columns, no valid row, or a bad
  argument.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}; valid layouts: {sorted(LAYOUTS)}")
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise TaskError(f"task {layout!r} needs path= (a JSONL or parquet file)", "path")
  path = os.fspath(path)
  if isinstance(max_prompt_chars, bool) or not isinstance(max_prompt_chars, int) or max_prompt_chars < 1:
    raise TaskError(f"max_prompt_chars={max_prompt_chars!r} must be an int >= 1", "max_prompt_chars")
  if long_prompts not in LONG_PROMPTS:
    raise TaskError(f"long_prompts={long_prompts!r} must be one of {LONG_PROMPTS}", "long_prompts")
  for name, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
    if not isinstance(key, str):
      raise TaskError(f"{name}={key!r} must be a string", name)
  layout_spec = LAYOUTS[layout]
  expects = (f"task {layout!r} expects a JSONL or parquet file with columns "
             f"{_describe(layout_spec.columns(prompt_key, answer_key))}")
  if not os.path.isfile(path):
    why = "is a directory" if os.path.isdir(path) else "no such file"
    raise TaskError(f"{path}: {why}; {expects}", "path")
  st = os.stat(path)
  try:
    return _load_cached(layout, os.path.realpath(path), (st.st_size, st.st_mtime_ns), prompt_key,
                        answer_key, instruction, max_prompt_chars, long_prompts)
  except OSError as e:
    raise TaskError(f"{path}: cannot read ({e.strerror or e}); {expects}", "path") from None


def _sample_row(rng: np.random.Generator, *, rows: tuple[tuple[str, str], ...]) -> dict[str, str]:
  prompt, answer = rows[int(rng.integers(len(rows)))]
  return {"prompt": prompt, "answer": answer}


def file_task(name: str, rows: tuple[tuple[str, str], ...], reward: Callable[[str, str, str], float],
              kwargs: dict[str, Any]) -> Task:
  """A Task over loaded rows: examples drawn uniformly, splits hold rows out (``Task.rows``).

  Its math-verify reward runs in killable worker processes under ``reward.executor="auto"``: sympy can
  spin inside C code, holding the GIL, where no thread can be stopped.
  """
  return Task(
      name=name,
      make_example=functools.partial(_sample_row, rows=rows),
      reward=reward,
      max_prompt_len=max(len(p) for p, _ in rows),
      max_answer_len=max(len(a) for _, a in rows),
      kwargs=tuple(sorted(kwargs.items())),
      rows=rows,
      reward_executor="process",
      reward_timeout_s=kwargs.get("timeout_s"),
  )


def _make(layout: str, path: str, *, prompt_key: str, answer_key: str, instruction: str,
          max_prompt_chars: int, long_prompts: str, timeout_s: float) -> Task:
  if not isinstance(instruction, str):
    raise TaskError(f"instruction={instruction!r} must be a string", "instruction")
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
    raise TaskError(f"timeout_s={timeout_s!r} must be a number > 0", "timeout_s")
  rows, _ = load_rows(layout, path, prompt_key=prompt_key, answer_key=answer_key,
                      instruction=instruction, max_prompt_chars=max_prompt_chars,
                      long_prompts=long_prompts)
  kwargs = dict(path=os.fspath(path), instruction=instruction, max_prompt_chars=max_prompt_chars,
                long_prompts=long_prompts, timeout_s=float(timeout_s))
  if layout == "dapo":
    kwargs.update(prompt_key=prompt_key, answer_key=answer_key)
  return file_task(layout, rows, math_answer.MathReward(float(timeout_s)),
                   kwargs)


def make_gsm8k_task(path: str, instruction: str = GSM8K_INSTRUCTION,
                    max_prompt_chars: int = MAX_PROMPT_CHARS, long_prompts: str = "drop",
                    timeout_s: float = 5.0) -> Task:
  """GSM8K (openai/gsm8k ``question`` / ``answer``); the reference is the ``#### N`` number."""
  return _make("gsm8k", path, prompt_key="", answer_key="", instruction=instruction,
               max_prompt_chars=max_prompt_chars, long_prompts=long_prompts, timeout_s=timeout_s)


def make_math_task(path: str, instruction: str = MATH_INSTRUCTION,
                   max_prompt_chars: int = MAX_PROMPT_CHARS, long_prompts: str = "drop",
                   timeout_s: float = 5.0) -> Task:
  """MATH (competition_math ``problem`` / ``solution``, or MATH-500 with ``answer``)."""
  return _make("math", path, prompt_key="", answer_key="", instruction=instruction,
               max_prompt_chars=max_prompt_chars, long_prompts=long_prompts, timeout_s=timeout_s)


def make_dapo_task(path: str, prompt_key: str = "prompt", answer_key: str = "",
                   instruction: str = "", max_prompt_chars: int = MAX_PROMPT_CHARS,
                   long_prompts: str = "drop", timeout_s: float = 5.0) -> Task:
  """DAPO / verl layout (``prompt`` + ``reward_model.ground_truth``) or plain prompt / answer."""
  return _make("dapo", path, prompt_key=prompt_key, answer_key=answer_key, instruction=instruction,
               max_prompt_chars=max_prompt_chars, long_prompts=long_prompts, timeout_s=timeout_s)
