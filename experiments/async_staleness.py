"""AReaL-style η table: real asynchronous training (`rollout.mode=async`) at staleness bounds η.

Rollout worker threads generate continuously from the newest snapshot; admission keeps every
consumed lag ≤ η (`rollout.lag`). Reports held-out accuracy, measured lag and learner idle time
per (method, η). If the config validation rejects `async`, the results file says "not available"
with the validation message and no run is made.

    python -m experiments.async_staleness               # CI-sized
    python -m experiments.async_staleness --full
"""

from __future__ import annotations

import os

from experiments import common, methods
from experiments.staleness_ablation import BASE

SETTINGS = {
    "ci": {"steps": 60, "eval_every": 20, "seeds": 1, "etas": [0, 4], "methods": ["grpo", "decoupled_ppo"]},
    "full": {"steps": 400, "eval_every": 25, "seeds": 3, "etas": [0, 1, 2, 4, 8, 16],
             "methods": ["grpo", "decoupled_ppo", "a3po", "m2po", "vespo"]},
}


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--etas", default="", help="comma-separated staleness bounds η")
  p.add_argument("--methods", default="", help="comma-separated methods")
  args = p.parse_args(argv)
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, SETTINGS)
  etas = [int(x) for x in args.etas.split(",")] if args.etas else setting["etas"]
  ms = args.methods.split(",") if args.methods else setting["methods"]
  task = common.TASKS["arithmetic"]
  rejected = common.check_config(args.base, {**BASE, **task, "rollout.mode": "async", "rollout.lag": max(etas)})
  runs = [{"task": "arithmetic", "method": m, "eta": eta, "seed": s} for s in range(seeds) for m in ms for eta in etas]
  if args.dry_run:
    print("async:", "available" if rejected is None else f"not available: {rejected}")
    for r in runs:
      print(r)
    return ""
  if rejected is not None:
    common.log(f"async mode not available: {rejected}")
    return common.write_results("async_staleness", {
        "setting": name, "available": False, "reason": f"not available: {rejected}", "runs": []}, args.out, argv)

  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  results = []
  for r in runs:
    warm = common.warm_start(args.base, {**BASE, **task, "seed": r["seed"]},
                             os.path.join(args.workdir, "warm", f"arithmetic_s{r['seed']}"))
    over = {**BASE, **task, **methods.overrides(r["method"]), "seed": r["seed"], "num_steps": steps,
            "eval.every": eval_every, "rollout.mode": "async", "rollout.lag": r["eta"],
            "model.init_from": warm, "sft.steps": 0}
    wd = os.path.join(args.workdir, "async", f"{r['method']}_eta{r['eta']}_s{r['seed']}")
    out = common.run_one(args.base, over, wd)
    results.append({**r, **out})
    s = out.get("summary", {})
    common.log(f"{r} acc -> {s.get('eval_accuracy_late')} lag_max {s.get('lag_max')} ({out.get('wall_s', 0):.0f}s)"
               f"{' ' + out['error'] if 'error' in out else ''}")
  return common.write_results("async_staleness", {
      "setting": name, "available": True, "steps": steps, "seeds": seeds, "etas": etas, "base_overrides": BASE,
      "methods": {m: methods.overrides(m) for m in ms}, "runs": results}, args.out, argv)


if __name__ == "__main__":
  print(main())
