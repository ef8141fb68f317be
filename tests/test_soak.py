"""A short soak (the CI-sized version of experiments/soak.py) and the non-finite stop rule."""

import dataclasses
import json
import os
import sys

import jax.numpy as jnp
import pytest

from jaxrl_llm import loop, losses
from jaxrl_llm.errors import RunError
from test_loop import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_short_async_soak_holds_bounded_snapshots_and_memory(tmp_path):
  sys.path.insert(0, ROOT)
  from experiments import soak
  soak.main(["--steps", "40", "--eta", "2", "--out", str(tmp_path)])
  res = json.loads((tmp_path / "soak.json").read_text())
  assert res["command"] == "python -m experiments.soak --steps 40 --eta 2 --out " + str(tmp_path) and res["commit"]
  assert res["steps"] == 40 and res["snapshot_bound"] == 3
  assert res["max_snapshots_held"] <= res["snapshot_bound"] + 1  # +1: a worker may pin a just-replaced version
  # Memory: after warm-up, growth over the second half stays small (MB per 100 steps; no unbounded trend).
  assert res["rss_slope_second_half_mb_per_100_steps"] < 100, res  # a 1 MB/step leak would exceed it


@dataclasses.dataclass(frozen=True)
class _Hp:
  pass


def _nan_loss(inputs, hp):
  """Always non-finite (test only). On-policy: NaN."""
  return jnp.where(inputs.mask_BN > 0, jnp.nan * inputs.logp_BN, 0.0), {}


def test_consecutive_non_finite_updates_stop_the_run_with_a_clear_message(tmp_path):
  losses.register("_test_nan", _nan_loss, _Hp)
  try:
    c = tiny()
    c.loss.name = "_test_nan"
    c.optim.max_skips = 3
    c.num_steps = 10
    c.eval.every = 0
    with pytest.raises(RunError, match="optim.max_skips=3: 3 consecutive non-finite updates"):
      loop.run(c, str(tmp_path))
    rows = [l for l in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 3  # the third skip's row is written, then a checkpoint, then the run stops
    assert all('"update_skipped": 1' in r for r in rows)
    assert "3" in os.listdir(tmp_path / "checkpoints")
  finally:
    losses.unregister("_test_nan")
