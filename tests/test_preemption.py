"""Preemption flag: signals set it, uninstall restores handlers, and a real SIGTERM gives a clean save + exit 0."""

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import preemption
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.preemption import PreemptionFlag, install_sigterm_handler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def restore_handlers():
  saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  yield
  for s, h in saved.items():
    signal.signal(s, h)


def test_import_installs_nothing(restore_handlers):
  before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  importlib.reload(preemption)
  assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_sigterm_sets_flag_and_uninstall_restores_previous(restore_handlers):
  seen = []
  previous = lambda signum, frame: seen.append(signum)
  signal.signal(signal.SIGTERM, previous)
  flag = install_sigterm_handler()
  assert not flag.requested
  assert signal.getsignal(signal.SIGINT) is not flag._handle  # SIGINT only on request
  os.kill(os.getpid(), signal.SIGTERM)
  assert flag.requested and flag.signum == signal.SIGTERM
  assert seen == []  # the flag replaces the previous handler, it does not chain to it
  flag.uninstall()
  flag.uninstall()  # idempotent
  assert signal.getsignal(signal.SIGTERM) is previous
  os.kill(os.getpid(), signal.SIGTERM)
  assert seen == [signal.SIGTERM]


def test_sigint_optional_and_second_sigint_escalates(restore_handlers):
  seen = []
  signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
  flag = install_sigterm_handler(sigint=True)
  os.kill(os.getpid(), signal.SIGINT)
  assert flag.requested and flag.signum == signal.SIGINT and seen == []
  os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C goes to the previous handler
  assert seen == [signal.SIGINT]
  flag.uninstall()


def test_default_sigint_escalates_to_keyboard_interrupt(restore_handlers):
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  flag = install_sigterm_handler(sigint=True)
  os.kill(os.getpid(), signal.SIGINT)
  assert flag.requested
  with pytest.raises(KeyboardInterrupt):
    os.kill(os.getpid(), signal.SIGINT)
    signal.getsignal(signal.SIGINT)  # give the handler a bytecode boundary to run at
  flag.uninstall()
  assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL


def test_request_from_another_thread_is_visible():
  flag = PreemptionFlag()
  t = threading.Thread(target=flag.request, args=(0,))
  t.start()
  t.join()
  assert flag.requested and flag.signum == 0
  flag.request(signal.SIGTERM)
  assert flag.signum == 0  # the first request is kept


def test_install_outside_main_thread_raises():
  errors = []
  t = threading.Thread(target=lambda: errors.append(_try_install()))
  t.start()
  t.join()
  assert errors == ["ValueError"]


def _try_install():
  try:
    install_sigterm_handler()
  except ValueError:
    return "ValueError"
  return "installed"


SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import jax.numpy as jnp
    from jaxrl_llm.checkpoint import Checkpointer
    from jaxrl_llm.preemption import install_sigterm_handler

    flag = install_sigterm_handler()
    ckpt = Checkpointer(sys.argv[1])
    state = {{"w": jnp.zeros(3), "step": jnp.int32(0)}}
    step = 0
    while True:
      step += 1
      state = {{"w": state["w"] + 1.0, "step": jnp.int32(step)}}
      if step == 1:
        print("ready", flush=True)
      if flag.requested:
        ckpt.save(step, state, {{"step": step, "signum": flag.signum}}, force=True)
        ckpt.close()
        flag.uninstall()
        sys.exit(0)
      time.sleep(0.01)
""")


def test_real_sigterm_saves_and_exits_zero(tmp_path):
  script = tmp_path / "train.py"
  script.write_text(SCRIPT.format(root=ROOT))
  workdir = tmp_path / "ckpt"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, str(script), str(workdir)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
  try:
    # The loop is running (handler installed) once it prints; bounded so a hang fails the test.
    ready = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()))
    reader.start()
    reader.join(timeout=120)
    assert ready == ["ready\n"], proc.stderr.read() if proc.poll() is not None else "no ready line"
    os.kill(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert rc == 0, proc.stderr.read()
  with Checkpointer(workdir) as ck:
    step, state, meta = ck.latest_valid({"w": jnp.zeros(3), "step": jnp.int32(0)})
  assert meta == {"step": step, "signum": signal.SIGTERM}
  assert step >= 1 and int(state["step"]) == step
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full(3, float(step), np.float32))
