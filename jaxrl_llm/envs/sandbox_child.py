"""The child side of `envs.sandbox`: run by path (`python sandbox_child.py`), standard library only, so that nothing
has started a thread before it leaves the network namespace (unshare of a user namespace needs a single thread).

Reads one JSON request from stdin: {"path": [...], "module": ..., "qualname": ..., "args": [...], "arguments": {...},
"scratch": dir, "cpu_s": float, "memory_mb": int, "network": bool, "allow": [[host, port], ...]}; `allow`: the only
addresses a socket may reach (an agent harness's endpoint), in the parent's network namespace. In order: isolate the
network (a new user + network namespace where the kernel allows it), import the tool (under the parent's sys.path;
module code is the environment author's, not the policy's, so it runs before the limits), enter the scratch directory,
set the CPU and address-space limits, install an audit hook that refuses sockets and new processes, call the tool.
Writes one JSON line to the original stdout: {"ok": true, "value": ...} | {"ok": false, "error": "..."} |
{"violation": "memory" | "network" | "process", "error": "..."}. A CPU overrun is SIGXCPU (the parent reads the
signal), a wall overrun the parent's kill.
"""

import ctypes
import json
import os
import resource
import sys

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_NETWORK = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname")
_PROCESS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.spawn",
            "pty.spawn")
_WHAT = {"network": "network access", "process": "starting a process"}


def _leave_network() -> bool:
  """A new user namespace (mapped to our own uid, so files are still ours) with an empty network namespace."""
  uid, gid = os.getuid(), os.getgid()
  if ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
    return False
  try:
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  except OSError:
    pass  # unmapped, the tool runs as nobody: still isolated, but cannot write its scratch directory
  return True


def main() -> None:
  req = json.loads(sys.stdin.read())
  out = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # the tool's prints go to stderr, not into the answer
  allow = {(h, int(p)) for h, p in req.get("allow", [])}
  hosts = {h for h, _ in allow}
  if not req["network"] and not allow:
    _leave_network()
  sys.path[:] = req["path"]
  violated = []
  try:
    fn = __import__(req["module"], fromlist=["_"])
    for part in req["qualname"].split("."):
      fn = getattr(fn, part)
    os.chdir(req["scratch"])
    cpu = max(1, int(req["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    with open("/proc/self/statm") as f:
      used = int(f.read().split()[0]) * resource.getpagesize()
    limit = used + int(req["memory_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def allowed(event, args) -> bool:
      if event == "socket.connect":
        return isinstance(args[1], tuple) and (args[1][0], args[1][1]) in allow
      if event in ("socket.getaddrinfo", "socket.gethostbyname"):
        return args[0] in hosts or (isinstance(args[0], bytes) and args[0].decode() in hosts)
      return event == "socket.__new__" and bool(allow)

    def hook(event, args):
      kind = ("network" if event in _NETWORK and not req["network"] and not allowed(event, args) else
              "process" if event.startswith(_PROCESS) else None)
      if kind is not None:
        violated.append(kind)
        raise PermissionError(f"sandbox: {_WHAT[kind]} is not allowed ({event})")
    import platform
    platform.uname().processor  # noqa: B018  (cached now: it runs `uname -p`, which clients like openai's ask for)
    sys.addaudithook(hook)
    value = fn(*req.get("args", []), **req["arguments"])
    answer = {"ok": True, "value": value if isinstance(value, str) else json.dumps(value, default=str)}
  except SystemExit as e:  # a harness's sys.exit: its episode's failure, not the child's crash
    answer = {"ok": False, "error": f"SystemExit: {e.code}"}
  except MemoryError:
    answer = {"violation": "memory", "error": f"sandbox: memory limit ({req['memory_mb']} MB)"}
  except Exception as e:  # noqa: BLE001 -- the tool's own failure is its answer
    answer = {"ok": False, "error": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__}
  if violated:  # also when the tool caught the PermissionError itself
    answer = {"violation": violated[0], "error": f"sandbox: {_WHAT[violated[0]]} is not allowed"}
  out.write(json.dumps(answer) + "\n")
  out.flush()


if __name__ == "__main__":
  main()
