"""Command line: python -m jaxrl_llm --config=PATH --workdir=DIR [--config.FIELD=VALUE ...] [--debug]

Exit codes: 0 done (or preempted by SIGTERM after saving a checkpoint); 2 a bad config value or flag;
1 a run that cannot start or had to stop (`error: <one line naming the field, file or directory>`: an
unusable workdir, a workdir owned by another run, a changed config on resume, optim.max_skips reached,
every update skipped, ...); 130 stopped by Ctrl-C (SIGINT: a checkpoint is saved first once the loop
runs). Errors print one line without a traceback, the last line of stderr; `--debug` shows the traceback.
Tracebacks of background threads (Orbax's save threads after a failed write or a Ctrl-C during a save) go to
`DIR/errors.log` (a `note:` line says so once).

Multi-process (one process per host, docs/scaling.md): the same command on every host; `jax.distributed`
is initialised first from `--config.dist.*` (else $JAX_COORDINATOR_ADDRESS etc., else a detected TPU slice /
SLURM job). Process 0 writes the run's files and prints the summary. A process that stops with an error
tells the others, which then exit 1 too; one that dies silently is noticed by the others' watchdog within
`dist.heartbeat_timeout_seconds / 2` (`distributed.PeerWatchdog`).
"""

import os
import sys

if __name__ == "__main__":  # first, before any work: huge pages when asked for (see hugepages.py)
  from jaxrl_llm import hugepages
  hugepages.reexec_with_huge_pages()

from absl import app, flags
from ml_collections import ConfigDict, config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, plots and checkpoints.")
_DEBUG = flags.DEFINE_bool("debug", False, "Show the traceback of an error instead of a one-line message.")
flags.mark_flags_as_required(["config", "workdir"])


def _config_file_error(path) -> str | None:
  """Why config file `path` does not load, as one whole line (the file's own error, not config_flags'
  wrapper of it); None when it loads."""
  from jaxrl_llm import config as config_lib
  try:
    config_lib.load_file(path)
  except Exception as e:  # noqa: BLE001 -- a config file is code: anything can go wrong in it
    return f"--config={path}: cannot load the config file ({type(e).__name__}: {' '.join(str(e).split())})"
  return None


def _flag_error(argv, e: Exception) -> str:
  """One line for a command line that does not parse, naming the bad `--config.FIELD` when it is one."""
  from jaxrl_llm import config as config_lib
  path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  bad_file = _config_file_error(path)
  if bad_file:
    return bad_file
  c = config_lib.load_file(path)
  for a in argv:
    if a.startswith("--config.") and "=" in a:
      field = a[len("--config."):].split("=", 1)[0]
      node = c
      for part in field.split("."):
        if not isinstance(node, ConfigDict) or part not in node:
          return f"--config.{field}: unknown config field {part!r} (not in {path})"
        node = node[part]
  return f"bad command line: {type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 -- absl and config_flags raise several types
    if any(a in ("--debug", "--debug=true", "--debug=True", "--debug=1") for a in argv):
      raise
    print(f"error: {_flag_error(argv, e)} (--debug shows the traceback)", file=sys.stderr)
    sys.exit(2)


def _fail(message: str, code: int):
  line = ' '.join(str(message).split())
  if _DEBUG.value:
    print(f"error: {line}", file=sys.stderr)
  else:  # what threads print while the process winds down goes to the log, never after this line
    _BACKGROUND.last_word(f"error: {line} (--debug shows the traceback)")
  from jaxrl_llm import distributed
  import jax
  if jax.distributed.is_initialized() and jax.process_count() > 1:
    distributed.report_failure(line)  # the other processes exit at once instead of waiting in a collective
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)  # not `sys.exit`: JAX's shutdown barrier would wait for the peers this process abandons
  sys.exit(code)


def main(argv):
  del argv
  from jaxrl_llm import config as config_lib
  from jaxrl_llm.errors import RunError
  try:
    _main()
  except KeyboardInterrupt:
    if _DEBUG.value:
      raise
    _fail("interrupted (Ctrl-C before the training loop, or twice): nothing saved since the last checkpoint", 130)
  except config_lib.ConfigError as e:
    if _DEBUG.value:
      raise
    _fail(e, 2)
  except RunError as e:
    if _DEBUG.value:
      raise
    _fail(e, 1)
  except Exception as e:  # noqa: BLE001 -- anything else is still one line (the type names the failure)
    if _DEBUG.value:
      raise
    from jaxrl_llm import distributed
    _fail(distributed.describe_peer_loss(e) or f"{type(e).__name__}: {e}", 1)


