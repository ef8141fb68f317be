"""Huge pages for XLA:CPU's per-step temporary buffers, on request (Linux with glibc >= 2.35; elsewhere a no-op).

XLA:CPU allocates the temporaries of each execution as one large block and frees it afterwards; glibc serves such a
block with a fresh anonymous mapping, so every step page-faults its whole working set again, 4 KiB at a time.
glibc's tunable `glibc.malloc.hugetlb=1` marks those mappings for transparent huge pages (2 MiB), far fewer faults.

Off by default: what it buys depends on what runs between steps. Learner steps back to back (`make bench`'s
learner rows) ran faster with it. In the GRPO loop on the real model, where sampling runs between train steps, the
train step ran slower with it (15.2 s against 13.0-13.2 s; the whole step 20.9 s against 18.7-19.0 s;
bench/profiles/huge_pages/ and docs/performance.md#huge-pages-on-cpu). Set JAXRL_LLM_HUGE_PAGES=1 to turn it on.

glibc reads tunables once, at process start, so an entry point calls `reexec_with_huge_pages()` first: when asked
for, it restarts the same command line once with the tunable added.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_IN = "JAXRL_LLM_HUGE_PAGES"  # "1": on


def wanted(environ=os.environ, platform: str = sys.platform) -> bool:
  """Whether `reexec_with_huge_pages` would restart: Linux, asked for (JAXRL_LLM_HUGE_PAGES=1), tunable not yet
  set."""
  return (platform.startswith("linux") and environ.get(OPT_IN, "0") == "1"
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
