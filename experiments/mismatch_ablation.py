"""Train/inference mismatch ablation: a bf16 sampler against the fp32 learner, with and without corrections.

The sampler really runs in bfloat16 (`sampler.dtype=bfloat16`) while the learner recomputes π_old
in float32 (`rollout.old_logp=recompute`), so ρ = π_old/μ measures a real precision gap, never a
faked one. Methods: uncorrected `pg` (no ratio at all) and `ppo_clip` (anchored on π_old, blind to
μ), then TIS / MIS / IcePop, which reweight or mask by ρ. int8 and MoE-routing samplers are
reported as "not available" while the config has no such option.

    python -m experiments.mismatch_ablation             # CI-sized
    python -m experiments.mismatch_ablation --full
    python -m experiments.mismatch_ablation --real      # SmolLM2-135M-Instruct (hours on a CPU; accumulates)
"""

from __future__ import annotations

import os
import shutil

from experiments import common

BASE = {"optim.lr": 2e-4, "optim.warmup_steps": 5, "rollout.prompts_per_step": 8, "rollout.group_size": 8,
        "eval.num_prompts": 256, "rollout.mode": "sync", "rollout.old_logp": "recompute"}

METHODS = {
    "pg": {"loss.name": "pg"},
    "ppo_clip": {"loss.name": "ppo_clip"},
    "tis": {"loss.name": "tis"},
    "mis": {"loss.name": "mis"},
    "icepop": {"loss.name": "icepop"},
}

# Sampler variants: config overrides, or None when this build of the config has no such option.
SAMPLERS = {
    "fp32": {"sampler.dtype": "float32"},
    "bf16": {"sampler.dtype": "bfloat16"},
    "int8": {"sampler.quantize": "int8"},
    # MoE policy (own warm start) sampled in bf16: precision gaps can flip top-k routing decisions.
    "moe_bf16": {"model.num_experts": 4, "sampler.dtype": "bfloat16"},
}

SETTINGS = {
    "ci": {"steps": 80, "eval_every": 20, "seeds": 1, "tasks": ["arithmetic"]},
    "full": {"steps": 400, "eval_every": 25, "seeds": 3, "tasks": ["arithmetic", "countdown"]},
}


# The real model (configs/smollm2_grpo.py, the staleness grid's setting: 4 x 8 rollouts, 16 new tokens,
# lr 1e-5, 20 steps, lag 0). Its measured bf16 gap is ~0.025 nats per token (`mismatch_real`), so the
# question is whether that gap changes uncorrected PG's training, and whether the corrections change it
# back. The corrections' fp32 cells are left out on the CPU grid: with an fp32 sampler ρ = π_old/μ is 1
# up to 5e-6, so each equals uncorrected PG on-policy (the on-policy invariance tests); `--full` runs them.
REAL_SETTINGS = {
    "ci": {"steps": 20, "eval_every": 5, "seeds": 3, "base": "smollm2_grpo",
           "cells": [("fp32", "pg"), ("bf16", "pg"), ("bf16", "tis"), ("bf16", "icepop"), ("bf16", "mis"),
                     ("int8", "pg")]},
    "full": {"steps": 200, "eval_every": 20, "seeds": 3, "base": "smollm2_grpo",
             "overrides": {"rollout.prompts_per_step": 32, "rollout.group_size": 8, "eval.num_prompts": 512,
                           "task.held_out": 512, "sampler.max_new_tokens": 32},
             "cells": [(s, m) for s in ("fp32", "bf16", "int8") for m in METHODS]},
}
REAL_TASK = "arithmetic_chat"


def main_real(args, argv) -> str:
  """The real-model grid, seed-major (every cell of seed 0 first); results accumulate in mismatch_smollm2.json."""
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, REAL_SETTINGS)
  keep = args.methods.split(",") if args.methods else list(METHODS)
  runs = [{"task": REAL_TASK, "sampler": s, "method": m, "seed": seed}
          for seed in range(seeds) for s, m in setting["cells"] if m in keep]
  extra = dict(setting.get("overrides", {}))

  def run_cell(r: dict) -> dict:
    over = {**extra, "task.name": REAL_TASK, **METHODS[r["method"]], **SAMPLERS[r["sampler"]], "seed": r["seed"],
            "num_steps": steps, "eval.every": eval_every, "rollout.mode": "sync", "rollout.old_logp": "recompute"}
    wd = os.path.join(args.workdir, "mismatch_real", f"{r['sampler']}_{r['method']}_s{r['seed']}")
    out = common.run_one(setting["base"], over, wd)
    shutil.rmtree(wd, ignore_errors=True)  # a real-model checkpoint is ~1.6 GB
    return out

  return common.run_cells(
      "mismatch_smollm2", "mismatch_ablation", runs, ("task", "sampler", "method", "seed"),
      steps, args, run_cell,
      {"setting": f"smollm2-{name}", "model": "SmolLM2-135M-Instruct (configs/smollm2_grpo.py)", "seeds": seeds,
       "base_overrides": {**extra, "base_config": setting["base"], "rollout.mode": "sync",
                          "rollout.old_logp": "recompute"},
       "methods": METHODS, "samplers": {s: SAMPLERS[s] for s in dict.fromkeys(s for s, _ in setting["cells"])}}, argv)


