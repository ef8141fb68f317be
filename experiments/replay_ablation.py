"""Experience-replay ablation (spec B7): GRPO groups reused from a FIFO at replay ratios 1, 2 and 4.

Every arm trains the same number of learner steps from the same SFT warm start of its (task, seed)
under `rollout.mode=sync`; the replay arms generate `prompts_per_step / ratio` fresh groups per step
(`rollout.replay.fresh_per_step`) and fill the batch from the buffer (`jaxrl_llm/rollout/replay.py`).
Per run it records held-out accuracy against learner steps, generated groups (sampler work) and
training wall time, and each arm's accuracy at equal generated groups and at equal time: its eval
curve interpolated at the cheapest arm's end point.

    python -m experiments.replay_ablation            # CI-sized (one seed, arithmetic)
    python -m experiments.replay_ablation --full     # real hardware: 3 seeds, two tasks, more steps
"""

from __future__ import annotations

import os
import statistics

from experiments import common, methods
from experiments.staleness_ablation import BASE

# Buffer capacity in batches (capacity = CAPACITY_BATCHES · prompts_per_step groups).
CAPACITY_BATCHES = 4
# Arm -> replay settings; `ratio` = prompts_per_step / fresh_per_step, the target replay ratio
# (consumed / generated groups). None = replay off: every group is generated fresh and used once.
# No reuse limit (the paper's buffer never removes a sampled item): with the batch drawn from a full FIFO
# of CAPACITY_BATCHES batches a group is then sampled `ratio` times on average.
ARMS: dict[str, dict | None] = {
    "no_replay": None,
    "replay_r2": {"ratio": 2, "reuse_limit": 0, "recency": 1.0, "stale_policy": "keep", "max_lag": -1},
    "replay_r4_recent": {"ratio": 4, "reuse_limit": 0, "recency": 0.7, "stale_policy": "keep", "max_lag": -1},
    "replay_r4_drop": {"ratio": 4, "reuse_limit": 0, "recency": 0.7, "stale_policy": "drop", "max_lag": 4},
}
BASELINE = "no_replay"
# ppo_clip with π_old recomputed at each token's generating version: the importance ratio of a replayed
# group is taken against the policy that generated it, so the loss stays correct off-policy.
METHOD = "grpo"

SETTINGS = {
    "ci": {"steps": 150, "eval_every": 25, "seeds": 1, "tasks": ["arithmetic"], "arms": list(ARMS)},
    "full": {"steps": 400, "eval_every": 25, "seeds": 3, "tasks": ["arithmetic", "countdown"], "arms": list(ARMS)},
}


