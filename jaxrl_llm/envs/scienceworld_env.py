"""ScienceWorld's science-experiment tasks as a text environment (`envs.get("scienceworld", task="boil")`).

ScienceWorld (Wang et al., 2022; a benchmark of EPO) is a text simulator written in Scala: its wheel bundles the
jar and starts it as a Java process reached through py4j. Needs the `envs` extra (`pip install 'jaxrl_llm[envs]'`)
and Java 8 or newer on PATH (the jar's classes are Java 8; measured with OpenJDK 17). The package is imported and
Java is looked up when an instance is made, so importing this module needs neither.

The adapter drives the jar's `PythonInterface` (the object the package's `ScienceWorldEnv` wraps) with the same
rules as `ScienceWorldEnv` 1.2.3, minus what an episode does not use:

- `reset(seed)`: loads `task` at variation `vs[seed % len(vs)]`, with `vs` the task's `variations` set
  ("train" | "dev" | "test": ScienceWorld's split of the task's variations; e.g. boil: 30 variations, train 0-13,
  dev 14-20, test 21-29), resets it and returns the task description, a blank line, and the first observation
  (the output of "look around", which is not a move). The same seed gives the same text and the same game.
- `step(action)`: the action is the first non-empty line of the policy's text, stripped (ScienceWorld reads one
  command; a newline or trailing words make any command unreadable). ScienceWorld's score is 0-100 (-100 once the
  task is failed, e.g. by focusing on the wrong substance); the step reward is `reward_scale` times the change of
  the score since the previous call, so the episode's return is `reward_scale` times (final score - score after
  reset), i.e. 1.0 for a solved task and -1.0 for a failed one with the default 0.01 (the score after reset is 0
  on the tasks measured). Done: the task is completed, the score is negative (failed), or more than
  `step_limit` moves were made (ScienceWorld's rule: `moves > step_limit`; an action it cannot read is no move).
- Unreadable actions are not an `InvalidAction`: ScienceWorld answers "No known action matches that input."
  (`UNKNOWN_ACTION`) or "It's not clear how to get there from here.", the score is unchanged, and the episode goes
  on, so the policy sees the feedback and can retry; only the runner's turn and token limits end such an episode.
- `observation="obs+look"`: each observation is followed by a blank line and the room's description ("look
  around", a free action), unless the observation already is that description.
- Not computed: the list of valid actions, inventory and look that `ScienceWorldEnv.step` builds at every step
  (~0.1-0.2 s a step there; ~10-20 ms a step here).

JVMs: starting one takes ~2-5 s and ~0.1 GB before any game, so a JVM is never started per step or per
episode. An instance takes a JVM from a process-wide pool of idle ones at `reset` (starting a new one only when
none is idle) and gives it back when its episode ends (`done`), at `close()`, or when the instance is garbage
collected (the runner makes one instance per episode row and drops them after the batch); the next `reset`
in that JVM loads the task again (~0.4-3 s, ~6 s with `gold_path`). So a process holds as many JVMs as
episodes ever ran at once: a batch of B rows keeps B JVMs, and up to B + `reward.workers` in the runner, whose
worker threads keep a reference to their last batch of calls (hence to its instances) until they get the next
one: the first resets of the next batch may start a JVM before the previous rows' are back (bounded: the extra
JVMs are idle and reused from then on). Memory: each JVM's heap is capped at `jvm_heap_mb`
(default 512: a JVM then stays at ~0.3-0.45 GB resident over many episodes, measured; uncapped, Java takes a
quarter of the machine's memory as its limit and a JVM grew to ~1.1 GB), so 32 rows cost ~10-15 GB.
`close_idle()` ends the idle JVMs; all of them end with the Python process.

Timeouts: the runner abandons a call that overruns its time limit, and the call goes on in its worker thread.
The JVM is never shared while a call runs in it: an instance gives its JVM back only between calls (a `close()`
during a call takes effect when the call returns; collection cannot happen while the worker holds the bound
method). A JVM whose call raised (the process died, a Java exception) is ended, not given back; a call that
never returns keeps its JVM out of the pool for good, and the pool starts another when needed.
"""

from __future__ import annotations

import collections
import contextlib
import math
import shutil
import threading
from typing import Any

from jaxrl_llm.envs import register

VARIATION_SETS = ("train", "dev", "test")
OBSERVATIONS = ("obs", "obs+look")
# ScienceWorld's simplifications ("easy" = all of them; for the electrical tasks all but noElectricalAction).
SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors",
                   "noElectricalAction")
UNKNOWN_ACTION = "No known action matches that input."  # ScienceWorld's answer to an action it cannot read
JAVA_HELP = "Java 8 or newer on PATH (e.g. apt-get install openjdk-17-jre-headless)"


def import_scienceworld():
  """The scienceworld module, or an ImportError that names the extra to install."""
  try:
    import scienceworld
  except ImportError as e:
    raise ImportError("the 'scienceworld' environment needs scienceworld: pip install 'jaxrl_llm[envs]'") from e
  return scienceworld


