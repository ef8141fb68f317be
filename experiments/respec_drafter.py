"""ReSpec's drafter distillation: does distilling the speculative drafter on rollouts raise its acceptance?

Arms, on the tiny policy after its SFT warm start (`configs/default.py`, 2-digit addition), speculative decoding
with γ = 4 drafted tokens per policy call and a 1-layer drafter of the 2-layer policy:
- `layers`: the drafter is a view of the policy's first layer (always as fresh as the policy, never trained);
- `distilled`: the drafter is its own copy of that layer, distilled after every learner step on the step's batch
  toward the updated policy (`sampler.spec_drafter="distilled"`, ReSpec).
Per run: `spec_accept_rate` (drafted tokens the policy accepted) over the first and the last fifth of the steps,
and held-out accuracy (speculative sampling keeps the policy's distribution, so accuracy should not move).

    python -m experiments.respec_drafter           # CI-sized
    python -m experiments.respec_drafter --full

Writes experiments/results/respec_drafter.json; `python -m experiments.report` renders it.
"""

from __future__ import annotations

import json
import os

from experiments import common

BASE = {"optim.lr": 2e-4, "optim.warmup_steps": 5, "rollout.prompts_per_step": 8, "rollout.group_size": 8,
        "eval.num_prompts": 256, "rollout.mode": "sync", "sampler.spec_gamma": 4, "sampler.spec_draft_layers": 1,
        **common.TASKS["arithmetic"]}
ARMS = {"layers": {"sampler.spec_drafter": "layers"}, "distilled": {"sampler.spec_drafter": "distilled"}}
SETTINGS = {
    "ci": {"steps": 100, "eval_every": 50, "seeds": 5},
    "full": {"steps": 400, "eval_every": 50, "seeds": 5},
}


def acceptance(workdir: str) -> dict:
  """Mean `spec_accept_rate` over the first and the last fifth of a run's steps."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rates = [r["spec_accept_rate"] for r in map(json.loads, filter(str.strip, f)) if "spec_accept_rate" in r]
  if not rates:
    return {"accept_first": None, "accept_last": None}
  k = max(1, len(rates) // 5)
  return {"accept_first": sum(rates[:k]) / k, "accept_last": sum(rates[-k:]) / k}


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  args = p.parse_args(argv)
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, SETTINGS)
  runs = [{"arm": a, "seed": s} for s in range(seeds) for a in ARMS]
  over = lambda r: {**BASE, **ARMS[r["arm"]], "seed": r["seed"], "num_steps": steps, "eval.every": eval_every}
  return common.run_seeded("respec_drafter", args, argv, runs, over, {
      "setting": name, "steps": steps, "seeds": seeds, "eval_every": eval_every, "base_config": args.base,
      "base_overrides": BASE, "arms": ARMS}, after=acceptance,
      warm={k: v for k, v in BASE.items() if not k.startswith("sampler.")})  # the SFT needs no drafter


if __name__ == "__main__":
  print(main())
