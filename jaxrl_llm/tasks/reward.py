"""Safety wrapper for user reward functions: time limit, exceptions → reward 0, counted.

Status of one call:
  "ok"       fn returned a finite number (bool/int/float/numpy scalar) with |r| <= ``max_abs``;
  "error"    fn raised, or returned something that is not such a number (NaN, inf, 1e300, a
             string, ...) → reward 0.0;
  "timeout"  fn did not return within ``timeout_s`` → reward 0.0.

Threads (default) are cheap, but Python cannot kill a thread: a timed-out call is interrupted by an
exception raised in its thread (`_Abandoned`, delivered between two Python bytecodes, so a call spinning in
Python code stops: it would otherwise hold a share of the GIL for good and starve the process, its exit
included), but a call blocked or spinning inside C code keeps running in a daemon thread (it cannot block
interpreter exit) until it returns on its own. At most
``MAX_STUCK_THREADS`` such threads are tolerated; beyond that, calls that find no working thread are
scored "timeout" at once (with a warning) instead of starting more threads. For reward code that
may hang or spin for good (a sympy simplification, a regex catastrophe), pass ``use_process=True``
(config ``reward.executor="process"``): calls then run in persistent ``spawn`` worker processes; a
call that overruns has its process killed and replaced, so it costs only its own sample and its
time limit, and no thread or process is leaked. Needs a picklable ``fn`` (a module-level function
or a bound method of a picklable object) and arguments; a worker's start-up (imports) is not
counted against ``timeout_s``. Workers are started with ``spawn``, which re-imports the main module:
a script that starts a run in process mode needs the usual ``if __name__ == "__main__":`` guard
(``python -m jaxrl_llm`` has it).

``executor="auto"`` (the default) takes the task's own choice (``Task.reward_executor``): worker
processes for the data-file tasks, whose math-verify/sympy checks can run unbounded while holding the
GIL (a thread would then freeze the whole process, its signal handlers included), threads for the
procedural tasks whose rewards are a few string operations. A reward that cannot be pickled runs on
threads, with a warning.

One time limit per call: a time-limited call made *inside* a reward that already runs under a limit
(a reward calling ``call_with_timeout``, as ``math_answer.math_reward`` does when used on its own) runs
inline, bounded by the outer limit. Sending it to the same pool would wait for a lane that the outer
calls hold, and score correct answers as timeouts.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import numbers
import pickle
import queue
import threading
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

STATUSES = ("ok", "error", "timeout")
# A spawned child must report that it started within this many seconds (imports can be slow on
# a loaded machine); the reward deadline starts after that.
_PROCESS_START_LIMIT_S = 120.0
DEFAULT_MAX_ABS = 1e6  # |reward| above this is treated as a bug in the reward function (an error)
MAX_STUCK_THREADS = 32  # thread mode: timed-out calls still running before new calls are refused
EXECUTORS = ("auto", "thread", "process")
# Set in a reward lane thread and in a worker process: a nested time-limited call runs inline there.
_LIMITED = threading.local()


@dataclasses.dataclass(frozen=True)
class RewardPolicy:
  """How rewards are computed (config `reward.*`): time limit, bound, thread or process workers."""
  timeout_s: float = 5.0
  max_abs: float = DEFAULT_MAX_ABS
  executor: str = "auto"  # "auto" (the task's choice, `resolve_executor`), "thread" or "process"
  workers: int = 8


@dataclasses.dataclass(frozen=True)
class RewardBatch:
  """Rewards of a batch of calls: ``reward_B`` float32, per-call ``status``, and status counts."""
  reward_B: np.ndarray
  status: tuple[str, ...]
  counts: dict[str, int]


def _as_reward(value: Any, max_abs: float = DEFAULT_MAX_ABS) -> tuple[float, str]:
  """Validates a returned value: finite real numbers within ±max_abs pass, everything else is an error."""
  if isinstance(value, (numbers.Real, np.bool_)):
    try:
      value = float(value)
    except OverflowError:  # a Python int beyond float range
      return 0.0, "error"
    if math.isfinite(value) and abs(value) <= max_abs:
      return value, "ok"
  if isinstance(value, np.ndarray) and value.shape == ():
    return _as_reward(value.item(), max_abs)
  return 0.0, "error"


class _Abandoned(BaseException):
  """Raised inside a lane thread whose call overran its time limit (`interrupt_thread`): user code that runs Python
  bytecode stops there; `_run_into` scores it like any failure (the call is already scored "timeout")."""


def interrupt_thread(thread_id: int) -> None:
  """Raises `_Abandoned` in thread `thread_id` at its next bytecode (CPython's PyThreadState_SetAsyncExc): stops
  Python code a time limit gave up on (an environment call, a harness); code inside a C call is not stopped."""
  import ctypes  # noqa: PLC0415
  ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(_Abandoned))


def _run_into(box: dict, fn: Callable, args: Sequence, done: threading.Event) -> None:
  try:
    box["value"] = fn(*args)
  except BaseException:  # pylint: disable=broad-except  # any failure of user code is "error"
    box["raised"] = True
  finally:
    done.set()


class _Batch:
  """One `safe_reward_batch` call shared by the lanes: each lane claims the next unclaimed call.

  `running` maps a claimed, unfinished call to its start time; the waiter gives up on a call that
  overran (`abandoned`), and the lane stuck in it retires when (if ever) it returns.
  """

  def __init__(self, fn: Callable, args_list: Sequence[Sequence[Any]], max_abs: float):
    self.fn, self.args, self.max_abs = fn, list(args_list), max_abs
    self.results: list[tuple[float, str] | None] = [None] * len(self.args)
    self.next = 0
    self.running: dict[int, float] = {}
    self.lanes: dict[int, int] = {}  # running call -> the thread id of the lane running it
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

  def give_up_unclaimed(self) -> int:
    """Scores every unclaimed call "timeout" (no lane left to run it); returns how many (under `lock`)."""
    n = len(self.args) - self.next
    for i in range(self.next, len(self.args)):
      self.record(i, (0.0, "timeout"))
    self.next = len(self.args)
    return n


class _LanePool:
  """Persistent daemon worker threads ("lanes") shared by every `safe_reward_batch` call.

  Why not a thread per call, or a queue item per call: starting threads, or waking a lane and the
  waiter once per call, costs far more than typical rewards (a batch of arithmetic rewards runs in
  microseconds). A batch is handed to up to `lanes` lanes at once; each claims calls until none are
  left, and the waiter sleeps until the batch is done or a running call reaches its deadline. A
  lane whose call overruns is given up on and replaced at once, so hung calls never reduce the
  number of working lanes and cost their own time limit only, until `max_stuck` lanes are stuck:
  then no replacement is started (the thread count stays bounded) and calls that find no working
  lane are scored "timeout" at once.
  """

  def __init__(self, max_stuck: int = MAX_STUCK_THREADS):
    self._queue: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._lanes = 0  # working lanes (a lane stuck on an abandoned call is no longer counted)
    self._stuck = 0  # lanes stuck in an abandoned call
    self.max_stuck = max_stuck
    self._warned = False

  def _lane(self) -> None:
    _LIMITED.active = True
    stuck = False  # this lane's call was abandoned: counted in `_stuck` until the lane retires
    try:
      while True:
        batch = self._queue.get()
        while True:
          with batch.lock:
            if batch.next >= len(batch.args):
              break
            i = batch.next
            batch.next += 1
            batch.running[i] = time.monotonic()
            batch.lanes[i] = threading.get_ident()
          box: dict = {}
          _run_into(box, batch.fn, batch.args[i], threading.Event())
          with batch.lock:
            batch.lanes.pop(i, None)
            if i in batch.abandoned:  # the waiter gave up on this call (and maybe started a replacement lane)
              stuck = True
              return
            batch.record(i, (0.0, "error") if box.get("raised") else _as_reward(box.get("value"), batch.max_abs))
    except _Abandoned:  # the interrupt of an abandoned call arrived after the call had returned
      stuck = True
    finally:
      if stuck:
        with self._lock:
          self._stuck -= 1

  def _spawn(self) -> None:
    threading.Thread(target=self._lane, daemon=True, name="reward-lane").start()

  def threads(self) -> int:
    """Reward threads alive or stuck (working + stuck lanes)."""
    with self._lock:
      return self._lanes + self._stuck

  def _warn_stuck(self) -> None:
    if not self._warned:
      self._warned = True
      warnings.warn(f"reward: {self._stuck} reward calls are still running past their time limit (the thread "
                    "limit); further calls that find no free thread score 0 as timeouts. Use "
                    "reward.executor='process' for rewards that can hang.", RuntimeWarning, stacklevel=3)

  def run(self, fn: Callable, args_list: Sequence[Sequence[Any]], timeout_s: float,
          lanes: int, max_abs: float = DEFAULT_MAX_ABS) -> list[tuple[float, str]]:
    with self._lock:
      while self._lanes < lanes and self._lanes + self._stuck < lanes + self.max_stuck:
        self._lanes += 1
        self._spawn()
      working = self._lanes
    batch = _Batch(fn, args_list, max_abs)
    if working == 0:
      with batch.lock:
        batch.give_up_unclaimed()
      self._warn_stuck()
      return batch.results
    for _ in range(min(working, len(batch.args))):
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
          if i in batch.lanes:  # still in the call (the lane needs `batch.lock` to leave it): stop Python code there
            interrupt_thread(batch.lanes[i])
          with self._lock:
            self._stuck += 1
            replace = self._lanes + self._stuck <= lanes + self.max_stuck
            if not replace:
              self._lanes -= 1
          if replace:
            self._spawn()  # replaces the lane stuck on call i ...
            self._queue.put(batch)  # ... and lets it help with the calls still unclaimed
          else:
            self._warn_stuck()
        with self._lock:
          no_lane = self._lanes == 0
        if no_lane and not batch.running:  # every lane is stuck: nobody will claim the rest
          batch.give_up_unclaimed()
    return batch.results


_LANES = _LanePool()


# ----------------------------------------------------------------------------------------------
# Process workers.


def _process_worker(conn) -> None:
  """Child side: for each (fn pickle or None = same fn as before, args) send ("started",), then
  ("value", v) or ("raised", None). Runs until the pipe closes or the parent kills it."""
  _LIMITED.active = True  # the parent's deadline bounds every call made here
  fn = None
  while True:
    try:
      blob, args = conn.recv()
    except (EOFError, OSError):
      return
    try:
      if blob is not None:
        fn = None
        fn = pickle.loads(blob)
    except BaseException:  # pylint: disable=broad-except  # an fn that cannot be loaded: every call errs
      pass
    conn.send(("started", None))
    try:
      out = ("value", fn(*args))
    except BaseException:  # pylint: disable=broad-except
      out = ("raised", None)
    try:
      conn.send(out)
    except BaseException:  # pylint: disable=broad-except  # an unpicklable result
      conn.send(("raised", None))


class _Worker:
  def __init__(self, ctx):
    self.conn, child = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=_process_worker, args=(child,), daemon=True, name="reward-process")
    self.proc.start()
    child.close()
    self.blob: bytes | None = None  # the fn pickle this worker holds

  def kill(self) -> None:
    self.proc.kill()
    self.proc.join()
    self.conn.close()


class _ProcessPool:
  """Persistent `spawn` worker processes shared by every process-mode call (thread-safe).

  A call runs in an idle worker (one is started when none is idle); an overrunning or crashed
  worker is killed and dropped, the others are reused. The number of processes is bounded by the
  largest number of calls ever running at once (`workers` per concurrent batch).
  """

  def __init__(self):
    self._ctx = multiprocessing.get_context("spawn")  # fork is unsafe once JAX has started threads
    self._idle: list[_Worker] = []
    self._lock = threading.Lock()
    atexit.register(self.close)

  def _take(self) -> _Worker | None:
    with self._lock:
      while self._idle:
        w = self._idle.pop()
        if w.proc.is_alive():
          return w
        w.kill()
    try:
      return _Worker(self._ctx)
    except Exception:  # pylint: disable=broad-except
      return None

  def _give(self, w: _Worker) -> None:
    with self._lock:
      self._idle.append(w)

  def processes(self) -> int:
    """Idle worker processes held (for tests)."""
    with self._lock:
      return len(self._idle)

  def close(self) -> None:
    with self._lock:
      idle, self._idle = self._idle, []
    for w in idle:
      w.kill()

  def run(self, fn: Callable, args_list: Sequence[Sequence[Any]], timeout_s: float, workers: int,
          max_abs: float = DEFAULT_MAX_ABS) -> list[tuple[float, str]]:
    results: list[tuple[float, str] | None] = [None] * len(args_list)
    try:
      blob = pickle.dumps(fn)
    except Exception:  # pylint: disable=broad-except  # e.g. a lambda: every call is an error
      return [(0.0, "error")] * len(args_list)
    pending = list(range(len(args_list)))[::-1]
    active: dict[Any, list] = {}  # conn -> [worker, call index, deadline, started]
    try:
      while pending or active:
        while pending and len(active) < max(1, workers):
          i = pending.pop()
          w = self._take()
          if w is None:
            results[i] = (0.0, "error")
            continue
          try:
            w.conn.send((None if w.blob == blob else blob, tuple(args_list[i])))
          except Exception:  # pylint: disable=broad-except  # unpicklable args (nothing was written) or a dead worker
            results[i] = (0.0, "error")
            self._give(w) if w.proc.is_alive() else w.kill()
            continue
          w.blob = blob
          active[w.conn] = [w, i, time.monotonic() + _PROCESS_START_LIMIT_S, False]
        if not active:
          continue
        wait_s = max(0.0, min(a[2] for a in active.values()) - time.monotonic())
        for conn in multiprocessing.connection.wait(list(active), timeout=wait_s):
          w, i, _, _ = entry = active[conn]
          try:
            kind, value = conn.recv()
          except (EOFError, OSError):  # the worker died (crashed, killed, out of memory)
            results[i] = (0.0, "error")
            del active[conn]
            w.kill()
            continue
          if kind == "started":  # the call's own clock starts now (worker start-up is not counted)
            entry[2], entry[3] = time.monotonic() + timeout_s, True
            continue
          results[i] = (0.0, "error") if kind == "raised" else _as_reward(value, max_abs)
          del active[conn]
          self._give(w)
        now = time.monotonic()
        for conn, (w, i, deadline, started) in list(active.items()):
          if now >= deadline:
            results[i] = (0.0, "timeout" if started else "error")
            del active[conn]
            w.kill()  # the only way to stop a hung or spinning call
    finally:
      for w, *_ in active.values():  # interrupted (KeyboardInterrupt): nothing left running
        w.kill()
    return results


_PROCESSES = _ProcessPool()


def in_limited_call() -> bool:
  """Whether this code runs inside a reward call that a time limit already bounds (a lane or a worker)."""
  return getattr(_LIMITED, "active", False)


def _inline(fn: Callable, args: Sequence, max_abs: float) -> tuple[float, str]:
  try:
    value = fn(*args)
  except Exception:  # pylint: disable=broad-except  # any failure of user code is "error"
    return 0.0, "error"
  return _as_reward(value, max_abs)


def call_with_timeout(fn: Callable[..., Any], args: Sequence[Any], timeout_s: float, *,
                      use_process: bool = False, max_abs: float = DEFAULT_MAX_ABS) -> tuple[float, str]:
  """Calls ``fn(*args)`` under a time limit; returns ``(reward, status)``. Never raises.

  Inside a call that is already time-limited (`in_limited_call`) it runs inline: the outer limit holds.
  """
  if in_limited_call():
    return _inline(fn, args, max_abs)
  if use_process:
    return _PROCESSES.run(fn, [args], timeout_s, 1, max_abs)[0]
  return _LANES.run(fn, [args], timeout_s, 1, max_abs)[0]


def safe_reward(fn: Callable[..., Any], timeout_s: float = 5.0, *, use_process: bool = False,
                max_abs: float = DEFAULT_MAX_ABS) -> Callable[..., tuple[float, str]]:
  """Wraps ``fn`` so that ``wrapped(*args) -> (reward, status)``; see the module docstring."""
  def wrapped(*args):
    return call_with_timeout(fn, args, timeout_s, use_process=use_process, max_abs=max_abs)
  return wrapped


def count_statuses(status: Sequence[str]) -> dict[str, int]:
  """``{"ok": n, "error": n, "timeout": n}`` for a sequence of statuses."""
  return {s: sum(1 for x in status if x == s) for s in STATUSES}


def safe_reward_batch(fn: Callable[..., Any], args_list: Sequence[Sequence[Any]],
                      timeout_s: float = 5.0, *, max_workers: int = 8,
                      use_process: bool = False, max_abs: float = DEFAULT_MAX_ABS) -> RewardBatch:
  """Calls ``fn(*args)`` for every ``args`` in ``args_list``, ``max_workers`` at a time.

  Threads: the calls run on persistent worker threads shared across batches (at least
  ``max_workers`` of them); each call gets ``timeout_s`` from its own start, and a worker stuck on a
  timed-out call is replaced at once, so hung calls cost their own time limit and nothing more.
  Processes: persistent worker processes, each call timed from its start in its worker; an
  overrunning worker is killed and replaced.
  """
  run = _PROCESSES.run if use_process else _LANES.run
  results = run(fn, args_list, timeout_s, max(1, max_workers), max_abs)
  status = tuple(s for _, s in results)
  return RewardBatch(reward_B=np.asarray([r for r, _ in results], dtype=np.float32),
                     status=status, counts=count_statuses(status))


_UNPICKLABLE_WARNED: set[str] = set()


def resolve_executor(executor: str, fn: Callable[..., Any], preferred: str = "thread") -> str:
  """"thread" or "process" for `executor` ("auto": `preferred`, the task's choice); an "auto" that
  would pick processes for a reward that cannot be pickled picks threads instead, with a warning."""
  if executor != "auto":
    return executor
  if preferred == "process":
    try:
      pickle.dumps(fn)
    except Exception as e:  # pylint: disable=broad-except  # a lambda or a closure
      name = getattr(fn, "__qualname__", type(fn).__name__)
      if name not in _UNPICKLABLE_WARNED:
        _UNPICKLABLE_WARNED.add(name)
        warnings.warn(f"reward: {name} cannot be pickled ({type(e).__name__}), so reward.executor='auto' runs it "
                      "on threads, which cannot stop a call that hangs inside C code; make it a module-level "
                      "function to get killable worker processes", RuntimeWarning, stacklevel=2)
      return "thread"
  return preferred


def score_batch(fn: Callable[..., Any], args_list: Sequence[Sequence[Any]], policy: RewardPolicy,
                preferred: str = "thread") -> RewardBatch:
  """`safe_reward_batch` under a `RewardPolicy` (the run's `reward.*` config); `preferred` is the
  executor that "auto" stands for (the task's `reward_executor`)."""
  use_process = resolve_executor(policy.executor, fn, preferred) == "process"
  return safe_reward_batch(fn, args_list, policy.timeout_s, max_workers=policy.workers,
                           use_process=use_process, max_abs=policy.max_abs)
