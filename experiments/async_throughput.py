"""Wall-clock per learner step and learner idle fraction: sync vs fixed_lag vs staged (vs async).

Idle time is the part of a learner step spent waiting for rollouts: `time_generate_s` in the
single-threaded modes (the learner thread generates the batch itself), `time_learner_idle_s` in
async mode (the learner waits on the rollout buffer while worker threads generate). The first
`--skip` steps (compilation) are left out of every mean.

    python -m experiments.async_throughput              # CI-sized
    python -m experiments.async_throughput --full
    python -m experiments.async_throughput --real       # SmolLM2-135M-Instruct (configs/smollm2_grpo.py): sync vs async

`--real` starts every run from the pretrained checkpoint with the base config's batch (4 prompts x 8
completions, 16 new tokens), no evaluation, and writes `async_throughput_smollm2.json`. On a CPU the
async workers and the learner share the same cores, so its idle fraction measures how much of the
generation hides behind the learner step when both compete for them; on an accelerator with
`rollout.sampler_devices` they run side by side.
"""

from __future__ import annotations

import os

from experiments import common

BASE = {"optim.lr": 1e-4, "rollout.prompts_per_step": 16, "rollout.group_size": 8, "eval.every": 0,
        "loss.name": "ppo_clip"}

MODES = {
    "sync": {"rollout.mode": "sync", "rollout.lag": 0},
    "fixed_lag": {"rollout.mode": "fixed_lag", "rollout.lag": 4},
    "staged": {"rollout.mode": "staged", "rollout.lag": 4},
    "async": {"rollout.mode": "async", "rollout.lag": 4},
}

SETTINGS = {"ci": {"steps": 40, "skip": 5, "repeats": 1}, "full": {"steps": 200, "skip": 10, "repeats": 3},
            "real": {"steps": 8, "skip": 2, "repeats": 1}}
# The real model: its config's batch and lr; eval off; only the final checkpoint (deleted after the run).
REAL_BASE = {"eval.every": 0, "checkpoint.every": 0}
REAL_MODES = {"sync": {"rollout.mode": "sync", "rollout.lag": 0},
              "async": {"rollout.mode": "async", "rollout.lag": 2, "rollout.num_workers": 1}}


def timing(rows: list[dict], skip: int) -> dict:
  """Mean step time, idle time and idle fraction over rows[skip:]."""
  rows = rows[skip:] or rows
  step = [r["time_step_s"] for r in rows]
  idle = [r.get("time_learner_idle_s", r.get("time_generate_s", 0.0)) for r in rows]
  total = sum(step)
  return {"time_step_s": total / len(step), "time_idle_s": sum(idle) / len(idle),
          "idle_frac": sum(idle) / total if total > 0 else None,
          "steps_per_s": len(step) / total if total > 0 else None, "timed_steps": len(step)}


def timed_run(base: str, overrides: dict, workdir: str, skip: int) -> dict:
  """`common.run_one` plus the `timing` of its rows (curves dropped: the timing is what this script keeps)."""
  from jaxrl_llm import metrics as metrics_lib
  out = common.run_one(base, overrides, workdir)
  if "error" not in out:
    out["timing"] = timing(metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")), skip)
    out.pop("curves", None)
  return out


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--lag", type=int, default=None, help="k / stage length / η of the non-sync modes")
  p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct from configs/smollm2_grpo.py")
  args = p.parse_args(argv)
  if args.real:
    return main_real(args, argv)
  name = "full" if args.full else "ci"
  setting = SETTINGS[name]
  steps = args.steps or setting["steps"]
  skip = min(setting["skip"], max(0, steps - 1))
  repeats = args.seeds or setting["repeats"]
  modes = {m: {**o, **({"rollout.lag": args.lag} if args.lag and m != "sync" else {})} for m, o in MODES.items()}
  task = common.TASKS["arithmetic"]
  avail = {m: common.check_config(args.base, {**BASE, **task, **o}) for m, o in modes.items()}
  if args.dry_run:
    print(avail)
    return ""

  import json
  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  warm = common.warm_start(args.base, {**BASE, **task, "seed": 0}, os.path.join(args.workdir, "warm", "arithmetic_s0"))
  results = []
  for rep in range(repeats):
    for m, o in modes.items():
      if avail[m] is not None:
        continue
      wd = os.path.join(args.workdir, "throughput", f"{m}_r{rep}")
      out = timed_run(args.base, {**BASE, **task, **o, "seed": 0, "num_steps": steps, "model.init_from": warm,
                                  "sft.steps": 0}, wd, skip)
      results.append({"mode": m, "lag": o["rollout.lag"], "repeat": rep, **out})
      common.log(f"{m} rep {rep}: {json.dumps(out.get('timing', out.get('error')))}")
  return common.write_results("async_throughput", {
      "setting": name, "steps": steps, "skip": skip, "repeats": repeats, "base_overrides": BASE, "modes": modes,
      "availability": {m: ("available" if a is None else f"not available: {a}") for m, a in avail.items()},
      "runs": results}, args.out, argv)


def main_real(args, argv) -> str:
  """sync vs async on the pretrained 135M model (one run each, the base config's batch)."""
  import json
  import shutil
  setting = SETTINGS["real"]
  steps = args.steps or setting["steps"]
  skip = min(setting["skip"], max(0, steps - 1))
  modes = {m: {**o, **({"rollout.lag": args.lag} if args.lag and m != "sync" else {})} for m, o in REAL_MODES.items()}
  avail = {m: common.check_config("smollm2_grpo", {**REAL_BASE, **o}) for m, o in modes.items()}
  if args.dry_run:
    print(avail)
    return ""
  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  results = []
  for m, o in modes.items():
    if avail[m] is not None:
      continue
    wd = os.path.join(args.workdir, "throughput_real", m)
    out = timed_run("smollm2_grpo", {**REAL_BASE, **o, "seed": 0, "num_steps": steps}, wd, skip)
    shutil.rmtree(wd, ignore_errors=True)  # a real-model checkpoint is ~1.6 GB
    results.append({"mode": m, "lag": o["rollout.lag"], "repeat": 0, **out})
    common.log(f"{m}: {json.dumps(out.get('timing', out.get('error')))}")
  return common.write_results("async_throughput_smollm2", {
      "setting": "real", "model": "SmolLM2-135M-Instruct (configs/smollm2_grpo.py)", "steps": steps, "skip": skip,
      "repeats": 1, "base_overrides": {"base_config": "smollm2_grpo", **REAL_BASE}, "modes": modes,
      "availability": {m: ("available" if a is None else f"not available: {a}") for m, a in avail.items()},
      "runs": results}, args.out, argv, script="async_throughput")


if __name__ == "__main__":
  print(main())
