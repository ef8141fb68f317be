"""Shared plumbing of the experiment scripts: configs by path, warm starts, run summaries, result JSON.

Every script writes one JSON file under `experiments/results/` with the command, git commit and
machine next to the per-run summaries; `experiments/report.py` turns those files into
docs/RESULTS.md. Nothing here is imported by `jaxrl_llm`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time

from jaxrl_llm.config import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")

# Tasks of the ablations: the default demo task and a second, harder one.
TASKS = {
    "arithmetic": {"task.name": "arithmetic", "task.kwargs": {"num_digits": 2}},
    "countdown": {"task.name": "countdown", "task.kwargs": {"min_count": 3, "max_count": 3, "max_number": 9},
                  "sampler.max_new_tokens": 10},
}


def load_config(name: str = "default"):
  """`configs/<name>.py`'s `get_config()`, loaded by path (works from any working directory)."""
  path = os.path.join(ROOT, "configs", f"{name}.py")
  return load_file(path)


def apply_overrides(c, overrides: dict):
  """Sets dotted fields (`"rollout.lag": 8`); dict values replace whole sub-configs (`task.kwargs`)."""
  import ml_collections
  for dotted, value in overrides.items():
    *path, leaf = dotted.split(".")
    node = c
    for p in path:
      node = node[p]
    node[leaf] = ml_collections.ConfigDict(dict(value)) if isinstance(value, dict) else value
  return c


def make_config(base: str, overrides: dict):
  """A quiet config (no progress bar, no TensorBoard) with `overrides` applied."""
  c = load_config(base)
  c.log.progress = False
  c.log.tensorboard = False
  if "checkpoint" in c:
    c.checkpoint.every = 0  # ablation runs are short and never resumed
  return apply_overrides(c, overrides)


def enable_compile_cache(path: str) -> None:
  """Persistent XLA cache: runs that differ only in lag or seed reuse the compiled steps."""
  import jax
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def warm_start(base: str, overrides: dict, out_dir: str) -> str:
  """Runs the SFT warm start once (0 RL steps) and exports it; returns the folder for `model.init_from`."""
  from jaxrl_llm import loop
  out_dir = out_dir if base == "default" else f"{out_dir}_{base}"
  if os.path.exists(os.path.join(out_dir, "model", "config.json")) and any(
      os.path.exists(os.path.join(out_dir, "model", f)) for f in ("char_tokenizer.json", "tokenizer.json")):
    return os.path.join(out_dir, "model")  # (an export without its tokenizer file predates them: redone)
  c = make_config(base, {**overrides, "num_steps": 0, "sft.save_to": os.path.join(out_dir, "model")})
  loop.run(c, os.path.join(out_dir, "sft_run"))
  return os.path.join(out_dir, "model")


def _finite(xs):
  return [float(x) for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]


def _mean(xs):
  xs = _finite(xs)
  return sum(xs) / len(xs) if xs else None


def _max(xs):
  xs = _finite(xs)
  return max(xs) if xs else None


