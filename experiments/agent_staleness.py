"""Multi-turn agents (toy): does RL raise held-out episode success after an SFT warm start on demonstrations,
and what does a fixed lag do to it, for GRPO and a correction?

The tiny model of configs/agent_sft_tiny.py plays guess-the-number (`jaxrl_llm.envs.guess_number`). Every run
starts with the same SFT warm start of its seed (`sft.demos` episodes of the consistent-but-not-optimal
scripted player, `jaxrl_llm.envs.demos`), then trains under `rollout.mode=fixed_lag` (the batch of learner
step t comes from version max(0, t - lag)). The held-out metric is the success of greedy episodes on seeds
no training episode uses (`jaxrl_llm.episode_eval`; `eval_accuracy` = `eval_episode_success`):
- SFT only = the run's evaluation before its first learner step (`eval_accuracy_initial`: 0 RL steps, the
  same parameters for every arm of a seed);
- SFT + RL = the mean of the run's last three evaluations (`eval_accuracy_late`).
The scripted players' success on the same held-out seeds is recorded beside them (`reference`).

    python -m experiments.agent_staleness             # CI-sized: 5 seeds x {grpo, m2po, decoupled_ppo} x lag {0, 4, 16}
                                                      # (~15 min on 2 cores: ~15 s a run once compiled)
    python -m experiments.agent_staleness --full      # 5 seeds, more methods and lags, longer runs
"""

from __future__ import annotations

import json
import os

from experiments import common, methods

BASE_CONFIG = "agent_sft_tiny"

SETTINGS = {
    # lag 16: lag 4 did not degrade GRPO here, so the staleness claims need a larger lag to be testable
    "ci": {"steps": 60, "eval_every": 10, "seeds": 5, "methods": ["grpo", "m2po", "decoupled_ppo"],
           "lags": [0, 4, 16]},
    "full": {"steps": 200, "eval_every": 20, "seeds": 5, "methods": ["grpo", "m2po", "decoupled_ppo"],
             "lags": [0, 2, 4, 8]},
}


def plan(ms: list[str], lags: list[int], seeds: int) -> list[dict]:
  """The (method, lag, seed) runs, seed-major (a seed's arms share one warm start in the compile cache)."""
  return [{"method": m, "lag": lag, "seed": s} for s in range(seeds) for m in ms for lag in lags]


def run_overrides(r: dict, steps: int, eval_every: int, sft_steps: int | None = None) -> dict:
  return {**methods.overrides(r["method"]), "seed": r["seed"], "num_steps": steps, "eval.every": eval_every,
          "rollout.mode": "fixed_lag", "rollout.lag": r["lag"],
          **({} if sft_steps is None else {"sft.steps": sft_steps})}


def episode_summary(workdir: str) -> dict:
  """Episode metrics of a finished run: its last evaluation's mean turns, the initial success, the
  sampled episodes' statuses summed over the run."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  with open(os.path.join(workdir, "run_info.json")) as f:
    info = json.load(f)
  turns = [r["eval_episode_turns"] for r in rows if "eval_episode_turns" in r]
  return {"eval_episode_success_initial": info.get("eval_episode_success_initial"),
          "eval_episode_turns_initial": info.get("eval_episode_turns_initial"),
          "eval_episode_turns_final": turns[-1] if turns else None,
          "env_invalid_total": sum(int(r.get("env_invalid", 0)) for r in rows),
          "env_turns_mean": sum(r.get("env_turns_mean", 0.0) for r in rows) / max(1, len(rows))}


def reference(base: str, n: int) -> dict:
  """Success of the scripted players on the held-out evaluation seeds (what imitation and the optimum reach)."""
  from jaxrl_llm.envs import demos
  from jaxrl_llm.episode_eval import eval_seeds
  c = common.load_config(base)
  kwargs, out = dict(c.env.kwargs), {}
  for p in demos.player_names(c.env.name):
    eps = demos.demo_episodes(c.env.name, kwargs, p, eval_seeds(n), c.env.max_turns)
    out[p] = sum(1 for _, steps in eps if steps and steps[-1][1] == "=") / n  # guess_number: "=" = guessed
  return out


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.set_defaults(base=BASE_CONFIG)
  p.add_argument("--methods", default="", help="comma-separated methods (default: the setting's)")
  p.add_argument("--lags", default="", help="comma-separated fixed lags (default: the setting's)")
  p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start steps (default: the config's; tests)")
  args = p.parse_args(argv)
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, SETTINGS)
  ms = args.methods.split(",") if args.methods else setting["methods"]
  for m in ms:
    methods.overrides(m)
  lags = [int(x) for x in args.lags.split(",")] if args.lags else setting["lags"]
  runs = plan(ms, lags, seeds)
  if args.dry_run:
    for r in runs:
      over = run_overrides(r, steps, eval_every, args.sft_steps)
      print({**r, "config": common.check_config(args.base, over) or "valid"})
    return ""

  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  results = []
  for i, r in enumerate(runs):
    wd = os.path.join(args.workdir, "agent", f"{r['method']}_lag{r['lag']}_s{r['seed']}")
    out = common.run_one(args.base, run_overrides(r, steps, eval_every, args.sft_steps), wd)
    if "summary" in out:
      out["episodes"] = episode_summary(wd)
    results.append({**r, **out})
    s = out.get("summary", {})
    common.log(f"{i + 1}/{len(runs)} {r} success {s.get('eval_accuracy_initial')} -> {s.get('eval_accuracy_late')} "
               f"({out.get('wall_s', 0):.0f}s){' ' + out['error'] if 'error' in out else ''}")
  c = common.load_config(args.base)
  return common.write_results("agent_staleness" + ("_full" if args.full else ""), {
      "setting": name, "steps": steps, "seeds": seeds, "eval_every": eval_every, "base_config": args.base,
      "env": {"name": c.env.name, "kwargs": dict(c.env.kwargs), "max_turns": c.env.max_turns},
      "sft": {"steps": c.sft.steps if args.sft_steps is None else args.sft_steps, "demos": c.sft.demos,
              "demo_player": c.sft.demo_player},
      "eval_episodes": c.eval.num_prompts, "reference": reference(args.base, c.eval.num_prompts),
      "methods": {m: methods.overrides(m) for m in ms}, "baseline": methods.BASELINE, "lags": lags,
      "runs": results}, args.out, argv, script="agent_staleness")


if __name__ == "__main__":
  print(main())