def arm_overrides(arm: str, prompts_per_step: int) -> dict:
  """`rollout.replay.*` overrides of `arm` (KeyError naming the valid arms otherwise)."""
  if arm not in ARMS:
    raise KeyError(f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")
  a = ARMS[arm]
  if a is None:
    return {"rollout.replay.capacity": 0}
  return {"rollout.replay.capacity": CAPACITY_BATCHES * prompts_per_step,
          "rollout.replay.fresh_per_step": prompts_per_step // a["ratio"],
          **{f"rollout.replay.{k}": v for k, v in a.items() if k != "ratio"}}


def run_overrides(r: dict, steps: int, eval_every: int, init_from: str, old_logp: str = "recompute") -> dict:
  return {**BASE, **common.TASKS[r["task"]], **methods.overrides(METHOD),
          **arm_overrides(r["arm"], BASE["rollout.prompts_per_step"]), "seed": r["seed"], "num_steps": steps,
          "eval.every": eval_every, "rollout.mode": "sync", "rollout.old_logp": old_logp,
          "model.init_from": init_from, "sft.steps": 0}


def train_times(rows: list[dict]) -> list[float]:
  """Per-step wall time without compilation and evaluation: the first step and the evaluation steps
  count as the run's median plain step (every arm evaluates at the same steps; the eval is no training)."""
  raw = [float(r["time_step_s"]) for r in rows]
  plain = [t for i, (t, r) in enumerate(zip(raw, rows)) if i > 0 and "eval_accuracy" not in r]
  if not plain:
    return raw
  typical = statistics.median(plain)
  return [t if i > 0 and "eval_accuracy" not in r else typical for i, (t, r) in enumerate(zip(raw, rows))]


def costs(rows: list[dict], prompts_per_step: int, initial_accuracy: float | None) -> dict:
  """Sampler work and time of one run, and its eval curve against both (the warm start is point 0)."""
  groups_t = [int(r.get("replay_generated_groups", prompts_per_step)) for r in rows]
  time_t = train_times(rows)
  curve = {"steps_done": [0], "generated_groups": [0], "time_train_s": [0.0], "eval_accuracy": [initial_accuracy]}
  g_cum, s_cum = 0, 0.0
  for r, g, s in zip(rows, groups_t, time_t):
    g_cum, s_cum = g_cum + g, s_cum + s
    if "eval_accuracy" in r:
      for k, v in (("steps_done", r["step"] + 1), ("generated_groups", g_cum), ("time_train_s", s_cum),
                   ("eval_accuracy", r["eval_accuracy"])):
        curve[k].append(v)
  consumed = prompts_per_step * len(rows)
  uses = [r["replay_mean_uses"] for r in rows if "replay_mean_uses" in r]
  steady = rows[1:] or rows  # the first step pays for compilation
  return {"generated_groups": g_cum, "consumed_groups": consumed, "replay_ratio": consumed / max(g_cum, 1),
          "time_train_s": s_cum, "time_total_s": sum(float(r["time_step_s"]) for r in rows),
          "time_step_s": s_cum / max(len(rows), 1),
          "time_generate_step_s": sum(float(r.get("time_generate_s", 0.0)) for r in steady) / len(steady),
          "mean_uses": sum(uses) / len(uses) if uses else 1.0, "curve": curve}


def interp(xs: list[float], ys: list[float | None], x: float) -> float | None:
  """Piecewise-linear y(x) on increasing xs; None beyond the last point or when a bracketing y is missing."""
  pts = [(a, b) for a, b in zip(xs, ys) if b is not None]
  if not pts or x > pts[-1][0] * (1 + 1e-9):
    return None
  if x <= pts[0][0]:
    return pts[0][1]
  for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
    if x <= x1:
      return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
  return pts[-1][1]


def at_budgets(runs: list[dict]) -> None:
  """Adds `at_budget` to each run: accuracy at the generated groups and train time of the cheapest arm of
  its (task, seed), by interpolating the run's eval curve (equal sampler work, equal wall time)."""
  for key in {(r["task"], r["seed"]) for r in runs}:
    rs = [r for r in runs if (r["task"], r["seed"]) == key and "costs" in r]
    if not rs:
      continue
    groups = min(r["costs"]["generated_groups"] for r in rs)
    secs = min(r["costs"]["time_train_s"] for r in rs)
    for r in rs:
      c = r["costs"]["curve"]
      r["at_budget"] = {"generated_groups": groups, "eval_accuracy_at_groups": interp(
          c["generated_groups"], c["eval_accuracy"], groups), "time_train_s": secs,
          "eval_accuracy_at_time": interp(c["time_train_s"], c["eval_accuracy"], secs)}


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--arms", default="", help=f"comma-separated subset of arms ({', '.join(ARMS)})")
  p.add_argument("--tasks", default="", help="comma-separated subset of tasks")
  p.add_argument("--old-logp", default="recompute", help="rollout.old_logp of every arm (recompute | behavior)")
  args = p.parse_args(argv)
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, SETTINGS)
  arms = args.arms.split(",") if args.arms else setting["arms"]
  tasks = args.tasks.split(",") if args.tasks else setting["tasks"]
  n = BASE["rollout.prompts_per_step"]
  for a in arms:
    arm_overrides(a, n)
  runs = [{"task": t, "arm": a, "seed": s} for s in range(seeds) for t in tasks for a in arms]
  if args.dry_run:
    for r in runs:
      rejected = common.check_config(args.base, run_overrides(r, steps, eval_every, "", args.old_logp))
      print({**r, "replay": arm_overrides(r["arm"], n), "config": "valid" if rejected is None else rejected})
    return ""

  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  results = []
  from jaxrl_llm import metrics as metrics_lib
  for i, r in enumerate(runs):
    warm = common.warm_start(args.base, {**BASE, **common.TASKS[r["task"]], "seed": r["seed"]},
                             os.path.join(args.workdir, "warm", f"{r['task']}_s{r['seed']}"))
    wd = os.path.join(args.workdir, "replay", f"{r['task']}_{r['arm']}_s{r['seed']}")
    out = common.run_one(args.base, run_overrides(r, steps, eval_every, warm, args.old_logp), wd)
    if "summary" in out:  # the per-step replay fields are in the run's metrics stream
      rows = metrics_lib.read_jsonl(os.path.join(wd, "metrics.jsonl"))
      out["costs"] = costs(rows, n, out["summary"]["eval_accuracy_initial"])
    results.append({**r, **out})
    s, c = out.get("summary", {}), out.get("costs", {})
    common.log(f"{i + 1}/{len(runs)} {r} acc {s.get('eval_accuracy_initial')} -> {s.get('eval_accuracy_late')} "
               f"groups {c.get('generated_groups')} train {c.get('time_train_s', 0):.1f}s "
               f"({out.get('wall_s', 0):.0f}s){' ' + out['error'] if 'error' in out else ''}")
  at_budgets(results)
  return common.write_results("replay_ablation", {
      "setting": name, "steps": steps, "seeds": seeds, "eval_every": eval_every, "base_overrides": BASE,
      "method": {METHOD: {**methods.overrides(METHOD), "rollout.old_logp": args.old_logp}},
      "tasks": {t: common.TASKS[t] for t in tasks},
      "arms": {a: arm_overrides(a, n) for a in arms}, "baseline": BASELINE, "runs": results}, args.out, argv)


if __name__ == "__main__":
  print(main())
