"""Staleness ablation: correction methods × fixed lags × seeds on two tasks.

Every run starts from the same SFT warm start of its (task, seed) (exported once, reused through
`model.init_from`) and trains under `rollout.mode=fixed_lag`, so the batch of learner step t comes
from version max(0, t − lag): deterministic and bitwise repeatable. The learning rate is raised
over the demo's 1e-4 so that staleness visibly hurts the GRPO baseline within a CPU budget.

    python -m experiments.staleness_ablation            # CI-sized (≈15 min on 2 CPU cores)
    python -m experiments.staleness_ablation --full     # real hardware: all methods, lags 0..128, 3 seeds
"""

from __future__ import annotations

import os

from experiments import common, methods

# Shared by both settings: a realistic-but-high lr for this model size, the demo model and batch.
BASE = {"optim.lr": 2e-4, "optim.warmup_steps": 5, "rollout.prompts_per_step": 8, "rollout.group_size": 8,
        "eval.num_prompts": 256}

SETTINGS = {
    # CI: every method at lag 0 and the largest lag on the default task, the GRPO baseline over a lag
    # sweep, and the stability-claim methods on countdown.
    "ci": {
        "steps": 100, "eval_every": 20, "seeds": 1,
        "grid": [
            ("arithmetic", list(methods.METHODS), [0, 32]),
            ("arithmetic", [methods.BASELINE], [8]),
            ("countdown", [methods.BASELINE, "m2po"], [0, 32]),
        ],
    },
    "full": {
        "steps": 400, "eval_every": 25, "seeds": 3,
        "grid": [
            ("arithmetic", list(methods.METHODS), [0, 2, 8, 32, 128]),
            ("countdown", list(methods.METHODS), [0, 2, 8, 32, 128]),
        ],
    },
}


def plan(setting: dict, seeds: int) -> list[dict]:
  """The (task, method, lag, seed) runs of a setting, in a cache-friendly order (method-major)."""
  runs, seen = [], set()
  for task, ms, lags in setting["grid"]:
    for seed in range(seeds):
      for m in ms:
        for lag in lags:
          key = (task, m, lag, seed)
          if key not in seen:
            seen.add(key)
            runs.append({"task": task, "method": m, "lag": lag, "seed": seed})
  return runs


def run_overrides(r: dict, steps: int, eval_every: int, init_from: str, shared: dict = BASE) -> dict:
  return {**shared, **common.TASKS[r["task"]], **methods.overrides(r["method"]),
          "seed": r["seed"], "num_steps": steps, "eval.every": eval_every,
          "rollout.mode": "fixed_lag", "rollout.lag": r["lag"],
          "model.init_from": init_from, "sft.steps": 0}


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--methods", default="", help="comma-separated subset of methods (default: the setting's)")
  p.add_argument("--lags", default="", help="comma-separated lags replacing the setting's")
  p.add_argument("--tasks", default="", help="comma-separated subset of tasks")
  p.add_argument("--lr", type=float, default=None, help=f"learner learning rate (default {BASE['optim.lr']})")
  args = p.parse_args(argv)
  shared = {**BASE, **({"optim.lr": args.lr} if args.lr else {})}
  name = "full" if args.full else "ci"
  setting = dict(SETTINGS[name])
  seeds = args.seeds or setting["seeds"]
  steps = args.steps or setting["steps"]
  eval_every = min(setting["eval_every"], max(1, steps))
  grid = setting["grid"]
  if args.methods:
    keep = args.methods.split(",")
    for m in keep:
      methods.overrides(m)
    grid = [(t, [m for m in ms if m in keep] or keep, lags) for t, ms, lags in grid]
  if args.lags:
    grid = [(t, ms, [int(x) for x in args.lags.split(",")]) for t, ms, _ in grid]
  if args.tasks:
    grid = [g for g in grid if g[0] in args.tasks.split(",")]
  runs = plan({"grid": grid}, seeds)
  if args.dry_run:
    for r in runs:
      print(r)
    return ""

  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  results = []
  for i, r in enumerate(runs):
    warm = common.warm_start(args.base, {**shared, **common.TASKS[r["task"]], "seed": r["seed"]},
                             os.path.join(args.workdir, "warm", f"{r['task']}_s{r['seed']}"))
    wd = os.path.join(args.workdir, "staleness", f"{r['task']}_{r['method']}_lag{r['lag']}_s{r['seed']}")
    out = common.run_one(args.base, run_overrides(r, steps, eval_every, warm, shared), wd)
    results.append({**r, **out})
    s = out.get("summary", {})
    common.log(f"{i + 1}/{len(runs)} {r} acc {s.get('eval_accuracy_initial')} -> {s.get('eval_accuracy_late')} "
               f"({out.get('wall_s', 0):.0f}s){' ' + out['error'] if 'error' in out else ''}")
  return common.write_results("staleness_ablation", {
      "setting": name, "steps": steps, "seeds": seeds, "base_overrides": shared, "tasks": common.TASKS,
      "methods": methods.METHODS, "baseline": methods.BASELINE, "runs": results}, args.out, argv)


if __name__ == "__main__":
  print(main())
