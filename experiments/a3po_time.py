"""A-3PO's time saving: decoupled PPO (π_prox scored by an extra forward) against A-3PO (π_prox interpolated).

Both at fixed lag 4 on the tiny policy after its SFT warm start (`configs/default.py`, 2-digit addition), eval off:
decoupled PPO's π_prox is the learner's forward at each token's generating version (`rollout.old_logp=recompute`,
scored when the batch is generated, on the learner thread), A-3PO's is log μ + α·(log π_θ − log μ) with no forward
(`config.scores_prox`). Per run: the mean seconds per learner step after the first `skip` (compilation); arms
alternate within each repeat on the same machine. The report compares the saving with the abstract's 18 %.

    python -m experiments.a3po_time           # CI-sized
    python -m experiments.a3po_time --full

Writes experiments/results/a3po_time.json; `python -m experiments.report` renders it.
"""

from __future__ import annotations

import json
import os

from experiments import common
from experiments.async_throughput import timed_run

BASE = {"optim.lr": 1e-4, "rollout.prompts_per_step": 16, "rollout.group_size": 8, "eval.every": 0,
        "rollout.mode": "fixed_lag", "rollout.lag": 4, "rollout.old_logp": "recompute", **common.TASKS["arithmetic"]}
ARMS = {"decoupled_ppo": {"loss.name": "decoupled_ppo"}, "a3po": {"loss.name": "a3po"}}
SETTINGS = {"ci": {"steps": 40, "skip": 5, "repeats": 3}, "full": {"steps": 200, "skip": 10, "repeats": 3}}


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  args = p.parse_args(argv)
  name = "full" if args.full else "ci"
  setting = SETTINGS[name]
  steps = args.steps or setting["steps"]
  skip = min(setting["skip"], max(0, steps - 1))
  repeats = args.seeds or setting["repeats"]
  if args.dry_run:
    print({a: common.check_config(args.base, {**BASE, **o}) for a, o in ARMS.items()})
    return ""
  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  warm = common.warm_start(args.base, {**BASE, "seed": 0}, os.path.join(args.workdir, "warm", "arithmetic_s0"))
  results = []
  for rep in range(repeats):
    for a, o in ARMS.items():
      wd = os.path.join(args.workdir, "a3po_time", f"{a}_r{rep}")
      out = timed_run(args.base, {**BASE, **o, "seed": 0, "num_steps": steps, "model.init_from": warm,
                                  "sft.steps": 0}, wd, skip)
      results.append({"arm": a, "repeat": rep, **out})
      common.log(f"{a} rep {rep}: {json.dumps(out.get('timing', out.get('error')))}")
  return common.write_results("a3po_time", {
      "setting": name, "steps": steps, "skip": skip, "repeats": repeats, "base_overrides": BASE, "arms": ARMS,
      "runs": results}, args.out, argv)


if __name__ == "__main__":
  print(main())
