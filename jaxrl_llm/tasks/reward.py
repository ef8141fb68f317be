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


class _Batch:
  """One `safe_reward_batch` call shared by the lanes: each lane claims the next unclaimed call.

  `running` maps a claimed, unfinished call to its start time; the waiter gives up on a call that
  overran (`abandoned`), and the lane stuck in it retires when (if ever) it returns.
  """

  def __init__(self, fn: Callable, args_list: Sequence[Sequence[Any]]):
    self.fn, self.args = fn, list(args_list)
    self.results: list[tuple[float, str] | None] = [None] * len(self.args)
    self.next = 0
    self.running: dict[int, float] = {}
    self.abandoned: set[int] = set()
    self.finished = 0
    self.lock = threading.Lock()
    self.all_done = threading.Event()
    if not self.args:
      self.all_done.set()

  def record(self, i: int, result: tuple[float, str]) -> None:
    """Stores call i's result (under `lock`)."""
    self.results[i] = result
    self.running.pop(i, None)
    self.finished += 1
    if self.finished == len(self.args):
      self.all_done.set()


class _LanePool:
  """Persistent daemon worker threads ("lanes") shared by every `safe_reward_batch` call.

  Why not a thread per call, or a queue item per call: starting threads, or waking a lane and the
  waiter once per call, costs far more than typical rewards (a batch of arithmetic rewards runs in
  microseconds). A batch is handed to up to `lanes` lanes at once; each claims calls until none are
  left, and the waiter sleeps until the batch is done or a running call reaches its deadline. A
  lane whose call overruns is given up on and replaced at once, so hung calls never reduce the
  number of working lanes and cost their own time limit only.
  """

  def __init__(self):
    self._queue: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._lanes = 0  # working lanes (a lane stuck on an abandoned call is no longer counted)

  def _lane(self) -> None:
    while True:
      batch = self._queue.get()
      while True:
        with batch.lock:
          if batch.next >= len(batch.args):
            break
          i = batch.next
          batch.next += 1
          batch.running[i] = time.monotonic()
        box: dict = {}
        _run_into(box, batch.fn, batch.args[i], threading.Event())
        with batch.lock:
          if i in batch.abandoned:  # the waiter gave up on this call and started a replacement lane
            return
          batch.record(i, (0.0, "error") if box.get("raised") else _as_reward(box.get("value")))

  def _spawn(self) -> None:
    threading.Thread(target=self._lane, daemon=True, name="reward-lane").start()

  def run(self, fn: Callable, args_list: Sequence[Sequence[Any]], timeout_s: float,
          lanes: int) -> list[tuple[float, str]]:
    with self._lock:
      while self._lanes < lanes:
        self._lanes += 1
        self._spawn()
    batch = _Batch(fn, args_list)
    for _ in range(min(lanes, len(batch.args))):
      self._queue.put(batch)
    while not batch.all_done.is_set():
      with batch.lock:  # sleep until the earliest running call's deadline (or a full timeout)
        deadline = min(batch.running.values(), default=time.monotonic()) + timeout_s
      if batch.all_done.wait(max(0.0, deadline - time.monotonic())):
        break
      with batch.lock:
        now = time.monotonic()
        overdue = [i for i, start in batch.running.items() if now - start >= timeout_s]
        for i in overdue:
          batch.abandoned.add(i)
          batch.record(i, (0.0, "timeout"))
          self._spawn()  # replaces the lane stuck on call i ...
          self._queue.put(batch)  # ... and lets it help with the calls still unclaimed
    return batch.results


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
