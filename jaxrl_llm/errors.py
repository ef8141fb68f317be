"""Errors that stop a run with a one-line message (the CLI prints it without a traceback; `--debug` shows it)."""


class RunError(RuntimeError):
  """A run cannot start or continue; the message is one line naming the field, file or directory."""