def summarize(rows: list[dict], info: dict) -> dict:
  """Scalars of one run: final / best held-out accuracy, ratio tails, clip/mask fractions, KL, lag, timing."""
  evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
  frac_keys = sorted({k for r in rows for k in r if k.endswith("_frac")})
  steady = rows[1:] or rows  # the first step pays for compilation
  out = {
      "eval_accuracy_initial": info.get("eval_accuracy_initial"),
      "eval_accuracy_final": evals[-1][1] if evals else None,
      "eval_accuracy_best": max(a for _, a in evals) if evals else None,
      # Mean of the last three evaluations: one greedy eval on a few hundred prompts is noisy.
      "eval_accuracy_late": _mean([a for _, a in evals[-3:]]),
      "reward_mean_last": _mean([r["reward_mean"] for r in rows[-max(1, len(rows) // 5):]]),
      "ratio_max": _max([r.get("ratio_max") for r in rows]),
      "ratio_p99_max": _max([r.get("ratio_p99_max") for r in rows]),
      "kl_mu_k1_mean": _mean([r.get("kl_mu_k1") for r in rows]),
      "kl_mu_k3_mean": _mean([r.get("kl_mu_k3") for r in rows]),
      "lag_mean": _mean([r.get("lag_mean") for r in rows]),
      "lag_max": _max([r.get("lag_max") for r in rows]),
      "mismatch_abs_mean": _mean([r.get("mismatch_abs_mean") for r in rows]),
      "time_step_s": _mean([r.get("time_step_s") for r in steady]),
      "time_generate_s": _mean([r.get("time_generate_s") for r in steady]),
      "time_learner_idle_s": _mean([r.get("time_learner_idle_s") for r in steady]),
      "num_steps": len(rows),
      "skipped_updates": sum(int(bool(r.get("update_skipped", False))) for r in rows),
  }
  for k in frac_keys:
    out[f"{k}_mean"] = _mean([r.get(k) for r in rows])
  return out


def curves(rows: list[dict]) -> dict:
  """Per-step series kept for plots (reward, held-out accuracy, ratio tail, KL)."""
  return {
      "step": [r["step"] for r in rows],
      "reward_mean": [r["reward_mean"] for r in rows],
      "ratio_p99_max": [r.get("ratio_p99_max") for r in rows],
      "kl_mu_k3": [r.get("kl_mu_k3") for r in rows],
      "eval_step": [r["step"] for r in rows if "eval_accuracy" in r],
      "eval_accuracy": [r["eval_accuracy"] for r in rows if "eval_accuracy" in r],
  }


def run_one(base: str, overrides: dict, workdir: str) -> dict:
  """One `loop.run`; returns {"summary", "curves", "wall_s"} (or {"error"} when the config is rejected)."""
  from jaxrl_llm import config as config_lib, loop
  c = make_config(base, overrides)
  # A workdir holding checkpoints would be resumed: every run starts from an empty one.
  shutil.rmtree(workdir, ignore_errors=True)
  t0 = time.perf_counter()
  from jaxrl_llm.errors import RunError
  try:
    rows = loop.run(c, workdir)
  except (config_lib.ConfigError, RunError) as e:  # RunError: e.g. optim.max_skips reached, every update skipped
    return {"error": str(e)}
  with open(os.path.join(workdir, "run_info.json")) as f:
    info = json.load(f)
  return {"summary": summarize(rows, info), "curves": curves(rows), "wall_s": time.perf_counter() - t0}


def check_config(base: str, overrides: dict) -> str | None:
  """None when the config validates, else the validation message (used for 'not available' cells)."""
  from jaxrl_llm import config as config_lib
  try:
    config_lib.validate(make_config(base, overrides))
  except (config_lib.ConfigError, KeyError, AttributeError) as e:
    return str(e)
  return None


def git_commit() -> str:
  """HEAD's hash, suffixed `-dirty` when the working tree has uncommitted changes."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + ("-dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def machine() -> dict:
  """CPU model, core count, platform and JAX backend (recorded beside every table)."""
  cpu = platform.processor() or "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  import jax
  return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
          "jax": jax.__version__, "backend": jax.default_backend(),
          "devices": [d.device_kind for d in jax.devices()]}


def command_line(name: str, argv: list[str] | None) -> str:
  """The command that reproduces a results file: `python -m experiments.<name> <args>`."""
  args = sys.argv[1:] if argv is None else argv
  return " ".join(["python", "-m", f"experiments.{name}"] + [shlex.quote(a) for a in args])


def write_results(name: str, payload: dict, out_dir: str | None = None, argv: list[str] | None = None,
                  script: str | None = None) -> str:
  """Writes `payload` + provenance (command, commit, machine, time) to `<out_dir>/<name>.json`
  (`script`: the `experiments.<script>` module that wrote it, when not named `name`)."""
  out_dir = out_dir or RESULTS_DIR
  os.makedirs(out_dir, exist_ok=True)
  doc = {"experiment": name, "command": command_line(script or name, argv), "commit": git_commit(), "machine": machine(),
         "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **payload}
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump(doc, f, indent=1, sort_keys=False)
  return path


def run_cells(name: str, script: str, runs: list[dict], key_fields: tuple[str, ...], steps: int, args,
              run_cell, payload: dict, argv: list[str] | None, grid_argv: tuple[str, ...] = ()) -> str:
  """Runs the cells of `runs` still missing from `<args.out>/<name>[_full].json` (a `--real` grid; `_full` with
  `--full`), writing the file after each one.

  The file accumulates the cells of several invocations (a grid that takes hours on a CPU is filled run
  by run; `args.redo` reruns this invocation's cells). Cells of another run length are not comparable:
  the file then starts over. Each cell records the invocation that ran it and its commit; the file's own
  command (`--real [--full] *grid_argv`) is the whole grid's, so rerunning it fills the missing cells; `planned` is the union
  of every invocation's plan (the report lists the missing cells). `run_cell(r)` -> {"summary", ...}. A cell
  whose run stopped before `steps` learner steps (preempted) is not recorded, and the grid stops there; so
  does one rejected for its `model.init_from` (a checkpoint not imported yet is no property of the cell).
  """
  key = lambda r: tuple(r[f] for f in key_fields)
  name += "_full" if args.full else ""
  file_argv = ["--real"] + (["--full"] if args.full else []) + list(grid_argv)
  path = os.path.join(args.out, f"{name}.json")
  done, planned = [], {key(r): r for r in runs}
  if os.path.exists(path):
    with open(path) as f:
      prev = json.load(f)
    if prev.get("steps") == steps:
      done = [r for r in prev["runs"] if "summary" in r]
      planned = {**{key(r): r for r in prev.get("planned", [])}, **planned}
  if getattr(args, "redo", False):
    redo = {key(r) for r in runs}
    done = [r for r in done if key(r) not in redo]
  have = {key(r) for r in done}
  todo = [r for r in runs if key(r) not in have]
  if args.dry_run:
    for r in todo:
      print(r)
    return ""
  enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  results, written = list(done), ""
  for i, r in enumerate(todo):
    out = run_cell(r)
    if "config.model.init_from=" in out.get("error", ""):  # the checkpoint is missing, for every cell alike
      raise SystemExit(f"{name}: {out['error']}")
    ran = out.get("summary", {}).get("num_steps")
    if ran is not None and ran < steps:  # stopped early (a SIGTERM checkpoints and exits): not a finished cell
      log(f"{r} stopped after {ran} of {steps} steps: not recorded; the grid stops here")
      break
    results.append({**r, **out, "command": command_line(script, argv), "commit": git_commit()})
    s = out.get("summary", {})
    log(f"{i + 1}/{len(todo)} {r} acc {s.get('eval_accuracy_initial')} -> {s.get('eval_accuracy_late')} "
        f"({out.get('wall_s', 0):.0f}s){' ' + out['error'] if 'error' in out else ''}")
    written = write_results(name, {**payload, "steps": steps, "planned": [dict(r) for r in planned.values()],
                                   "runs": results}, args.out, file_argv, script=script)
  return written or path


def run_seeded(name: str, args, argv, runs: list[dict], overrides, payload: dict, warm: dict | None = None,
               after=None, group=None) -> str:
  """The small grid most tiny-policy scripts run: each run `r` of `runs` (a dict with a "seed") trains with
  `overrides(r)`, from the SFT warm start of its seed made once with `warm` (None: each run does its own SFT),
  and its summary gets `after(workdir)`; writes `<args.out>/<name>.json` ({**payload, "runs": ...}).
  `group(r)` = (base config, warm) replaces (`args.base`, `warm`) for runs of several base configs.
  Warm starts are keyed by their base and overrides, so scripts that warm-start alike share one in a workdir.
  `--dry-run` prints the runs."""
  if args.dry_run:
    for r in runs:
      print(r)
    return ""
  enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  group = group or (lambda r: (args.base, warm))
  starts: dict[str, str] = {}

  def start(base: str, w: dict, seed: int) -> str:
    key = (base, seeded_warm_dir(args.workdir, w, seed))
    if key not in starts:
      starts[key] = warm_start(base, {**w, "seed": seed}, key[1])
    return starts[key]

  results = []
  for i, r in enumerate(runs):
    base, w = group(r)
    over = overrides(r)
    if w is not None:
      over = {**over, "model.init_from": start(base, w, r["seed"]), "sft.steps": 0}
    wd = os.path.join(args.workdir, name, "_".join(str(v) for v in r.values()))
    out = run_one(base, over, wd)
    if after is not None and "summary" in out:
      out["summary"].update(after(wd))
    results.append({**r, **out})
    s = out.get("summary", {})
    log(f"{i + 1}/{len(runs)} {r} acc {s.get('eval_accuracy_initial')} -> {s.get('eval_accuracy_late')} "
        f"({out.get('wall_s', 0):.0f}s) {out.get('error', '')}")
  return write_results(name, {**payload, "runs": results}, args.out, argv)


def metric_thirds(prefixes: tuple[str, ...]):
  """An `after` hook for `run_seeded`: the mean of every metric named with one of `prefixes` over the first and
  the last third of the run's steps (`<metric>_early`, `<metric>_late`; steps that lack it are left out)."""
  def after(wd: str) -> dict:
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    third = max(1, len(rows) // 3)
    out = {}
    for k in sorted({k for r in rows for k in r if k.startswith(prefixes)}):
      for tag, part in (("early", rows[:third]), ("late", rows[-third:])):
        out[f"{k}_{tag}"] = _mean([r.get(k) for r in part])
    return out
  return after


def seeded_warm_dir(workdir: str, warm: dict, seed: int) -> str:
  """The folder `run_seeded` keeps a seed's warm start made with overrides `warm` in (keyed by them)."""
  tag = hashlib.sha1(json.dumps(warm, sort_keys=True).encode()).hexdigest()[:10]
  return os.path.join(workdir, "warm", f"seeded_{tag}_s{seed}")


def cell_grid(name: str, description: str, argv, cells: dict, claims: list, settings: dict, fixed: dict,
              warm: dict | None = None, base: str | None = None, sft_flag: bool = False, after=None) -> str:
  """A script whose runs are named cells (`cells`: name -> overrides over `fixed`) × seeds and whose claims
  (`report.cell_claims`) compare cells: parses `--cells` (and `--sft-steps` with `sft_flag`: each run's own SFT,
  for tests) beside `base_parser`'s flags, runs `run_seeded` (`after`: its per-run summary hook) and records cells
  and claims in the results."""
  p = base_parser(description)
  if base is not None:
    p.set_defaults(base=base)
  p.add_argument("--cells", default="", help="comma-separated subset of the cells")
  if sft_flag:
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start steps (default: the config's; tests)")
  args = p.parse_args(argv)
  setting, _, seeds, steps, eval_every = resolve_setting(args, settings)
  names = args.cells.split(",") if args.cells else list(cells)
  runs = [{"cell": c, "seed": s} for s in range(seeds) for c in names]
  sft = {"sft.steps": args.sft_steps} if getattr(args, "sft_steps", None) is not None else {}
  over = lambda r: {**fixed, **cells[r["cell"]], **sft, "seed": r["seed"], "num_steps": steps,
                    "eval.every": eval_every}
  return run_seeded(name, args, argv, runs, over, {
      "setting": setting, "steps": steps, "seeds": seeds, "eval_every": eval_every, "base_config": args.base,
      "base_overrides": fixed, "cells": {c: cells[c] for c in names}, "claims": claims}, warm=warm, after=after)


def base_parser(description: str) -> argparse.ArgumentParser:
  """Flags every script shares: --full, --seeds, --steps, --out, --workdir, --dry-run."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--full", action="store_true", help="the real-hardware setting (hours on a CPU; use an accelerator)")
  p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: 1 CI, 3 full)")
  p.add_argument("--steps", type=int, default=None, help="learner steps per run (default: setting's)")
  p.add_argument("--out", default=RESULTS_DIR, help="folder of the results JSON")
  p.add_argument("--workdir", default=os.path.join("/tmp", "jaxrl_llm_experiments"),
                 help="scratch folder for runs, warm starts and the XLA cache")
  p.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
  p.add_argument("--base", default="default", help="base config, configs/<base>.py (tests use 'tiny')")
  return p


def resolve_setting(args, settings: dict) -> tuple[str, dict, int, int, int]:
  """(name, setting, seeds, steps, eval_every) for parsed `base_parser` flags and a script's SETTINGS."""
  name = "full" if args.full else "ci"
  setting = settings[name]
  steps = args.steps or setting["steps"]
  return name, setting, args.seeds or setting["seeds"], steps, min(setting["eval_every"], max(1, steps))


def log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
