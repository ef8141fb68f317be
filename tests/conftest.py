import os
import shutil
import sys
import tempfile

# Tests run on CPU; mesh tests opt into 8 host devices themselves (subprocesses).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402 -- after JAX_PLATFORMS is set


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
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def pytest_unconfigure(config):
  del config
  if _OWNS_CACHE:  # the controller (or a run without xdist); workers inherit the variable
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)