class _Background:
  """Tracebacks of background threads (Orbax's save threads, TensorStore callbacks) go to `DIR/errors.log`
  instead of stderr: a failed checkpoint write or a Ctrl-C during a save makes several threads fail, and
  their tracebacks used to bury the one `error:` line. Installed for the run (not with --debug): Python's
  thread, unraisable and callback hooks, and log records that carry a traceback or are errors; after the
  `error:` line (`last_word`; it prints the `note:` line just before, when none was printed yet and threads
  are still running that may fail after it) the process's stderr itself goes to the log: that line stays the last."""

  def __init__(self):
    self.path = None
    self.noted = False

  def install(self, workdir: str) -> None:
    import logging
    import threading
    from absl import logging as absl_logging
    self.path = os.path.join(os.path.abspath(workdir), "errors.log")
    threading.excepthook = lambda a: self.write(f"exception in thread {a.thread.name if a.thread else '?'}",
                                                (a.exc_type, a.exc_value, a.exc_traceback))
    sys.unraisablehook = lambda u: self.write(f"unraisable exception: {u.err_msg or '(raised in a C callback)'}",
                                              (u.exc_type, u.exc_value, u.exc_traceback))
    # C extensions (TensorStore's future callbacks) report their exceptions through sys.excepthook; the main
    # thread's own exceptions are caught by `main` and never reach it.
    sys.excepthook = lambda *exc: self.write("exception in a callback", exc)

    def to_log(record: logging.LogRecord) -> bool:
      if record.exc_info or record.levelno >= logging.ERROR:
        self.write(logging.Formatter().format(record))
        return False
      return True
    absl_logging.get_absl_handler().addFilter(to_log)

  def write(self, what: str, exc_info=None) -> None:
    import traceback
    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(what.rstrip("\n") + "\n")
        if exc_info is not None:
          f.write("".join(traceback.format_exception(*exc_info)))
    except (OSError, TypeError):  # no usable workdir (or not installed): the traceback is dropped
      return
    if not self.noted:  # once, so that a failing thread of a run that goes on is not missed either
      self.noted = True
      print(f"note: a background thread reported an error; tracebacks go to {self.path}", file=sys.stderr, flush=True)

  def last_word(self, line: str) -> None:
    """Prints `line` as the last line of stderr: file descriptor 2 goes to the log (/dev/null without
    one) first, then `line` is written to the original stderr."""
    from jaxrl_llm import workdir as workdir_lib
    sys.stderr.flush()
    stderr = os.dup(2)
    path = self.path
    if path is not None:  # never into the workdir of another run (the error may be that it is in use)
      owner = workdir_lib._read(os.path.join(os.path.dirname(path), workdir_lib.LOCK))
      path = path if owner is None or owner.get("pid") == os.getpid() else None
    try:
      fd = os.open(path or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
      fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)
    if path is not None and not self.noted and _threads_left():  # e.g. Orbax's save threads after a Ctrl-C: what
      self.noted = True                                          # they report goes to the log, said before `line`
      os.write(stderr, f"note: tracebacks of background threads go to {path}\n".encode())
    os.write(stderr, (line + "\n").encode())
    os.close(stderr)


def _threads_left() -> bool:
  """Whether threads that the interpreter waits for at exit (not daemon threads) are still running."""
  import threading
  return any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())


_BACKGROUND = _Background()


def _main():
  from absl import logging
  if not flags.FLAGS["verbosity"].present:  # Orbax/JAX INFO logs drown the progress bar; -v 0 brings them back
    logging.set_verbosity(logging.WARNING)
  from jaxrl_llm import config as config_lib, distributed, loop, metrics

  c = _CONFIG.value
  if not isinstance(c, ConfigDict):  # config_flags' stand-in for a file that did not load (it raises on use)
    path = config_flags.get_config_filename(flags.FLAGS["config"])
    raise config_lib.ConfigError(_config_file_error(path) or f"--config={path}: cannot load the config file")
  if not _DEBUG.value:
    _BACKGROUND.install(_WORKDIR.value)
  distributed.initialize_from_config(c)  # before any device is touched; a no-op for one process
  config_lib.validate(c)
  rows = loop.run(c, _WORKDIR.value)
  import jax
  distributed.stop_watchdog()  # finished normally: peers no longer expect heartbeats from this process
  if jax.process_index() != 0:
    return  # process 0 reports the run
  import json
  info = json.load(open(os.path.join(_WORKDIR.value, "run_info.json")))
  if info.get("stopped_by_signal") == 2:  # SIGINT: the checkpoint is saved; exit as an interrupted program
    print("interrupted (Ctrl-C): checkpoint saved; run the same command to resume", file=sys.stderr)
    sys.exit(130)
  if not rows and not info["resumed_from_step"]:  # a fresh start (a resume starts at a saved step >= 1)
    print(f"nothing to do: config.num_steps={c.num_steps}, so no learner step ran (in {_WORKDIR.value})")
  elif not rows:
    print(f"nothing to do: {_WORKDIR.value} already holds a run that reached num_steps={c.num_steps} "
          f"(resumed at step {info['resumed_from_step']}); use another --workdir or a larger --config.num_steps")
  if rows:
    plot_path = os.path.join(_WORKDIR.value, "reward_accuracy.png")
    metrics.plot(rows, plot_path, title=f"{c.loss.name}, {c.rollout.mode} (lag {c.rollout.lag})",
                 initial_eval=info.get("eval_accuracy_initial"))
    print(metrics.summary_table(rows, info.get("eval_accuracy_initial")))
    if info.get("time_sft_s"):
      print(f"SFT warm start: {info['time_sft_s']:.1f} s; held-out accuracy 'start' is after it, before RL")
    print(f"XLA compilations: train_step={info['compiles_train_step']} generate={info['compiles_generate']} "
          f"score={info['compiles_score']}")
    print(f"metrics: {os.path.join(_WORKDIR.value, 'metrics.jsonl')}\nplot:    {plot_path}")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
