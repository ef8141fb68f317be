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
import queue
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


class _Call:
  """One queued reward call: filled in by a lane, read by the batch that submitted it."""

  def __init__(self, fn: Callable, args: Sequence):
    self.fn, self.args, self.box = fn, args, {}
    self.started, self.done = threading.Event(), threading.Event()
    self.start_time = 0.0
    self.lock = threading.Lock()  # makes "finished" vs "given up on" one decision
    self.abandoned = False  # set by the waiter on timeout: the lane running it retires when it returns


class _LanePool:
  """Persistent daemon worker threads ("lanes") shared by every `safe_reward_batch` call.

  Why not a thread per call: starting 32 threads cost several ms per learner step, more than the
  rewards themselves. A lane whose call overruns is given up on and replaced at once, so hung calls
  never reduce the number of working lanes, and a queued call always gets a lane.
  """

  def __init__(self):
    self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._lanes = 0  # working lanes (a lane stuck on an abandoned call is no longer counted)

  def _lane(self) -> None:
    while True:
      call = self._queue.get()
      call.start_time = time.monotonic()
      call.started.set()
      finished = threading.Event()
      _run_into(call.box, call.fn, call.args, finished)
      with call.lock:
        call.done.set()
        if call.abandoned:  # a replacement lane was started when this call timed out
          return

  def _spawn(self) -> None:
    threading.Thread(target=self._lane, daemon=True, name="reward-lane").start()

  def run(self, fn: Callable, args_list: Sequence[Sequence[Any]], timeout_s: float,
          lanes: int) -> list[tuple[float, str]]:
    with self._lock:
      while self._lanes < lanes:
        self._lanes += 1
        self._spawn()
    calls = [_Call(fn, args) for args in args_list]
    for call in calls:
      self._queue.put(call)
    results = []
    for call in calls:  # FIFO: by the time call i is waited on, every earlier call freed or lost its lane
      call.started.wait()
      call.done.wait(max(0.0, call.start_time + timeout_s - time.monotonic()))
      with call.lock:
        if call.done.is_set():
          results.append((0.0, "error") if call.box.get("raised") else _as_reward(call.box.get("value")))
          continue
        call.abandoned = True
      self._spawn()  # replaces the lane stuck on this call
      results.append((0.0, "timeout"))
    return results


_LANES = _LanePool()


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

  Threads: the calls run on persistent worker threads shared across batches (at least
  ``max_workers`` of them); each call gets ``timeout_s`` from its own start, and a worker stuck on a
  timed-out call is replaced at once, so hung calls cost their own time limit and nothing more.
  Processes: chunks of ``max_workers`` fresh processes, each call timed from its process's start.
  """
  results: list[tuple[float, str]] = []
  if not use_process:
    results = _LANES.run(fn, args_list, timeout_s, max(1, max_workers))
  for start in range(0, len(args_list) if use_process else 0, max(1, max_workers)):
    handles = [_start_process(fn, args) for args in args_list[start:start + max(1, max_workers)]]
    results += [_process_result(h, timeout_s) for h in handles]
  status = tuple(s for _, s in results)
  return RewardBatch(reward_B=np.asarray([r for r, _ in results], dtype=np.float32),
                     status=status, counts=count_statuses(status))
