"""Safety wrapper for user reward functions: time limit, exceptions → reward 0, counted.

Status of one call:
  "ok"       fn returned a finite number (bool/int/float/numpy scalar); that is the reward;
  "error"    fn raised, or returned something that is not a finite number → reward 0.0;
  "timeout"  fn did not return within ``timeout_s`` → reward 0.0.

Threads (default) are cheap, but Python cannot kill a thread: a timed-out call keeps running in a
daemon thread (it cannot block interpreter exit) until it returns on its own. For reward code
that may hang for good inside C (a sympy simplification, a regex catastrophe), pass
``use_process=True``: each call then runs in a fresh ``spawn`` process that is killed at the
deadline. That costs a process start per call (~0.1–1 s, not counted against ``timeout_s``) and
requires a picklable (module-level) ``fn`` and arguments.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import numbers
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

STATUSES = ("ok", "error", "timeout")
# A spawned child must report that it started within this many seconds (imports can be slow on
# a loaded machine); the reward deadline starts after that.
_PROCESS_START_LIMIT_S = 120.0


@dataclasses.dataclass(frozen=True)
class RewardBatch:
  """Rewards of a batch of calls: ``reward_B`` float32, per-call ``status``, and status counts."""
  reward_B: np.ndarray
  status: tuple[str, ...]
  counts: dict[str, int]


def _as_reward(value: Any) -> tuple[float, str]:
  """Validates a returned value: finite real numbers pass, everything else is an error."""
  if isinstance(value, (numbers.Real, np.bool_)):
    value = float(value)
    if math.isfinite(value):
      return value, "ok"
  if isinstance(value, np.ndarray) and value.shape == ():
    return _as_reward(value.item())
  return 0.0, "error"


def _run_into(box: dict, fn: Callable, args: Sequence, done: threading.Event) -> None:
  try:
    box["value"] = fn(*args)
  except BaseException:  # pylint: disable=broad-except  # any failure of user code is "error"
    box["raised"] = True
  finally:
    done.set()


def _start_thread(fn, args):
  box, done = {}, threading.Event()
  threading.Thread(target=_run_into, args=(box, fn, args, done), daemon=True).start()
  return box, done


def _thread_result(box: dict, done: threading.Event, deadline: float) -> tuple[float, str]:
  if not done.wait(max(0.0, deadline - time.monotonic())):
    return 0.0, "timeout"
  if box.get("raised"):
    return 0.0, "error"
  return _as_reward(box.get("value"))


def _process_entry(conn, fn, args) -> None:
  """Child side: send its start time, then ("value", v) or ("raised", None)."""
  conn.send(("started", time.time()))
  try:
    conn.send(("value", fn(*args)))
  except BaseException:  # pylint: disable=broad-except
    conn.send(("raised", None))


def _start_process(fn, args):
  ctx = multiprocessing.get_context("spawn")  # fork is unsafe once JAX has started threads
  parent, child = ctx.Pipe(duplex=False)
  proc = ctx.Process(target=_process_entry, args=(child, fn, args), daemon=True)
  try:
    proc.start()
  except Exception:  # pylint: disable=broad-except  # e.g. an unpicklable fn
    return None
  finally:
    child.close()
  return proc, parent


def _process_result(handle, timeout_s: float) -> tuple[float, str]:
  if handle is None:
    return 0.0, "error"
  proc, conn = handle
  try:
    if not conn.poll(_PROCESS_START_LIMIT_S):
      return 0.0, "error"
    _, started_at = conn.recv()
    # time.time() is shared across processes, so the deadline counts from the child's start.
    if not conn.poll(max(0.0, started_at + timeout_s - time.time())):
      return 0.0, "timeout"
    kind, value = conn.recv()
    return (0.0, "error") if kind == "raised" else _as_reward(value)
  except (EOFError, OSError):  # child died (killed, crashed, unpicklable result)
    return 0.0, "error"
  finally:
    proc.kill()
    proc.join()
    conn.close()


def call_with_timeout(fn: Callable[..., Any], args: Sequence[Any], timeout_s: float, *,
                      use_process: bool = False) -> tuple[float, str]:
  """Calls ``fn(*args)`` under a time limit; returns ``(reward, status)``. Never raises."""
  if use_process:
    return _process_result(_start_process(fn, args), timeout_s)
  box, done = _start_thread(fn, args)
  return _thread_result(box, done, time.monotonic() + timeout_s)


def safe_reward(fn: Callable[..., Any], timeout_s: float = 5.0, *,
                use_process: bool = False) -> Callable[..., tuple[float, str]]:
  """Wraps ``fn`` so that ``wrapped(*args) -> (reward, status)``; see the module docstring."""
  def wrapped(*args):
    return call_with_timeout(fn, args, timeout_s, use_process=use_process)
  return wrapped


def count_statuses(status: Sequence[str]) -> dict[str, int]:
  """``{"ok": n, "error": n, "timeout": n}`` for a sequence of statuses."""
  return {s: sum(1 for x in status if x == s) for s in STATUSES}


def safe_reward_batch(fn: Callable[..., Any], args_list: Sequence[Sequence[Any]],
                      timeout_s: float = 5.0, *, max_workers: int = 8,
                      use_process: bool = False) -> RewardBatch:
  """Calls ``fn(*args)`` for every ``args`` in ``args_list``, ``max_workers`` at a time.

  Each call gets ``timeout_s`` from the start of its chunk. A timed-out thread keeps its worker
  slot only until the chunk ends: later chunks start fresh threads, so one hung call cannot
  stall the batch for longer than ``timeout_s``.
  """
  results: list[tuple[float, str]] = []
  for start in range(0, len(args_list), max(1, max_workers)):
    chunk = args_list[start:start + max(1, max_workers)]
    if use_process:
      handles = [_start_process(fn, args) for args in chunk]
      results += [_process_result(h, timeout_s) for h in handles]
    else:
      handles = [_start_thread(fn, args) for args in chunk]
      deadline = time.monotonic() + timeout_s
      results += [_thread_result(box, done, deadline) for box, done in handles]
  status = tuple(s for _, s in results)
  return RewardBatch(reward_B=np.asarray([r for r, _ in results], dtype=np.float32),
                     status=status, counts=count_statuses(status))