def require_java() -> str:
  """The path of `java` on PATH, or a RuntimeError that says what to install."""
  java = shutil.which("java")
  if java is None:
    raise RuntimeError(f"the 'scienceworld' environment runs ScienceWorld's simulator in Java: it needs {JAVA_HELP}; "
                       "no 'java' executable was found on PATH")
  return java


def action_line(text: str) -> str:
  """The command ScienceWorld is given for the policy's text: its first non-empty line, stripped ("" if none)."""
  for line in text.splitlines():
    if line.strip():
      return line.strip()
  return ""


class Jvm:
  """One ScienceWorld simulator: a Java process with the jar and its `PythonInterface` (`server`)."""

  def __init__(self, heap_mb: int):
    from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
    from scienceworld.constants import BASEPATH, JAR_PATH
    # die_on_exit: the JVM ends when this Python process does (it watches its stdin).
    port, self.proc = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH,
                                     javaopts=[f"-Xmx{heap_mb}m"], return_proc=True)
    self.heap_mb = heap_mb
    try:
      self.gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port),
                                 java_process=self.proc)
      self.server = self.gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
    except BaseException:
      self.proc.kill()  # started but not reachable: do not leave the process behind
      raise

  def alive(self) -> bool:
    return self.proc.poll() is None

  def close(self) -> None:
    """Ends the Java process (it holds no state worth saving)."""
    with contextlib.suppress(Exception):
      self.gateway.shutdown()
    if self.proc.poll() is None:
      self.proc.kill()
    with contextlib.suppress(Exception):
      self.proc.wait(timeout=10)


# The pool of idle JVMs by heap size (deque append / pop are atomic: usable from __del__ without a lock).
_IDLE: dict[int, collections.deque] = collections.defaultdict(collections.deque)
_VARIATIONS: dict[tuple[str, str], tuple[int, ...]] = {}  # (task, set) -> variation indices


def acquire(heap_mb: int):
  """An idle JVM of `heap_mb` from the pool (dead ones are dropped), else a new `Jvm(heap_mb)`."""
  idle = _IDLE[heap_mb]
  while True:
    try:
      jvm = idle.pop()
    except IndexError:
      return Jvm(heap_mb)
    if jvm.alive():
      return jvm
    jvm.close()


def release(jvm) -> None:
  """Gives `jvm` back to the pool (a dead one is closed instead)."""
  if jvm.alive():
    _IDLE[jvm.heap_mb].append(jvm)
  else:
    jvm.close()


def idle_count() -> int:
  """Idle JVMs in the pool."""
  return sum(len(d) for d in _IDLE.values())


def close_idle() -> int:
  """Ends every idle JVM (frees their memory); returns how many. JVMs held by instances are not touched."""
  n = 0
  for idle in list(_IDLE.values()):
    while True:
      try:
        jvm = idle.pop()
      except IndexError:
        break
      jvm.close()
      n += 1
  return n


def variations(server, task: str, which: str) -> tuple[int, ...]:
  """The variation indices of `task` in set `which` (ScienceWorld's split; asked once per process: it needs the
  task loaded in `server`)."""
  k = (task, which)
  if k not in _VARIATIONS:
    server.load(task, 0, "", False)
    got = getattr(server, f"getVariations{which.capitalize()}")()  # getVariationsTrain / Dev / Test
    _VARIATIONS[k] = tuple(int(v) for v in got)
    if not _VARIATIONS[k]:
      raise ValueError(f"scienceworld task={task!r} has no {which!r} variations")
  return _VARIATIONS[k]


