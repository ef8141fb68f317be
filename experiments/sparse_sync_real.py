"""Sparse weight sync on a real RL run: how many bf16 sampler weights change per learner step.

SparseRL-Sync's premise: with a small learning rate, most bf16 weights of the sampler copy are
bitwise unchanged after an update (the fp32 change is below half a bf16 ulp), so a publish can ship
only the changed elements. This runs GRPO on the real SmolLM2-135M-Instruct (configs/smollm2_grpo.py)
with a bf16 sampler and `rollout.weight_sync=sparse` at several learning rates, and records the
per-publish `sync_changed_frac` (changed elements / all elements) and `sync_payload_ratio` (payload
bytes / dense bf16 bytes) that `rollout/param_store.py` measures on the real parameter deltas. Every
row is the publish after that step's update (the dense initial publish of version 0 has no row).

    python -m experiments.sparse_sync_real                      # lr 1e-6, 1e-5; 6 steps each
    python -m experiments.sparse_sync_real --lrs 1e-7,1e-6,1e-5 --steps 20   # an accelerator
"""

from __future__ import annotations

import os
import time

from experiments import common


def finished_rows(workdir: str, steps: int) -> list[dict] | None:
  """The metrics rows of a run in `workdir` (named after its learning rate) that wrote all `steps` rows, else None."""
  import json
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError):
    return None
  return rows if [r.get("step") for r in rows] == list(range(steps)) else None


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated AdamW learning rates")
  args = p.parse_args(argv)
  steps = args.steps or 6
  from jaxrl_llm import loop
  runs = []
  for lr in [float(x) for x in args.lrs.split(",")]:
    over = {"optim.lr": lr, "optim.warmup_steps": 0, "num_steps": steps, "eval.every": 0,
            "sampler.dtype": "bfloat16", "rollout.weight_sync": "sparse", "seed": 0}
    c = common.make_config("smollm2_grpo", over)
    wd = os.path.join(args.workdir, "sparse_sync_real", f"lr{lr:g}")
    import shutil
    t0 = time.perf_counter()
    rows = finished_rows(wd, steps)  # an earlier invocation's complete run (these runs take an hour on 2 cores)
    if rows is None:
      shutil.rmtree(wd, ignore_errors=True)
      rows = loop.run(c, wd)
    shutil.rmtree(os.path.join(wd, "checkpoints"), ignore_errors=True)  # a real-model checkpoint is ~1.6 GB
    per_step = [{"step": r["step"], "changed_frac": r.get("sync_changed_frac"),
                 "payload_ratio": r.get("sync_payload_ratio"), "reward_mean": r.get("reward_mean")} for r in rows]
    later = [s for s in per_step if s["changed_frac"] is not None]
    mean = lambda k: sum(s[k] for s in later) / len(later) if later else None  # noqa: E731
    runs.append({"lr": lr, "steps": per_step, "changed_frac_mean": mean("changed_frac"),
                 "payload_ratio_mean": mean("payload_ratio"), "wall_s": time.perf_counter() - t0})
    common.log(f"lr {lr:g}: changed {runs[-1]['changed_frac_mean']} payload {runs[-1]['payload_ratio_mean']}")
  return common.write_results("sparse_sync_real", {
      "model": "SmolLM2-135M-Instruct (configs/smollm2_grpo.py)", "steps": steps,
      "overrides": {"sampler.dtype": "bfloat16", "rollout.weight_sync": "sparse"}, "runs": runs}, args.out, argv)


if __name__ == "__main__":
  print(main())
