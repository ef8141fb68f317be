"""A run's working directory: created with a clear error, owned by one run at a time, never wiped.

    with workdir.claim(path):    # RunError if path is a file, unwritable, or owned by a live run
      ...

Ownership is a lock file `DIR/.lock` holding the owner's pid, host and start time (JSON), created
atomically (written to a private temp file, then hard-linked into place: it appears complete or not
at all). A second run on the same directory fails with a message naming the owner. A lock whose pid
is dead on this host is stale (a SIGKILLed run): it is reported and taken over. A lock from another
host cannot be checked and is never taken over: remove the file by hand if that run is gone.

`move_aside` renames files of an earlier run into `DIR/previous-<UTC time>/` instead of deleting them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings

from jaxrl_llm.errors import RunError

LOCK = ".lock"


def prepare(path: str) -> str:
  """Creates `path` (and parents) and checks that it is a writable directory; returns its absolute path."""
  path = os.path.abspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise RunError(f"--workdir={path}: exists and is not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise RunError(f"--workdir={path}: cannot create it ({e.strerror or e})") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise RunError(f"--workdir={path}: not writable")
  return path


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by another user
    return True
  return True


def _read(lock: str) -> dict | None:
  try:
    with open(lock) as f:
      owner = json.load(f)
    return owner if isinstance(owner, dict) else None
  except (OSError, ValueError):
    return None


def _pid(owner: dict) -> int | None:
  """The owner's pid, None when the lock holds no usable one (not an int in [1, 2**31): `os.kill` of 0 or
  a negative pid would probe a whole process group, a larger one overflows)."""
  pid = owner.get("pid")
  if isinstance(pid, str) and pid.strip().isdigit():
    pid = int(pid)
  return pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31 else None


def acquire(path: str) -> str:
  """Takes `path`'s lock for this process (see the module docstring); returns the lock file's path."""
  lock = os.path.join(path, LOCK)
  me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
  tmp = f"{lock}.{me['pid']}.{time.time_ns()}"
  try:
    with open(tmp, "w") as f:
      json.dump(me, f)
  except OSError as e:
    raise RunError(f"--workdir={path}: cannot write the lock file ({e.strerror or e})") from None
  try:
    for _ in range(3):
      try:
        os.link(tmp, lock)  # atomic: fails if a lock exists
        return lock
      except FileExistsError:
        pass
      owner = _read(lock)
      if owner is None:
        why = "unreadable"
      elif _pid(owner) is None:  # not written by `acquire`: nothing to check, as unreadable as garbage
        why = f"unreadable pid {str(owner.get('pid'))[:40]!r}"
      elif owner.get("host") != me["host"]:
        raise RunError(f"--workdir={path}: in use by pid {owner.get('pid')} on host {owner.get('host')} "
                       f"(since {owner.get('started')}); if that run is gone, delete {lock}")
      elif _pid(owner) == me["pid"] or _alive(_pid(owner)):
        raise RunError(f"--workdir={path}: in use by another run (pid {owner.get('pid')}, since "
                       f"{owner.get('started')}); use another --workdir or stop that run")
      else:
        why = f"its pid {owner.get('pid')} is not running"
      warnings.warn(f"{lock}: stale lock ({why}); taking over", RuntimeWarning, stacklevel=2)
      with contextlib.suppress(FileNotFoundError):
        os.rename(lock, f"{lock}.stale")  # atomic; a concurrent taker that lost the race retries the link
    raise RunError(f"--workdir={path}: could not take the lock {lock}")
  finally:
    with contextlib.suppress(OSError):
      os.remove(tmp)


def release(lock: str) -> None:
  """Removes the lock if this process still owns it."""
  owner = _read(lock)
  if owner is not None and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
    with contextlib.suppress(FileNotFoundError):
      os.remove(lock)


@contextlib.contextmanager
def claim(path: str):
  """`prepare` + `acquire` for the duration of the block; yields the absolute path."""
  path = prepare(path)
  lock = acquire(path)
  try:
    yield path
  finally:
    release(lock)


def move_aside(path: str, names: list[str]) -> str | None:
  """Moves the existing `names` of `path` into a new `path/previous-<UTC time>/`; returns it (None if
  there was nothing to move). Nothing is deleted."""
  present = [n for n in names if os.path.lexists(os.path.join(path, n))]
  if not present:
    return None
  dest = os.path.join(path, time.strftime("previous-%Y%m%dT%H%M%SZ", time.gmtime()))
  base, i = dest, 1
  while os.path.exists(dest):
    dest, i = f"{base}-{i}", i + 1
  os.makedirs(dest)
  for n in present:
    os.rename(os.path.join(path, n), os.path.join(dest, n))
  return dest
