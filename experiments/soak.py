"""Soak: a bounded async run of the tiny config, sampling RSS and held snapshots every step.

    python -m experiments.soak            # 300 steps; writes experiments/results/soak.json

Reports RSS at start / end, the slope of RSS over the second half (MB per 100 steps) and the maximum
number of ParamStore snapshots held. A leak shows as a positive slope that does not flatten.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def tiny_config():
  sys.path.insert(0, ROOT)
  from jaxrl_llm.config import load_file
  return load_file(os.path.join(ROOT, "configs", "tiny.py"))


def soak(steps: int, eta: int = 2, workdir: str | None = None) -> dict:
  sys.path.insert(0, ROOT)
  from jaxrl_llm import loop

  c = tiny_config()
  c.num_steps, c.rollout.mode, c.rollout.lag = steps, "async", eta
  c.eval.every, c.checkpoint.every, c.log.tensorboard = 0, max(1, steps // 4), False
  rss, held = [], []

  def on_step(row, store):
    rss.append(rss_mb())
    held.append(len(store.held_versions()))

  with tempfile.TemporaryDirectory() as tmp:
    loop.run(c, workdir or tmp, on_step=on_step)
  half = np.asarray(rss[len(rss) // 2:])
  slope = float(np.polyfit(np.arange(half.size), half, 1)[0] * 100) if half.size > 2 else 0.0
  return {"steps": steps, "eta": eta, "rss_start_mb": rss[0], "rss_end_mb": rss[-1], "rss_max_mb": max(rss),
          "rss_slope_second_half_mb_per_100_steps": slope, "max_snapshots_held": max(held),
          "snapshot_bound": eta + 1}


def main(argv=None):
  if __package__ in (None, ""):  # `python experiments/soak.py`
    sys.path.insert(0, ROOT)
  from experiments import common
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--eta", type=int, default=2)
  ap.add_argument("--out", default=common.RESULTS_DIR, help="results folder (soak.json, with provenance)")
  a = ap.parse_args(argv)
  res = soak(a.steps, a.eta)
  print(json.dumps(res, indent=2))
  print(common.write_results("soak", res, a.out, argv))


if __name__ == "__main__":
  main()
