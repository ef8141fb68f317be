import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile

# Tests run on CPU; mesh tests opt into 8 host devices themselves (subprocesses, `with_devices`).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU backend compiles the tests' programs without LLVM optimisation (its HLO passes, fusion,
# layouts and SPMD partitioning are unchanged). Backend compiling was a third of the in-process tests'
# time (2702 of 8167 worker-s) and the programs are tiny; measured with -n 2:
# test_shared_prefix 172 -> 103 s, test_opd_run + test_resume 263 -> 223 s, test_real_model_run +
# test_gguf (the real 135M model) 269 -> 229 s. Every `python -m jaxrl_llm` a test launches inherits it.
# An XLA_FLAGS that sets the level already is left alone.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# XLA:CPU's newer fusion emitters (MLIR) take ~3x longer to compile the tests' programs than the elemental
# emitters this turns back on, and compiling is most of the suite's time: one tiny learner step 1.55 -> 0.44 s
# of backend compile; tests/test_every_loss.py (34 distinct train steps) 110 -> 61 s alone; the whole suite
# (`pytest -q -n 2 --dist worksteal tests`, 2 idle cores) 1582 -> 913 s. The real model's compute-bound steps
# run slower with it (test_smollm2_grpo_two_steps 40 -> 46 s alone). Programs may round differently than
# under the default emitters, which no test may depend on (no bitwise equality of two different programs).
# jax is not pinned and XLA aborts on a flag it does not know: the first process (pytest, or its xdist controller)
# tries the flag in a child once; the workers and launched runs inherit the outcome through the environment.
_EMITTER_FLAG = "--xla_cpu_use_fusion_emitters=false"
if "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and "JAXRL_TEST_EMITTERS" not in os.environ:
  _with = f"{os.environ['XLA_FLAGS']} {_EMITTER_FLAG}".strip()
  _probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, timeout=600,
                          env={**os.environ, "XLA_FLAGS": _with, "JAX_PLATFORMS": "cpu"})
  os.environ["JAXRL_TEST_EMITTERS"] = "elemental" if _probe.returncode == 0 else "default (the flag is unknown)"
  if _probe.returncode == 0:
    os.environ["XLA_FLAGS"] = _with
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402 -- after JAX_PLATFORMS is set
import pytest  # noqa: E402


# One persistent XLA cache per test session, shared by the xdist workers and by every `python -m jaxrl_llm`
# a test launches (they inherit these variables; the controller imports this file first). Many tests build
# fresh jitted closures of the same tiny programs (every `loop.run` makes its own train step; a relaunch
# compiles its programs again), which jit's in-memory cache cannot share; the persistent cache is keyed by
# the compiled program, so those compiles become loads. Measured on test_resume/test_sources/
# test_update_schedule/test_loop (-n 2): 8.7 -> 6.6 CPU-minutes. A fresh directory each session.
_OWNS_CACHE = "JAXRL_TEST_XLA_CACHE" not in os.environ  # False in xdist workers and in a pytest a test launches
if _OWNS_CACHE:
  os.environ["JAXRL_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxrl_test_xla_")
_XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXRL_TEST_XLA_CACHE"]
# Every program, however quick to compile: a run compiles ~36 programs, most of them small glue ops under 0.1 s,
# which each xdist module (after `_release_compiled_programs`) and each launched process compiled again. Measured
# on a 2-step tiny run in a second process: 0.5 s of compiles at a 0.1 s threshold, none at 0 (run 2.3 -> 1.6 s).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
# Implicit rank promotion ([B, N] op [B]) raises in every in-process test: broadcasts are spelled out
# (`x[:, None]`, `jnp.expand_dims`, `jnp.broadcast_to`), so a shape bug cannot hide behind one. The
# `python -m jaxrl_llm` subprocesses some tests launch keep JAX's default ("allow").
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program when a test module ends. XLA:CPU maps each executable's code into the process
  (about 3 memory maps each, measured: 400 compiles took a process from 435 to 1,722 maps, `jax.clear_caches()`
  back to 514), and an xdist worker that runs half of today's suite compiles enough programs to reach the kernel's
  `vm.max_map_count` (65,530 here): the next compile then segfaults inside LLVM (seen three times at ~75 % of a
  full run, in whichever test compiled next). Later modules load their programs from the session's persistent
  cache instead. (Clearing only near the map limit was tried: the suite took as long, 1629 s against 1637 s, and
  the larger workers broke an RSS-peak test of bench/.)"""
  yield
  jax.clear_caches()


# Each distinct SFT warm start is trained once per session (`jaxrl_llm.sft_cache`): most runs of the suite start
# from configs/tiny.py's 150-step warm start, which was re-trained by every one of them. A hit returns bitwise the
# parameters the steps would produce, so no test sees a difference; tests/test_sft_cache.py checks that.
if _OWNS_CACHE:
  os.environ["JAXRL_LLM_SFT_CACHE"] = tempfile.mkdtemp(prefix="jaxrl_test_sft_")


def pytest_unconfigure(config):
  del config
  if _OWNS_CACHE:  # the controller (or a run without xdist); workers inherit the variables
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)
    shutil.rmtree(os.environ["JAXRL_LLM_SFT_CACHE"], ignore_errors=True)


def _session_root(tmp_path_factory):
  root = tmp_path_factory.getbasetemp()
  # A worker's base is pytest-of-user/pytest-N/popen-gwK; pytest-N is one per session, common to the workers.
  return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
  """`built_once(name, build)`: the JSON value `build()` returns, built once per test session.

  A module fixture is built by every xdist worker that runs one of the module's tests, and `-n 2` spreads
  a module over both; for the fixtures that launch 8-device subprocesses (minutes each) that doubled the
  work. The first worker to ask builds under a file lock in the session's common temp root and writes
  the value; the other waits on the lock and reads it. Both return the value read back from the file, so
  both workers test the same data. A build that fails writes nothing: the next asker retries it.
  """
  root = _session_root(tmp_path_factory)

  def once(name: str, build):
    path = root / f"built_once_{name}.json"
    with open(root / f"built_once_{name}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an error
      if not path.exists():
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps(build()))
        os.replace(tmp, path)
    return json.loads(path.read_text())

  return once


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
  """`shared_dir(name)`: a directory common to the session's xdist workers (see `built_once`)."""
  root = _session_root(tmp_path_factory)

  def make(name: str):
    d = root / f"shared_{name}"
    d.mkdir(exist_ok=True)
    return d

  return make


# A test that runs a small model for many steps loses more to the unoptimised backend than it saves: it carries
# `@pytest.mark.optimized_backend` and runs in a child pytest whose XLA backend optimises at level 1. The OPD
# learning test (100 steps): 61.4 -> 49.7 s alone, 93 -> 66 s in the full suite. The compile-bound rest is ~2x
# slower at level 1 (test_every_loss + test_continuous 104 -> 194 s), so it stays at 0. So do the real-model runs:
# alone one ran 60.5 -> 44.9 s at level 1, but in full suites the four 2-step runs took 280 s at level 1 against
# 254 s and 280 s in two runs at level 0 (the 30-layer programs compile for longer, a child costs ~3.5 s to start,
# and the OPD one took 38 s against 24-26 s). The child shares the session's XLA cache (programs are keyed by their
# flags too) and has a temp directory of its own.
_OPT_LEVEL = "--xla_backend_optimization_level="


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  if not pyfuncitem.get_closest_marker("optimized_backend") or os.environ.get("JAXRL_TEST_CHILD"):
    return None
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_OPT_LEVEL)]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
  env.update(XLA_FLAGS=" ".join([*flags, _OPT_LEVEL + "1"]), JAXRL_TEST_CHILD="1")
  with tempfile.TemporaryDirectory(prefix="jaxrl_test_child_", ignore_cleanup_errors=True) as basetemp:
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        f"--basetemp={basetemp}", pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
  if p.returncode != 0:
    pytest.fail(f"the child pytest (backend optimisation level 1) exited {p.returncode}:\n{p.stdout[-6000:]}",
                pytrace=False)
  return True


def pytest_collection_modifyitems(config, items):
  """End-to-end tests (marked `slow` or `real_model`) first, each group in its collected order: xdist hands tests
  out in this order, so the run ends on short tests and neither worker waits idle for the other's last minute-long
  run (the real-model tests sat near the end of the alphabet)."""
  del config
  items.sort(key=lambda item: 0 if item.get_closest_marker("slow") or item.get_closest_marker("real_model") else 1)
