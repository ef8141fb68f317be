"""Staleness ablation: correction methods × fixed lags × seeds on two tasks.

Every run starts from the same SFT warm start of its (task, seed) (exported once, reused through
`model.init_from`) and trains under `rollout.mode=fixed_lag`, so the batch of learner step t comes
from version max(0, t − lag): deterministic and bitwise repeatable. The learning rate is raised
over the demo's 1e-4 so that staleness visibly hurts the GRPO baseline within a CPU budget.

    python -m experiments.staleness_ablation            # CI-sized (≈15 min on 2 CPU cores)
    python -m experiments.staleness_ablation --full     # real hardware: all methods, lags 0..128, 3 seeds
    python -m experiments.staleness_ablation --real     # SmolLM2-135M-Instruct (make smollm2), CPU-sized
    python -m experiments.staleness_ablation --real --full   # the real-model grid for an accelerator

The real-model settings start every run from the pretrained checkpoint of configs/smollm2_grpo.py
(no SFT warm start: the instruct model already answers in the expected format) on `arithmetic_chat`.
They are slow on a CPU (about 30 s per learner step on 2 cores), so their results accumulate: each
finished run is written to `experiments/results/staleness_smollm2.json` at once, a later invocation
skips the (method, lag, seed) cells already there (`--redo` reruns them), and the report lists the
cells still missing. The plan puts the GRPO baseline at lag 0 and the largest lag first, seed by seed.
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


# The real model (configs/smollm2_grpo.py): 4 prompts x 8 completions, 16 new tokens, lr 1e-5. At lag 0
# GRPO moves held-out greedy accuracy from about 0.19 to about 0.6 in 30 steps (closing note of #15), so
# this setting can show a lag-0 gain; 20 steps keep a run near 7 minutes on an idle 2-core CPU.
# The corrections are run at lag 4, where GRPO already degrades here (3 seeds); lag 16 comes last (CPU time).
# Lag 16 used to keep 17 parameter snapshots and was OOM-killed at 24 GB RSS on the 23 GB development
# machine; `fixed_lag` now keeps one snapshot and queues the batches it generated ahead.
REAL_TASK = "arithmetic_chat"
REAL_CORRECTIONS = ["m2po", "tis", "decoupled_ppo", "vespo", "dppo"]
REAL_SETTINGS = {
    "ci": {"steps": 20, "eval_every": 5, "seeds": 3, "base": "smollm2_grpo",
           "grid": [(REAL_TASK, ["grpo"], [0, 4])] + [(REAL_TASK, [m], [4, 0]) for m in REAL_CORRECTIONS]
           + [(REAL_TASK, [m], [16]) for m in ["grpo"] + REAL_CORRECTIONS]},
    # An accelerator: longer runs, larger batches, a wider lag sweep, every key method.
    "full": {"steps": 200, "eval_every": 20, "seeds": 3, "base": "smollm2_grpo",
             "overrides": {"rollout.prompts_per_step": 32, "rollout.group_size": 8, "eval.num_prompts": 512,
                           "task.held_out": 512, "sampler.max_new_tokens": 32},
             "grid": [(REAL_TASK, ["grpo"] + REAL_CORRECTIONS, [0, 4, 16, 64])]},
}
# "decoupled_ppo (with minibatches)": two optimiser updates per batch, so its proximal ratio departs from 1.
# `tis` scores π_old with the learner's parameters at the start of the step, as verl recomputes `old_log_prob`
# with the current actor, so its truncated weight min(π_old/μ, C) carries the staleness. With π_old recomputed
# at the behaviour version (the default), an fp32 sampler makes that weight 1: three seeds at lag 4 then gave
# grpo's curves exactly, which answers nothing about staleness.
REAL_METHOD_EXTRAS = {"decoupled_ppo": {"optim.minibatches": 2}, "tis": {"rollout.old_logp": "step_start"}}


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


def real_overrides(r: dict, steps: int, eval_every: int, extra: dict) -> dict:
  """A real-model run: the base config's checkpoint and task, the method, the lag, the seed."""
  return {**extra, "task.name": r["task"], **methods.overrides(r["method"]),
          **REAL_METHOD_EXTRAS.get(r["method"], {}), "seed": r["seed"], "num_steps": steps,
          "eval.every": eval_every, "rollout.mode": "fixed_lag", "rollout.lag": r["lag"]}


def main_real(args, argv) -> str:
  """The real-model grid; results accumulate in staleness_smollm2.json (one write per finished run)."""
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, REAL_SETTINGS)
  grid = setting["grid"]
  if args.methods:
    keep = args.methods.split(",")
    grid = [(t, [m for m in ms if m in keep], lags) for t, ms, lags in grid]
  if args.lags:
    grid = [(t, ms, [int(x) for x in args.lags.split(",")]) for t, ms, _ in grid]
  runs = plan({"grid": grid}, seeds)
  extra = dict(setting.get("overrides", {}))

  def run_cell(r: dict) -> dict:
    wd = os.path.join(args.workdir, "staleness_real", f"{r['method']}_lag{r['lag']}_s{r['seed']}")
    out = common.run_one(setting["base"], real_overrides(r, steps, eval_every, extra), wd)
    shutil_rm(wd)  # a real-model checkpoint is ~1.6 GB
    return out

  return common.run_cells(
      "staleness_smollm2", "staleness_ablation", runs, ("task", "method", "lag", "seed"),
      steps, args, run_cell,
      {"setting": f"smollm2-{name}", "model": "SmolLM2-135M-Instruct (configs/smollm2_grpo.py)", "seeds": seeds,
       "base_overrides": {**extra, "base_config": setting["base"]},
       "methods": {m: {**methods.overrides(m), **REAL_METHOD_EXTRAS.get(m, {})} for m in methods.METHODS},
       "baseline": methods.BASELINE}, argv)


def shutil_rm(path: str) -> None:
  import shutil
  shutil.rmtree(path, ignore_errors=True)


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct from configs/smollm2_grpo.py")
  p.add_argument("--redo", action="store_true", help="(--real) rerun cells already in the results file")
  p.add_argument("--methods", default="", help="comma-separated subset of methods (default: the setting's)")
  p.add_argument("--lags", default="", help="comma-separated lags replacing the setting's")
  p.add_argument("--tasks", default="", help="comma-separated subset of tasks")
  p.add_argument("--lr", type=float, default=None, help=f"learner learning rate (default {BASE['optim.lr']})")
  args = p.parse_args(argv)
  if args.real:
    return main_real(args, argv)
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
