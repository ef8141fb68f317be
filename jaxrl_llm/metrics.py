"""Metric writers (JSONL + TensorBoard), the end-of-run summary table and the reward/accuracy plot.

`DIR/metrics.jsonl` holds one JSON object per learner step (DESIGN §4). Wall-clock fields are named
`time_*` so that repeatability checks can drop them. The file is strict JSON: non-finite numbers are
written as null (`json_safe`), so `json.loads(line, parse_constant=...)` never meets NaN or Infinity.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from typing import Any

import numpy as np


def to_python(metrics: dict[str, Any]) -> dict[str, Any]:
  """Device scalars -> Python floats/ints (JSON-safe; non-finite values become None)."""
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    if v.ndim:
      continue
    x = v.item()
    if isinstance(x, float) and not math.isfinite(x):
      x = None
    out[k] = x
  return out


def json_safe(x):
  """`x` as strict JSON data: non-finite floats -> None, numpy scalars/arrays -> Python numbers/lists
  (recursively through dicts, lists and tuples)."""
  if isinstance(x, dict):
    return {k: json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  if isinstance(x, np.ndarray):
    return json_safe(x.tolist())
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported without torch. tensorboardX imports torch whenever it is installed, only
  to accept torch tensors (we log Python numbers); that import took 1.7 s of every run's start-up where torch is
  installed (the test environment: every `python -m jaxrl_llm` a test launches paid it). A `None` entry in
  `sys.modules` makes that one `import torch` fail as if torch were absent; it is removed at once, so a later
  import of torch works as usual."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # lazy: optional dependency at import time
    return SummaryWriter
  sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter  # lazy: optional dependency at import time
  finally:
    sys.modules.pop("torch", None)
  return SummaryWriter


TIMELINE = "timeline.jsonl"  # per-episode event timelines beside metrics.jsonl (`MetricsWriter.timeline`)


class MetricsWriter:
  """Appends metric rows to DIR/metrics.jsonl and (optionally) TensorBoard events beside it."""

  def __init__(self, workdir: str, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._f = open(self.path, "a", encoding="utf-8")
    self._timeline = None
    self._tb = None
    if tensorboard:
      self._tb = _summary_writer_class()(os.path.join(workdir, "tb"))

  def write(self, row: dict[str, Any]) -> None:
    row = json_safe(row)
    self._f.write(json.dumps(row, sort_keys=True, allow_nan=False) + "\n")
    self._f.flush()
    if self._tb is not None:
      step = row["step"]
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, step)

  def timeline(self, step: int, entries: list[dict]) -> None:
    """Appends one line per entry (an episode's event timeline, the harness source's) to DIR/timeline.jsonl, each
    with the `step` that consumed it; the file is made on the first entries."""
    if not entries:
      return
    if self._timeline is None:
      self._timeline = open(os.path.join(os.path.dirname(self.path), TIMELINE), "a", encoding="utf-8")
    for e in entries:
      self._timeline.write(json.dumps(json_safe({"step": step, **e}), sort_keys=True, allow_nan=False) + "\n")
    self._timeline.flush()

  def close(self) -> None:
    self._f.close()
    if self._timeline is not None:
      self._timeline.close()
    if self._tb is not None:
      self._tb.close()


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


DAMAGED_SUFFIX = ".damaged"  # `metrics.jsonl.damaged`: unreadable lines a resume set aside


def _row_step(raw: bytes):
  """The `step` of one metrics line, or None when the line is not a metrics row (garbage, cut short)."""
  try:
    row = json.loads(raw)
  except ValueError:  # JSONDecodeError and UnicodeDecodeError (a line cut inside a character)
    return None
  step = row.get("step") if isinstance(row, dict) else None
  return step if isinstance(step, int) and not isinstance(step, bool) else None


def truncate_after(path: str, step: int) -> str | None:
  """Drops rows with step > `step` (a resumed run rewrites what the interrupted one had written).

  Rows are appended in step order, so reading stops at the cut: what follows the row of `step` (or the
  first row past it) is dropped unparsed, a line a crash or a full disk left half-written included. A
  line before the cut that is no metrics row is moved to `path + DAMAGED_SUFFIX` (appended, never
  overwritten) with a warning naming that file; returns that file's path, or None when nothing was
  moved. Kept lines are copied byte for byte.
  """
  if not os.path.exists(path):
    return None
  kept: list[bytes] = []
  damaged: list[tuple[int, bytes]] = []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      s = _row_step(raw)
      if s is None:
        damaged.append((number, raw))
        continue
      if s > step:
        break
      kept.append(raw if raw.endswith(b"\n") else raw + b"\n")
      if s == step:
        break
  aside = None
  if damaged:  # first, so that a crash in between loses no line
    aside = path + DAMAGED_SUFFIX
    with open(aside, "ab") as f:
      for _, raw in damaged:
        f.write(raw if raw.endswith(b"\n") else raw + b"\n")
      f.flush()
      os.fsync(f.fileno())
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:  # then renamed: a crash mid-write leaves the old file whole
    f.writelines(kept)
  os.replace(tmp, path)
  if aside is not None:
    lines = ", ".join(str(n) for n, _ in damaged[:5]) + (", ..." if len(damaged) > 5 else "")
    warnings.warn(f"{path}: {len(damaged)} unreadable line(s) before step {step} (line {lines}) moved to {aside}; "
                  "the resumed metrics lack those rows", RuntimeWarning, stacklevel=2)
  return aside


def summary_table(rows: list[dict], initial_eval: float | None = None) -> str:
  """A short plain-text table: reward and held-out accuracy at start / end, throughput."""
  evals = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
  rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
  k = max(1, len(rewards) // 10)
  lines = ["", f"{'metric':<28}{'start':>12}{'end':>12}"]
  if evals:  # start = before the first learner step when the run measured it
    start = evals[0][1] if initial_eval is None else initial_eval
    lines.append(f"{'held-out accuracy':<28}{start:>12.3f}{evals[-1][1]:>12.3f}")
  if rewards:
    lines.append(f"{'reward (mean of 10% window)':<28}{np.mean(rewards[:k]):>12.3f}{np.mean(rewards[-k:]):>12.3f}")
  t = [r.get("time_step_s") for r in rows if r.get("time_step_s")]
  if t:
    lines.append(f"{'seconds per learner step':<28}{'':>12}{np.median(t):>12.3f}")
  lines.append(f"{'learner steps':<28}{'':>12}{len(rows):>12d}")
  skipped = sum(1 for r in rows if r.get("update_skipped") and not r.get("updates_skipped_empty"))
  if skipped:
    lines.append(f"{'updates skipped (non-finite)':<28}{'':>12}{skipped:>12d}")
  empty = sum(int(r.get("updates_skipped_empty") or 0) for r in rows)
  if empty:
    lines.append(f"{'updates skipped (no sample)':<28}{'':>12}{empty:>12d}")
  count = lambda *keys: sum(int(r.get(k) or 0) for r in rows for k in keys)
  if any("env_errors" in r for r in rows):  # episodes: `reward_errors` also counts the policy's invalid actions
    for label, keys in (("env errors / timeouts", ("env_errors", "env_timeouts")),
                        ("invalid actions (episodes)", ("env_invalid",))):
      if count(*keys):
        lines.append(f"{label:<28}{'':>12}{count(*keys):>12d}")
  elif count("reward_errors"):
    lines.append(f"{'reward errors / timeouts':<28}{'':>12}{count('reward_errors'):>12d}")
  return "\n".join(lines)


def plot_series(rows: list[dict], initial_eval: float | None = None) -> dict[str, tuple[list, list]]:
  """The plot's data: {"reward": (steps, mean train rewards), "held_out": (steps, held-out accuracies)}.

  x is the number of learner steps done before the measurement: the rollouts of step t come from the policy
  after t updates; step t's evaluation runs after its update (t + 1). The held-out curve starts at 0 with
  `initial_eval` (run_info's `eval_accuracy_initial`, the "start" of the summary) when it was measured."""
  steps = [r["step"] for r in rows if r.get("reward_mean") is not None]
  reward = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
  ev = [(r["step"] + 1, r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
  if initial_eval is not None:
    ev = [(0, initial_eval)] + ev
  return {"reward": (steps, reward), "held_out": ([s_ for s_, _ in ev], [a for _, a in ev])}


def plot(rows: list[dict], path: str, title: str = "", initial_eval: float | None = None) -> None:
  """Writes a PNG with training reward and held-out accuracy against learner step (`plot_series`)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  series = plot_series(rows, initial_eval)
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(*series["reward"], lw=1, alpha=0.6, label="train reward (mean)")
  if series["held_out"][0]:
    ax.plot(*series["held_out"], "o-", label="held-out greedy accuracy")
  ax.set_xlabel("learner steps done")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
