"""Entry points restart once with glibc's huge-page tunable (jaxrl_llm/hugepages.py)."""

import os
import subprocess
import sys

import pytest

from jaxrl_llm import hugepages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRINT_AFTER_REEXEC = ("from jaxrl_llm import hugepages; hugepages.reexec_with_huge_pages(); import os; "
                      "print(repr(os.environ.get('GLIBC_TUNABLES')), hugepages.active())")


def test_wanted():
  """Off unless asked for (JAXRL_LLM_HUGE_PAGES=1): slower in the GRPO loop on the real model (hugepages.py)."""
  assert not hugepages.wanted({}, "linux")
  assert hugepages.wanted({"JAXRL_LLM_HUGE_PAGES": "1"}, "linux")
  assert not hugepages.wanted({"JAXRL_LLM_HUGE_PAGES": "1"}, "darwin")
  assert not hugepages.wanted({"JAXRL_LLM_HUGE_PAGES": "0"}, "linux")
  on = {"JAXRL_LLM_HUGE_PAGES": "1"}
  assert not hugepages.wanted({**on, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "linux")
  assert not hugepages.wanted({**on, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "linux")  # the user's choice wins
  assert hugepages.wanted({**on, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "linux")


def _run(env_extra: dict) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXRL_LLM_HUGE_PAGES")}
  proc = subprocess.run([sys.executable, "-c", PRINT_AFTER_REEXEC], cwd=ROOT, env={**env, **env_extra},
                        capture_output=True, text=True, timeout=120, check=True)
  return proc.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the restart only happens on Linux")
def test_restarts_once_with_the_tunable_added():
  on = {"JAXRL_LLM_HUGE_PAGES": "1"}
  assert _run(on) == "'glibc.malloc.hugetlb=1' True"
  assert _run({**on, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) == \
      "'glibc.malloc.trim_threshold=1:glibc.malloc.hugetlb=1' True"
  assert _run({}) == "None False"  # the default: no restart
  assert _run({"JAXRL_LLM_HUGE_PAGES": "0"}) == "None False"