@register("scienceworld")
class ScienceWorld:
  """A ScienceWorld task (module docstring).

  Args:
    task: a ScienceWorld task name, e.g. "boil", "melt", "find-living-thing" (`scienceworld`'s 30 tasks).
    simplification: "easy" (default), "" (none) or a comma-separated list of `SIMPLIFICATIONS`.
    step_limit: done after more than this many moves.
    variations: "train", "dev" or "test": the variation set `reset(seed)` draws from (`seed % len(set)`).
    reward_scale: multiplies the score change (score 0-100; 0.01: a solved task returns 1.0).
    observation: "obs" (default) or "obs+look" (module docstring).
    gold_path: tests and demos only: ScienceWorld also plans a winning action sequence at every load (`gold_actions`;
      loads take ~2x longer).
    jvm_heap_mb: the Java heap cap of the JVMs this instance uses (pooled per value).
  """

  def __init__(self, task: str = "boil", simplification: str = "easy", step_limit: int = 100,
               variations: str = "train", reward_scale: float = 0.01, observation: str = "obs",
               gold_path: bool = False, jvm_heap_mb: int = 512):
    if variations not in VARIATION_SETS:
      raise ValueError(f"variations={variations!r}: must be one of {', '.join(VARIATION_SETS)}")
    if observation not in OBSERVATIONS:
      raise ValueError(f"observation={observation!r}: must be one of {', '.join(OBSERVATIONS)}")
    parts = simplification.split(",") if isinstance(simplification, str) else [repr(simplification)]
    bad = [p for p in parts if p and p not in SIMPLIFICATIONS]
    if bad:
      raise ValueError(f"simplification={simplification!r}: must be '' or a comma-separated list of "
                       f"{', '.join(SIMPLIFICATIONS)} (not {', '.join(bad)})")
    if not isinstance(step_limit, int) or isinstance(step_limit, bool) or step_limit < 1:
      raise ValueError(f"step_limit={step_limit!r}: must be an int >= 1")
    if isinstance(reward_scale, bool) or not isinstance(reward_scale, (int, float)) or not (
        math.isfinite(reward_scale) and reward_scale > 0):
      raise ValueError(f"reward_scale={reward_scale!r}: must be a finite number > 0")
    if not isinstance(jvm_heap_mb, int) or isinstance(jvm_heap_mb, bool) or jvm_heap_mb < 64:
      raise ValueError(f"jvm_heap_mb={jvm_heap_mb!r}: must be an int >= 64 (megabytes)")
    import_scienceworld()
    from scienceworld.constants import ID2TASK
    if task not in ID2TASK.values():
      raise ValueError(f"scienceworld task={task!r} is not a ScienceWorld task (e.g. boil, melt, freeze, "
                       f"find-living-thing; all: {', '.join(sorted(ID2TASK.values()))})")
    electrical = "power-component" in task or "conductivity" in task
    if electrical and "noElectricalAction" in simplification.split(","):
      raise ValueError(f"simplification={simplification!r}: task {task!r} needs the electrical actions")
    require_java()
    self.task, self.simplification, self.step_limit = task, simplification, step_limit
    self.variations, self.reward_scale, self.observation = variations, float(reward_scale), observation
    self.gold_path, self.jvm_heap_mb = gold_path, jvm_heap_mb
    self.variation: int | None = None  # the variation index of the current episode
    self._jvm: Any = None
    self._lock = threading.Lock()  # guards _busy / _close_requested (a close() from another thread)
    self._busy = False
    self._close_requested = False
    self._done = False
    self._score = 0
    self._gold: list[str] = []

  # --- the JVM this instance holds

  @contextlib.contextmanager
  def _call(self, new_game: bool = False):
    """Runs a block of JVM calls: the JVM is not given back meanwhile; it is ended if the block raises, and given
    back after it if `close()` was called meanwhile. `new_game`: a JVM is taken from the pool if none is held;
    otherwise the episode's own JVM is needed."""
    with self._lock:
      if self._jvm is None:
        if not new_game:
          raise RuntimeError("this episode's JVM is gone (closed, or a call in it failed): reset first")
        self._jvm = acquire(self.jvm_heap_mb)
      self._busy, self._close_requested = True, False
    try:
      yield self._jvm.server
    except BaseException:
      jvm, self._jvm = self._jvm, None
      if jvm is not None:
        jvm.close()
      raise
    finally:
      with self._lock:
        self._busy = False
        closing = self._close_requested
      if closing:
        self.close()

  def close(self) -> None:
    """Gives the JVM back to the pool (at once, or when a call running in it returns)."""
    with self._lock:
      if self._busy:
        self._close_requested = True
        return
      jvm, self._jvm = self._jvm, None
    if jvm is not None:
      release(jvm)

  def __del__(self):
    jvm = getattr(self, "_jvm", None)
    if jvm is not None and not getattr(self, "_busy", False):
      self._jvm = None
      with contextlib.suppress(Exception):  # e.g. at interpreter exit (the JVMs end with the process anyway)
        release(jvm)

  # --- the Env interface

  def _observe(self, server, obs: str) -> str:
    if self.observation == "obs+look":
      look = server.freeActionLook()
      return obs if obs.strip() == look.strip() else f"{obs}\n\n{look}"
    return obs

  def reset(self, seed: int) -> str:
    self._done, self._gold = False, []
    with self._call(new_game=True) as server:
      vs = variations(server, self.task, self.variations)
      self.variation = vs[seed % len(vs)]
      server.load(self.task, self.variation, self.simplification, bool(self.gold_path))
      server.reset()
      obs = server.step("look around")  # ScienceWorld's first observation (not a move)
      self._score = round(100 * server.getScore())
      if self.gold_path:
        self._gold = [str(a) for a in server.getGoldActionSequence()]
      return f"{server.getTaskDescription()}\n\n{self._observe(server, obs)}"

  def step(self, action_text: str) -> tuple[str, float, bool]:
    if self.variation is None:
      raise RuntimeError("step before reset")
    if self._done:
      raise RuntimeError("step after the episode ended")
    with self._call() as server:
      obs = server.step(action_line(action_text))
      score = round(100 * server.getScore())  # ScienceWorld's 0-1 score as its integer 0-100 (as ScienceWorldEnv)
      done = bool(server.getCompleted()) or server.getNumMoves() > self.step_limit or score < 0
      obs = self._observe(server, obs)
    reward, self._score = self.reward_scale * (score - self._score), score
    if done:
      self._done = True
      self.close()
    return obs, reward, done

  def gold_actions(self) -> list[str]:
    """ScienceWorld's winning action sequence for the current episode (needs `gold_path=True`; tests, demos)."""
    if not self.gold_path or self.variation is None:
      raise RuntimeError("gold_actions needs gold_path=True and a reset")
    return list(self._gold)