def sampler_availability(task: str, base: str = "default") -> dict:
  """Sampler variant -> None (available) or the reason it is not, from the config schema + validation."""
  out = {}
  for name, over in SAMPLERS.items():
    try:
      c = common.make_config(base, {**common.TASKS[task]})
      for dotted in over:
        *path, leaf = dotted.split(".")
        node = c
        for part in path:
          node = node[part]
        if leaf not in node:
          raise KeyError(f"config.{dotted} does not exist in configs/default.py / jaxrl_llm/config.py")
      out[name] = common.check_config(base, {**common.TASKS[task], **over}) or _unwired_model_fields(base, task, over)
    except KeyError as e:
      out[name] = f"not available yet: {e.args[0]}"
  return out


def _unwired_model_fields(base: str, task: str, over: dict) -> str | None:
  """A reason when a `model.*` override validates but does not reach the model the loop builds."""
  from jaxrl_llm import policy_init
  c = common.make_config(base, {**common.TASKS[task], **over})
  mc = policy_init.model_config(c, 8)
  for dotted, value in over.items():
    if dotted.startswith("model.") and getattr(mc, dotted.split(".", 1)[1], None) != value:
      return f"not available yet: config.{dotted} is accepted but jaxrl_llm.policy_init.model_config does not pass it on"
  return None


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--methods", default="", help="comma-separated subset of methods")
  p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct from configs/smollm2_grpo.py")
  p.add_argument("--redo", action="store_true", help="(--real) rerun cells already in the results file")
  args = p.parse_args(argv)
  if args.real:
    return main_real(args, argv)
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, SETTINGS)
  ms = args.methods.split(",") if args.methods else list(METHODS)
  avail = {t: sampler_availability(t, args.base) for t in setting["tasks"]}
  runs = [{"task": t, "sampler": s, "method": m, "seed": seed}
          for t in setting["tasks"] for seed in range(seeds) for s in SAMPLERS if avail[t][s] is None for m in ms]
  if args.dry_run:
    print(avail)
    for r in runs:
      print(r)
    return ""

  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  results = []
  for i, r in enumerate(runs):
    if avail[r["task"]][r["sampler"]] is not None:  # its warm start failed earlier
      continue
    # The warm start must have the variant's architecture (a MoE policy needs its own).
    arch = {k: v for k, v in SAMPLERS[r["sampler"]].items() if k.startswith("model.")}
    tag = "".join(f"_{k.split('.')[-1]}{v}" for k, v in arch.items())
    try:
      warm = common.warm_start(args.base, {**BASE, **common.TASKS[r["task"]], **arch, "seed": r["seed"]},
                               os.path.join(args.workdir, "warm", f"{r['task']}{tag}_s{r['seed']}"))
    except Exception as e:  # noqa: BLE001 -- an unsupported variant is reported, not fatal
      avail[r["task"]][r["sampler"]] = f"not available yet: warm start failed: {type(e).__name__}: {e}"
      common.log(avail[r["task"]][r["sampler"]])
      continue
    over = {**BASE, **common.TASKS[r["task"]], **METHODS[r["method"]], **SAMPLERS[r["sampler"]],
            "seed": r["seed"], "num_steps": steps, "eval.every": eval_every, "model.init_from": warm, "sft.steps": 0}
    wd = os.path.join(args.workdir, "mismatch", f"{r['task']}_{r['sampler']}_{r['method']}_s{r['seed']}")
    out = common.run_one(args.base, over, wd)
    results.append({**r, **out})
    s = out.get("summary", {})
    common.log(f"{i + 1}/{len(runs)} {r} acc -> {s.get('eval_accuracy_late')} "
               f"mismatch {s.get('mismatch_abs_mean')} ({out.get('wall_s', 0):.0f}s)")
  return common.write_results("mismatch_ablation", {
      "setting": name, "steps": steps, "seeds": seeds, "base_overrides": BASE, "methods": METHODS,
      "samplers": SAMPLERS, "availability": avail, "runs": results}, args.out, argv)


if __name__ == "__main__":
  print(main())
