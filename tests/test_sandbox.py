"""Sandboxed tool calls (issue 48, item 3): a tool that loops, allocates without bound, sleeps past its wall limit,
opens a socket (also when it swallows the refusal) or starts a process is stopped and named; one that raises is an
ordinary failure; a ToolEnv ends the episode of a stopped call and counts it; the calculator answers the same
sandboxed. Limits are generous where a test does not test them: nothing here depends on how loaded the machine is
(a wall overrun is a wall overrun however slowly the child started)."""

import json
import sys

import pytest

from jaxrl_llm import envs
from jaxrl_llm.envs import sandbox
from jaxrl_llm.envs.tools import TOOL_COUNTERS, ToolEnv

TOOLS = '''
import os, socket, subprocess, time


def add(a: int, b: int) -> str:
  """Adds.

  Args:
    a: a number.
    b: a number.
  """
  with open("note.txt", "w") as f:  # the scratch directory is the working directory, writable
    f.write("x")
  return str(a + b) + " in " + os.path.basename(os.getcwd())[:13]


def spin() -> str:
  """Loops."""
  while True:
    pass


def hog() -> str:
  """Allocates."""
  a = []
  while True:
    a.append(bytearray(10**7))


def dial() -> str:
  """Opens a socket."""
  socket.create_connection(("127.0.0.1", 9), timeout=5)
  return "connected"


def sneaky() -> str:
  """Swallows the refusal."""
  try:
    socket.socket()
  except PermissionError:
    pass
  return "fine"


def spawn() -> str:
  """Starts a process."""
  return subprocess.run(["echo", "x"], capture_output=True, text=True).stdout


def nap() -> str:
  """Sleeps."""
  time.sleep(120)
  return "late"


def boom() -> str:
  """Raises."""
  raise KeyError("k")
'''

WIDE = sandbox.Limits(cpu_s=30, memory_mb=256, wall_s=120)


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
  d = tmp_path_factory.mktemp("sandboxed")
  (d / "sandboxed_tools.py").write_text(TOOLS)
  sys.path.insert(0, str(d))
  try:
    import sandboxed_tools
    yield sandboxed_tools
  finally:
    sys.path.remove(str(d))


@pytest.mark.parametrize("name,limits,violation,message", [
    ("spin", dict(cpu_s=1), "cpu", "CPU-time limit (1 s)"),
    ("hog", dict(memory_mb=64), "memory", "memory limit (64 MB)"),
    ("nap", dict(wall_s=2), "wall", "wall-clock limit (2 s)"),
    ("dial", {}, "network", "network access is not allowed"),
    ("sneaky", {}, "network", "network access is not allowed"),
    ("spawn", {}, "process", "starting a process is not allowed"),
])
def test_each_limit_stops_its_call_and_names_it(tools, name, limits, violation, message):
  content, ok, got = sandbox.call(getattr(tools, name), {}, dataclass_replace(WIDE, **limits))
  assert (ok, got) == (False, violation) and content == f"error: sandbox: {message}"


def dataclass_replace(limits, **kw):
  import dataclasses
  return dataclasses.replace(limits, **kw)


def test_a_tool_that_returns_or_raises_is_answered_as_unsandboxed(tools):
  assert sandbox.call(tools.add, {"a": 2, "b": 3}, WIDE) == ("5 in jaxrl_sandbox", True, None)
  assert sandbox.call(tools.boom, {}, WIDE) == ("error: KeyError: 'k'", False, None)
  assert sandbox.call(tools.add, {"a": 1}, WIDE)[1:] == (False, None)  # a missing argument: the tool's TypeError
  assert sandbox.isolation() in ("namespace", "audit hook")


class Tools(ToolEnv):
  def first_message(self, seed):
    return "go"

  def score(self, answer_text):
    return 1.0


def _call(name, **arguments):
  return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_a_tool_env_ends_the_episode_of_a_stopped_call_and_counts_it(tools):
  env = Tools([tools.add, tools.spin], sandbox={"cpu_s": 1, "wall_s": 120})
  counts = lambda **kw: {k: kw.get(k, 0) for k in TOOL_COUNTERS}  # noqa: E731
  env.reset(0)
  assert env.step(_call("add", a=1, b=2)) == (
      [{"role": "tool", "content": "3 in jaxrl_sandbox"}], 0.0, False, counts(tool_calls=1))
  assert env.step(_call("spin")) == ("", 0.0, True, counts(tool_calls=1, tool_failed=1, tool_killed=1))
  def inner(x: int) -> str:
    """A closure.

    Args:
      x: a number.
    """
    return str(x)
  with pytest.raises(ValueError, match="'inner' cannot be sandboxed: it is not a module-level function"):
    Tools([inner], sandbox=True)
  with pytest.raises(ValueError, match="sandbox has no field 'cpu'"):
    Tools([tools.add], sandbox={"cpu": 1})
  with pytest.raises(ValueError, match="sandbox wall_s=0: must be a number > 0"):
    Tools([tools.add], sandbox={"wall_s": 0})


def test_the_calculator_answers_the_same_in_the_sandbox():
  plain = envs.get("gsm8k_calculator")
  boxed = envs.get("gsm8k_calculator", sandbox={"wall_s": 120})
  for env in (plain, boxed):
    env.reset(3)
  action = _call("calculator", expression="(48 + 24) / 5")
  assert boxed.step(action) == plain.step(action) == (
      [{"role": "tool", "content": "14.4"}], 0.0, False, {**dict.fromkeys(TOOL_COUNTERS, 0), "tool_calls": 1})
