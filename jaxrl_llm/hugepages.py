"""Huge pages for XLA:CPU's per-step temporary buffers (Linux with glibc >= 2.35; elsewhere a no-op).

Why: XLA:CPU allocates the temporaries of each execution as one large block and frees it afterwards;
glibc serves such a block with a fresh anonymous mapping, so every learner step page-faults its whole
working set again, 4 KiB at a time. glibc's tunable `glibc.malloc.hugetlb=1` marks those mappings for
transparent huge pages (2 MiB), far fewer faults. `make bench` reports the faults per step and the
speed with and without it (bench/README.md).

glibc reads tunables once, at process start, so an entry point calls `reexec_with_huge_pages()` first:
it restarts the same command line once with the tunable added. Set JAXRL_LLM_HUGE_PAGES=0 to opt out.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "JAXRL_LLM_HUGE_PAGES"


def wanted(environ=os.environ, platform: str = sys.platform) -> bool:
  """Whether `reexec_with_huge_pages` would restart: Linux, not opted out, tunable not yet set."""
  return (platform.startswith("linux") and environ.get(OPT_OUT, "1") != "0"
          and "glibc.malloc.hugetlb" not in environ.get("GLIBC_TUNABLES", ""))


def reexec_with_huge_pages() -> None:
  """Replaces this process with the same command line plus `GLIBC_TUNABLES=...hugetlb=1`, once.

  Returns without doing anything when `wanted()` is false (including in the restarted process).
  Call it before any work: the process image is replaced, open files and threads are not kept.
  """
  if not wanted():
    return
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  os.environ["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def active() -> bool:
  """Whether this process started with the tunable (it cannot be turned on later)."""
  return TUNABLE in os.environ.get("GLIBC_TUNABLES", "")
