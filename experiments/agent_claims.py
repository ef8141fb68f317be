"""Multi-turn claims one comparison decides: EPO against GRPO on the tiny guess-the-number agent.

EPO (entropy-regularised policy optimisation for multi-turn agents with sparse rewards) claims more stable
training and higher task success than the PPO/GRPO it extends. Every cell of a seed runs the SFT warm start of
`configs/agent_sft_tiny.py` (scripted demonstrations; the same for every cell of the seed), then RL at lag 0; the
held-out metric is greedy episode success on seeds no training episode uses (`eval_accuracy`). Claims compare per
seed (`experiments/report.py`).

    python -m experiments.agent_claims           # CI-sized (≈5 min on 2 idle cores)
    python -m experiments.agent_claims --full

Writes experiments/results/agent_claims.json; `python -m experiments.report` renders it.
"""

from __future__ import annotations

from experiments import common, methods

BASE_CONFIG = "agent_sft_tiny"
CELLS = {
    "grpo": methods.overrides("grpo"),
    "epo": {"loss.name": "epo"},
}
# (claim, source, cell a, cell b, rule, options): rules and options in `report.cell_claims`.
CLAIMS = [
    ("EPO beats GRPO on held-out multi-turn episode success", "EPO (seed abstract)", "epo", "grpo", "exceeds", {}),
]
SETTINGS = {
    "ci": {"steps": 60, "eval_every": 10, "seeds": 5},
    "full": {"steps": 200, "eval_every": 20, "seeds": 5},
}


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.set_defaults(base=BASE_CONFIG)
  p.add_argument("--cells", default="", help="comma-separated subset of the cells")
  p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start steps (default: the config's; tests)")
  args = p.parse_args(argv)
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, SETTINGS)
  cells = args.cells.split(",") if args.cells else list(CELLS)
  runs = [{"cell": c, "seed": s} for s in range(seeds) for c in cells]
  sft = {} if args.sft_steps is None else {"sft.steps": args.sft_steps}
  over = lambda r: {**CELLS[r["cell"]], **sft, "seed": r["seed"], "num_steps": steps, "eval.every": eval_every}
  # No shared warm start: each run does its seed's SFT (deterministic: the same parameters for every cell).
  return common.run_seeded("agent_claims", args, argv, runs, over, {
      "setting": name, "steps": steps, "seeds": seeds, "eval_every": eval_every, "base_config": args.base,
      "cells": {c: CELLS[c] for c in cells}, "claims": CLAIMS})


if __name__ == "__main__":
  print(main())
