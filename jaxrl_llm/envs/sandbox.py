"""Tool calls in a sandbox: each call in a fresh Python process with CPU-time, memory and wall-clock limits, no
network, no new processes, and a scratch directory of its own (LEGO-RL's point: agent code the policy writes must not
take the trainer down).

  limits = sandbox.Limits(cpu_s=5, memory_mb=256, wall_s=10)
  content, ok, violation = sandbox.call(calculator, {"expression": "1+1"}, limits)

`ToolEnv(functions, sandbox=limits)` runs every call so (`envs.tools`); `gsm8k_calculator` takes
`env.kwargs.sandbox={"cpu_s": ..., ...}`. A tool must be a module-level function (the child imports it by module and
qualified name, under the parent's `sys.path`): a closure, a lambda or an MCP server's proxy cannot be sandboxed
(`ValueError` when the ToolEnv is made).

What is enforced, and how (the child is `envs/sandbox_child.py`):
- CPU time: `RLIMIT_CPU` (the kernel's SIGXCPU) -> violation "cpu";
- memory: `RLIMIT_AS`, the address space the call may add to what the imported module already uses
  (`MemoryError`, or the kernel's kill) -> "memory";
- wall clock: the parent kills the child after `wall_s` -> "wall";
- network: a new user + network namespace (no interface but a down loopback) where the kernel allows unprivileged
  user namespaces (`isolation()` says which), and in every case an audit hook refusing sockets -> "network";
- new processes (subprocess, os.system, exec, fork, spawn) refused by the audit hook -> "process";
- files: the working directory is a fresh scratch directory, removed after the call (the file system is otherwise
  visible: this is a guard against runaway and careless code, not a boundary against hostile native code).
A violation is reported even when the tool catches the refusal itself. A tool that raises is an ordinary failure
("error: ..."), as unsandboxed. Each call costs a Python start (~0.15 s here) plus the tool module's import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Callable

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
VIOLATIONS = ("cpu", "memory", "wall", "network", "process", "crash")


@dataclasses.dataclass(frozen=True)
class Limits:
  """A sandboxed call's limits (module docstring). `network=True` lifts the network isolation only."""
  cpu_s: float = 5.0
  memory_mb: int = 512
  wall_s: float = 10.0
  network: bool = False

  def __post_init__(self):
    for name in ("cpu_s", "memory_mb", "wall_s"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"sandbox {name}={v!r}: must be a number > 0")

  @classmethod
  def of(cls, value) -> "Limits | None":
    """`value` as Limits: None / False (no sandbox), True (the defaults), a mapping of fields, or Limits."""
    if value is None or value is False:
      return None
    if value is True:
      return cls()
    if isinstance(value, cls):
      return value
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(dict(value)) - fields)
    if unknown:
      raise ValueError(f"sandbox has no field {unknown[0]!r} (fields: {', '.join(sorted(fields))})")
    return cls(**dict(value))


def importable(fn: Callable) -> tuple[str, str]:
  """(module, qualified name) the child imports `fn` by; ValueError when that does not give `fn` back."""
  module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
  obj = sys.modules.get(module or "")
  for part in qualname.split("."):
    obj = getattr(obj, part, None)
  if obj is not fn or "<" in qualname:
    raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} cannot be sandboxed: it is not a module-level function "
                     f"importable as {module}:{qualname}")
  return module, qualname


def call(fn: Callable, arguments: dict, limits: Limits, *, args: tuple = (),
         allow: tuple[tuple[str, int], ...] = ()) -> tuple[str, bool, str | None]:
  """`(content, ok, violation)`: `fn(*args, **arguments)` run in the sandbox (JSON-able arguments). ok: the tool
  returned (content is its result as text); else content is "error: ..." and violation is None (the tool raised) or
  one of `VIOLATIONS`. `allow`: the (host, port) pairs a socket may still reach, e.g. an agent harness's endpoint;
  with any, the network is isolated by the audit hook only (the endpoint lives in this process's namespace)."""
  module, qualname = importable(fn)
  with tempfile.TemporaryDirectory(prefix="jaxrl_sandbox_") as scratch:
    req = {"path": [p for p in sys.path if p], "module": module, "qualname": qualname, "args": list(args),
           "arguments": arguments, "scratch": scratch, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
           "network": limits.network, "allow": [list(a) for a in allow]}
    proc = subprocess.Popen([sys.executable, _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
      out, _ = proc.communicate(json.dumps(req), timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
      return f"error: sandbox: wall-clock limit ({limits.wall_s:g} s)", False, "wall"
    finally:  # also when this thread is interrupted (a harness thread left behind): the child never outlives the call
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
  try:
    answer = json.loads(out.strip().splitlines()[-1])
  except (ValueError, IndexError):
    code = proc.returncode
    kind = ("cpu" if code == -signal.SIGXCPU else "memory" if code == -signal.SIGKILL else "crash")
    what = {"cpu": f"CPU-time limit ({limits.cpu_s:g} s)", "memory": f"memory limit ({limits.memory_mb} MB)",
            "crash": f"the tool's process died (exit {code})"}[kind]
    return f"error: sandbox: {what}", False, kind
  if "violation" in answer:
    return f"error: {answer['error']}", False, answer["violation"]
  if answer["ok"]:
    return answer["value"], True, None
  return f"error: {answer['error']}", False, None


def isolation() -> str:
  """How this machine isolates the network: "namespace" (the kernel's, plus the audit hook) or "audit hook"."""
  probe = ("import ctypes,sys; sys.exit(0 if ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0 "
           "else 1)")
  return "namespace" if subprocess.run([sys.executable, "-c", probe]).returncode == 0 else "audit hook"
