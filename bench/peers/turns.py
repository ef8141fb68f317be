"""The turn-taking protocol every peer script speaks with `bench/run.py`'s `InterleavedPeer` (stdlib only).

A peer prints JSON lines: `{"status": "paused", ...}` after its warm-up and after each block of timed
steps but the last (then waits for a line on stdin: the parent's go-ahead), and one final summary line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def emit(result: dict) -> None:
  print(json.dumps(result), flush=True)


def peer_main(description: str, label: str, modules: tuple[str, ...], run) -> None:
  """A peer script's entry point: parse the shared flags, report a missing framework or a failed run as
  a status line (the table shows why), else emit `run(workload, model, warmup, steps, rounds)`."""
  import argparse
  import importlib
  import traceback
  ap = argparse.ArgumentParser(description=description)
  ap.add_argument("--workload", required=True)
  ap.add_argument("--model", required=True)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--steps", type=int, default=1)
  ap.add_argument("--rounds", type=int, default=1)
  a = ap.parse_args()
  try:
    for m in modules:
      importlib.import_module(m)
  except Exception as e:  # noqa: BLE001 -- reported, not raised
    emit({"status": f"{'/'.join(modules)} not importable: {type(e).__name__}: {e}"[:300]})
    return
  try:
    result = run(a.workload, a.model, max(a.warmup, 1), a.steps, max(a.rounds, 1))
  except Exception as e:  # noqa: BLE001 -- the table shows why
    traceback.print_exc(file=sys.stderr)
    result = {"status": f"{label} run failed: {type(e).__name__}: {e}"[:300]}
  emit(result)


def pause(done: int) -> float:
  """Tells the parent that `done` timed steps have run, waits for its go-ahead; returns when it came."""
  emit({"status": "paused", "steps_done": done})
  if not sys.stdin.readline():
    raise SystemExit("bench parent closed the pipe")
  return time.perf_counter()


def pauses_after(timed: int, steps: int, rounds: int) -> bool:
  """Whether to pause after the step that brings the timed steps to `timed` (negative: warm-up).

  With rounds > 1: after the warm-up and after every block but the last, `rounds` pauses in all.
  """
  return rounds > 1 and 0 <= timed < steps * rounds and timed % steps == 0


def step_times(starts: list[float], ends: list[float], warmup: int) -> list[float]:
  """Seconds of each timed step: its end minus when its clock started (the previous step's end, or
  the end of the pause after it)."""
  return [b - a for a, b in zip(starts[warmup - 1:], ends[warmup:])] if warmup >= 1 else []


class StepClock:
  """Call `end_of_step()` when each global step has finished (blocked on its result): it records the
  time, pauses where the protocol says, and `summary()` gives the median of the timed steps."""

  def __init__(self, warmup: int, steps: int, rounds: int):
    self.warmup, self.steps, self.rounds = warmup, steps, rounds
    self.t0 = time.perf_counter()
    self.ends: list[float] = []
    self.starts: list[float] = []

  def end_of_step(self) -> None:
    self.ends.append(time.perf_counter())
    timed = len(self.ends) - self.warmup
    self.starts.append(pause(timed) if pauses_after(timed, self.steps, self.rounds) else self.ends[-1])

  @property
  def total(self) -> int:
    return self.warmup + self.steps * self.rounds

  def summary(self) -> dict:
    per_step = step_times(self.starts, self.ends, self.warmup)
    if not per_step:
      return {"status": f"error: only {len(self.ends)} steps completed"}
    return {"status": "ok", "total_s": statistics.median(per_step), "best_total_s": min(per_step),
            "step_s_each": per_step, "steps": len(per_step), "rounds": self.rounds, "warmup": self.warmup,
            "setup_and_warmup_s": self.ends[self.warmup - 1] - self.t0}


def group_advantages(rewards: list[float], group_size: int) -> list[float]:
  """GRPO advantages: (r − group mean) / (group std + 1e-6), unbiased std (as ours, `advantages.grpo`)."""
  out = []
  for g in range(0, len(rewards), group_size):
    grp = rewards[g:g + group_size]
    mean = sum(grp) / len(grp)
    std = (sum((r - mean) ** 2 for r in grp) / max(len(grp) - 1, 1)) ** 0.5
    out += [(r - mean) / (std + 1e-6) for r in grp]
  return out


# One thread only when it ran the probe this much faster than all cores: the oversubscribed case it guards against
# is 10-50x; on an idle machine the two are within noise of each other on the probe's small op (a run picked one
# thread at 213 vs 231 µs, and TRL then took 1.7x its two-thread time on the real step).
ONE_THREAD_MARGIN = 1.5


def pick_torch_threads() -> dict:
  """Sets torch's intra-op threads to all cores, or to 1 when one thread runs small ops `ONE_THREAD_MARGIN` times
  faster right now.

  On a shared, oversubscribed machine torch's thread pool can make each small op 10-50x slower than
  one thread (a parallel region waits for a descheduled worker); on a quiet one all cores win.
  Returns the choice and the probe (µs per small matmul + tanh at each setting), for the results.
  """
  import torch
  n_all = os.cpu_count() or 1
  x, w = torch.randn(16, 576), torch.randn(576, 576)
  probe = {}
  for n in sorted({1, n_all}):
    torch.set_num_threads(n)
    for _ in range(20):
      torch.tanh(x @ w)
    t0 = time.perf_counter()
    for _ in range(300):
      torch.tanh(x @ w)
    probe[n] = 1e6 * (time.perf_counter() - t0) / 300
  best = 1 if probe[1] * ONE_THREAD_MARGIN < probe[n_all] else n_all
  torch.set_num_threads(best)
  return {"threads": best, "thread_probe_us": {str(k): round(v, 1) for k, v in probe.items()}}
