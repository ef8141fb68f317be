"""LoRA against full fine-tuning on the real SmolLM2-135M-Instruct: held-out accuracy, step time, peak memory.

Each run is its own process (`python -m jaxrl_llm`, so its peak RSS is its own, read with `os.wait4`):
configs/smollm2_grpo.py (full fine-tuning) and configs/smollm2_lora.py (rank-16 adapters on every projection,
the base frozen), the same task, sampler, batch and steps, one seed each per arm and seed. Recorded per run:
greedy held-out accuracy before RL (`eval_accuracy_initial`) and at the end (the last `eval_accuracy`), the
median `time_step_s` after the first step (compilation), and the process's peak RSS. The table is written
into the results file (`table_md`), and `python -m experiments.report` puts it in docs/RESULTS.md.

    python -m experiments.lora_real                     # 3 seeds of LoRA, 1 of full fine-tuning, 20 steps
    python -m experiments.lora_real --seeds 3 --full-seeds 3 --steps 20

    python -m experiments.lora_real --retable           # rewrite the table of the existing results file

Each run records the machine's load average at its start and end: step times of runs that shared the cores
with other jobs are not comparable (the table shows the load beside them); accuracy and peak RSS are.
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

ARMS = {"full": "configs/smollm2_grpo.py", "lora": "configs/smollm2_lora.py"}
MARGIN = 0.03  # as experiments.report: a gain below this is not called learning


def run_arm(arm: str, seed: int, steps: int, eval_every: int, workdir: str) -> dict:
  """One run in a child process; its accuracy before/after, median step time and peak RSS."""
  wd = os.path.join(workdir, "lora_real", f"{arm}_s{seed}")
  shutil.rmtree(wd, ignore_errors=True)
  cmd = [sys.executable, "-m", "jaxrl_llm", f"--config={ARMS[arm]}", f"--workdir={wd}", f"--config.seed={seed}",
         f"--config.num_steps={steps}", f"--config.eval.every={eval_every}", "--config.log.progress=False",
         "--config.checkpoint.every=0"]
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  t0, load0 = time.perf_counter(), os.getloadavg()[0]
  with open(os.path.join(workdir, f"lora_real_{arm}_s{seed}.log"), "w") as log_file:
    proc = subprocess.Popen(cmd, cwd=common.ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
  out = {"arm": arm, "seed": seed, "wall_s": time.perf_counter() - t0, "peak_rss_gib": usage.ru_maxrss / 2**20,
         "exit_status": os.waitstatus_to_exitcode(status), "loadavg": [load0, os.getloadavg()[0]]}
  try:
    info = json.load(open(os.path.join(wd, "run_info.json")))
    rows = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl")) if line.strip()]
  except (OSError, ValueError) as e:
    return {**out, "error": f"{type(e).__name__}: {e}"}
  evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
  out.update(steps=len(rows), acc_start=info.get("eval_accuracy_initial"), acc_end=evals[-1] if evals else None,
             step_s_median=statistics.median(r["time_step_s"] for r in rows[1:]) if len(rows) > 1 else None)
  shutil.rmtree(wd, ignore_errors=True)  # a full fine-tuning checkpoint is ~1.6 GB
  return out


def _mean_se(xs: list[float]) -> str:
  if not xs:
    return "—"
  if len(xs) == 1:
    return f"{xs[0]:.3f} (n=1)"
  return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.3f} (n={len(xs)})"


def _load(r: dict) -> str:
  return f"{r['loadavg'][0]:.1f}→{r['loadavg'][1]:.1f}" if r.get("loadavg") else "not recorded"


def table(runs: list[dict]) -> str:
  """Per-arm means (± standard error over seeds), whether each arm learns, and the per-seed cells with the
  machine's load (1-minute average at the run's start → end) beside their step times."""
  lines = ["| arm | held-out accuracy before RL | after RL | gain | s / learner step (median) | peak RSS (GiB) | "
           "learns (gain > %.2f in every seed) |" % MARGIN, "|---|---|---|---|---|---|---|"]
  for arm in ARMS:
    rs = [r for r in runs if r["arm"] == arm and r.get("acc_end") is not None]
    if not rs:
      continue
    gains = [r["acc_end"] - r["acc_start"] for r in rs]
    lines.append(f"| {arm} | {_mean_se([r['acc_start'] for r in rs])} | {_mean_se([r['acc_end'] for r in rs])} | "
                 f"{_mean_se(gains)} | {statistics.median(r['step_s_median'] for r in rs):.1f} | "
                 f"{max(r['peak_rss_gib'] for r in rs):.2f} | {'yes' if all(g > MARGIN for g in gains) else 'no'} |")
  lines += ["", "| run | accuracy before → after | s / step | peak RSS (GiB) | load average (start → end) |",
            "|---|---|---|---|---|"]
  lines += [f"| {r['arm']} seed {r['seed']} | {r['acc_start']:.3f} → {r['acc_end']:.3f} | {r['step_s_median']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {_load(r)} |" for r in runs if r.get("acc_end") is not None]
  lines += ["", "Step times are comparable only between runs at similar load (the column beside them); accuracy and "
            "peak RSS do not depend on it. Runs without a recorded load shared the 2 cores with other jobs."]
  return "\n".join(lines)


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--full-seeds", type=int, default=1, help="seeds of the full fine-tuning arm")
  p.add_argument("--retable", action="store_true", help="rewrite table_md of the existing results file and exit")
  args = p.parse_args(argv)
  if args.retable:
    path = os.path.join(args.out, "lora_real.json")
    with open(path) as f:
      doc = json.load(f)
    doc["table_md"] = table(doc["runs"])
    with open(path, "w") as f:
      json.dump(doc, f, indent=1)
    return path
  steps, seeds = args.steps or 20, args.seeds or 3
  plan = [("lora", s) for s in range(seeds)] + [("full", s) for s in range(args.full_seeds)]
  if args.dry_run:
    print(plan)
    return ""
  os.makedirs(args.workdir, exist_ok=True)
  runs = []
  for arm, seed in plan:
    runs.append(run_arm(arm, seed, steps, max(1, steps // 2), args.workdir))
    common.log(f"{arm} seed {seed}: {runs[-1]}")
  doc = {"model": "SmolLM2-135M-Instruct (configs/smollm2_grpo.py vs configs/smollm2_lora.py)", "steps": steps,
         "runs": runs, "table_md": table(runs)}
  return common.write_results("lora_real", doc, args.out, argv)


if __name__ == "__main__":
  print(main())
