"""Preemption: a signal sets a flag; the loop checks it each step, saves a checkpoint and stops.

`loop.run` installs it for SIGTERM and SIGINT (Ctrl-C): both save; the command line then exits 0 after
SIGTERM (a preemption) and 130 after SIGINT.

    flag = install_sigterm_handler()
    try:
      for step in ...:
        ...
        if flag.requested:
          checkpointer.save(step, state, meta, force=True)
          break
    finally:
      flag.uninstall()

The handler does nothing but store the signal number (an atomic attribute write), so it is safe to
run at any point of the main thread and the flag can be read from any thread. Saving happens in the
loop, never in the handler: a handler that ran Orbax mid-step could capture a half-updated state.
A second SIGINT while a stop is already requested falls back to the previous SIGINT handler (by
default KeyboardInterrupt), so Ctrl-C twice still stops a stuck run. Importing this module installs
nothing.
"""

from __future__ import annotations

import signal
import threading


class PreemptionFlag:
  """Whether a stop was requested (by a signal or by `request`), and which signal asked for it."""

  def __init__(self):
    self.signum: int | None = None  # the first signal received (0: requested from code)
    self._previous: dict[int, object] = {}
    self._lock = threading.Lock()  # guards install/uninstall, never taken inside the handler

  @property
  def requested(self) -> bool:
    return self.signum is not None

  def request(self, signum: int = 0) -> None:
    """Requests a stop from code (tests, a watchdog thread); keeps the first signal number."""
    if self.signum is None:
      self.signum = signum

  def _handle(self, signum, frame):
    again = self.requested
    self.request(signum)
    previous = self._previous.get(signum)
    if again and signum == signal.SIGINT:
      if callable(previous):
        previous(signum, frame)
      else:
        raise KeyboardInterrupt

  def install(self, signums) -> "PreemptionFlag":
    """Installs the handler for `signums` (main thread only; signal.signal raises otherwise)."""
    with self._lock:
      for s in signums:
        if s not in self._previous:
          self._previous[s] = signal.signal(s, self._handle)
    return self

  def uninstall(self) -> None:
    """Restores the handlers that were installed before `install`. Idempotent."""
    with self._lock:
      for s, previous in self._previous.items():
        signal.signal(s, previous if previous is not None else signal.SIG_DFL)
      self._previous.clear()


def install_sigterm_handler(*, sigint: bool = False) -> PreemptionFlag:
  """A new `PreemptionFlag` set by SIGTERM (and SIGINT when `sigint`). Call from the main thread."""
  signums = [signal.SIGTERM] + ([signal.SIGINT] if sigint else [])
  return PreemptionFlag().install(signums)
