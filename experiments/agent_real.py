"""A tool-using agent from the real SmolLM2-135M-Instruct: held-out GSM8K-with-a-calculator success before and after
multi-turn GRPO (configs/smollm2_agent.py).

Each seed is its own process (`python -m jaxrl_llm`). The held-out evaluation plays the shipped sample's last
`env.kwargs.heldout` problems (no training episode draws them), greedily, once each, before RL and at the end
(`eval_episode_success`: the fraction solved; `eval_episode_turns`). Recorded beside it: the training episodes'
reward, tool calls and statuses over the first and last quarter of the steps. The table is written into the results
file (`table_md`); `python -m experiments.report` puts it in docs/RESULTS.md.

    python -m experiments.agent_real                    # 1 seed, 20 steps (about 40 minutes on 2 cores)
    python -m experiments.agent_real --seeds 3 --steps 40
    python -m experiments.agent_real --retable          # rewrite the table of the existing results file
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from experiments import common

CONFIG = "configs/smollm2_agent.py"
MARGIN = 0.03  # as experiments.report: a gain below this is not called learning


def run_seed(seed: int, steps: int, workdir: str) -> dict:
  """One run in a child process: held-out success before/after and the training episodes' counters."""
  wd = os.path.join(workdir, "agent_real", f"s{seed}")
  shutil.rmtree(wd, ignore_errors=True)
  cmd = [sys.executable, "-m", "jaxrl_llm", f"--config={CONFIG}", f"--workdir={wd}", f"--config.seed={seed}",
         f"--config.num_steps={steps}", f"--config.eval.every={steps}", "--config.log.progress=False",
         "--config.checkpoint.every=0"]
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  t0, load0 = time.perf_counter(), os.getloadavg()[0]
  with open(os.path.join(workdir, f"agent_real_s{seed}.log"), "w") as log_file:
    code = subprocess.call(cmd, cwd=common.ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
  out = {"seed": seed, "wall_s": time.perf_counter() - t0, "exit_status": code, "loadavg": [load0, os.getloadavg()[0]]}
  try:
    info = json.load(open(os.path.join(wd, "run_info.json")))
    rows = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl")) if line.strip()]
  except (OSError, ValueError) as e:
    return {**out, "error": f"{type(e).__name__}: {e}"}
  evals = [r for r in rows if "eval_episode_success" in r]
  q = max(1, len(rows) // 4)

  def per_episode(part: list[dict], key: str) -> float:
    return sum(r.get(key, 0) for r in part) / max(1, sum(r.get("env_episodes", 0) for r in part))

  out.update(steps=len(rows), success_start=info.get("eval_episode_success_initial"),
             success_end=evals[-1]["eval_episode_success"] if evals else None,
             turns_start=info.get("eval_episode_turns_initial"),
             turns_end=evals[-1]["eval_episode_turns"] if evals else None,
             reward_first=statistics.mean(r["reward_mean"] for r in rows[:q]),
             reward_last=statistics.mean(r["reward_mean"] for r in rows[-q:]),
             tool_calls_first=per_episode(rows[:q], "env_tool_calls"),
             tool_calls_last=per_episode(rows[-q:], "env_tool_calls"),
             step_s_median=statistics.median(r["time_step_s"] for r in rows[1:]) if len(rows) > 1 else None)
  shutil.rmtree(wd, ignore_errors=True)  # a checkpoint of the full model is ~1.6 GB
  return out


def _mean(xs: list[float]) -> str:
  if len(xs) == 1:
    return f"{xs[0]:.3f} (n=1)"
  return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.3f} (n={len(xs)})"


def table(runs: list[dict], heldout: int) -> str:
  ok = [r for r in runs if r.get("success_end") is not None and r.get("success_start") is not None]
  if not ok:
    return "No run finished: see the runs' errors in the results file."
  gains = [r["success_end"] - r["success_start"] for r in ok]
  learns = "yes" if all(g > MARGIN for g in gains) else "no"
  lines = [f"| held-out problems | success before RL | after RL | gain | learns (gain > {MARGIN:.2f} in every seed) |",
           "|---|---|---|---|---|",
           f"| {heldout} (greedy, once each) | {_mean([r['success_start'] for r in ok])} | "
           f"{_mean([r['success_end'] for r in ok])} | {_mean(gains)} | {learns} |",
           "", "| seed | success before → after | turns before → after | training reward (first → last quarter) | "
           "tool calls per episode (first → last quarter) | s / step | load average |", "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['seed']} | {r['success_start']:.3f} → {r['success_end']:.3f} | {r['turns_start']:.2f} → "
            f"{r['turns_end']:.2f} | {r['reward_first']:.3f} → {r['reward_last']:.3f} | "
            f"{r['tool_calls_first']:.2f} → {r['tool_calls_last']:.2f} | {r['step_s_median']:.1f} | "
            f"{r['loadavg'][0]:.1f}→{r['loadavg'][1]:.1f} |" for r in ok]
  lines += ["", f"A 135M model on {heldout} held-out problems: one problem is {1 / heldout:.2f} of success, so a "
            "difference of one problem is within noise; more seeds, problems (`--config.env.kwargs.path=` a GSM8K "
            "JSONL) and steps would decide whether the agent learns."]
  return "\n".join(lines)


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--retable", action="store_true", help="rewrite table_md of the existing results file and exit")
  args = p.parse_args(argv)
  heldout = int(common.load_config("smollm2_agent").env.kwargs.heldout)
  if args.retable:
    path = os.path.join(args.out, "agent_real.json")
    with open(path) as f:
      doc = json.load(f)
    doc["table_md"] = table(doc["runs"], doc["heldout"])
    with open(path, "w") as f:
      json.dump(doc, f, indent=1)
    return path
  steps, seeds = args.steps or 20, args.seeds or 1
  if args.dry_run:
    print([(s, steps) for s in range(seeds)])
    return ""
  os.makedirs(args.workdir, exist_ok=True)
  runs = []
  for seed in range(seeds):
    runs.append(run_seed(seed, steps, args.workdir))
    common.log(f"seed {seed}: {runs[-1]}")
  doc = {"model": f"SmolLM2-135M-Instruct ({CONFIG})", "steps": steps, "heldout": heldout, "runs": runs,
         "table_md": table(runs, heldout)}
  return common.write_results("agent_real", doc, args.out, argv)


if __name__ == "__main__":
  print(main())
