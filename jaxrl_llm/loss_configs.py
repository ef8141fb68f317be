"""Which config runs each registered loss: the table behind docs/losses.md and tests/test_every_loss.py.

A loss runs from a config when the run provides every input it declares (`losses.missing_needs` against
`config.available_needs`). `config_for(name)` tries the general tiny configs first (`configs/tiny.py` for
RL losses, `configs/opd_tiny.py` for distillation, with `--config.loss.name=<loss>`), then the configs whose
own `loss.name` is that loss (a dedicated config switches on what only that loss needs: the sampler's
top-k, Monte-Carlo candidates, a reference teacher). A registered loss that no config can run must be in
`PENDING` with the reason; the every-loss test fails otherwise.
"""

from __future__ import annotations

import functools
import pathlib

from jaxrl_llm import config as config_lib
from jaxrl_llm import losses
from jaxrl_llm.distill import opd  # noqa: F401 (registers the needs distillation provides)

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
GENERAL = ("tiny.py", "opd_tiny.py")  # tried first, in this order

# Losses whose inputs no run produces yet, and what will produce them.
PENDING: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def _load(name: str):
  return config_lib.load_file(CONFIG_DIR / name)


def _config_names() -> list[str]:
  return sorted(p.name for p in CONFIG_DIR.glob("*.py"))


def config_for(name: str) -> str | None:
  """The config file (under configs/) that runs loss `name` with `--config.loss.name=<name>`, or None."""
  spec = losses.get(name)
  dedicated = [f for f in _config_names() if f not in GENERAL and _load(f).loss.name == name]
  for f in list(GENERAL) + dedicated:
    c = _load(f).copy_and_resolve_references()
    c.loss.name = name
    if not losses.missing_needs(spec, config_lib.available_needs(c)):
      return f
  return None


def command(name: str) -> str | None:
  """The command line that trains loss `name` (None when no config runs it)."""
  f = config_for(name)
  if f is None:
    return None
  over = "" if _load(f).loss.name == name else f" --config.loss.name={name}"
  return f"python -m jaxrl_llm --config=configs/{f} --workdir=/tmp/{name}{over}"
