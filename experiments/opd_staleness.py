"""OPD staleness (AsyncOPD, arXiv 2606.24143): forward KL vs reverse KL vs reverse KL recomputed, over lags.

Claim under test: with stale rollouts the teacher-weighted forward KL stays robust, the sampled-token
reverse KL with the rollout-time advantage log p − log μ degrades, and recomputing that advantage
under the current student (log p − log π_θ, `opd_reverse_kl` with `online_advantage=True`) fixes it.

Every run distils the same frozen SFT teacher (trained once, cached) into the same weak student (one
SFT warm start per seed, exported and reused through `model.init_from`) under `rollout.mode=fixed_lag`:
the batch of learner step t is generated *and teacher-scored* by version max(0, t − lag). The three arms
share everything else (optimizer, batch, PPO clip 0.2 with π_old recomputed at the behaviour version):
  forward_kl            opd_forward_kl (full-vocabulary KL(p ‖ π_θ) on the visited states)
  reverse_kl            opd_reverse_kl, advantage log p(y) − log μ(y) (scored at rollout time)
  reverse_kl_recompute  opd_reverse_kl, online_advantage=True: advantage log p(y) − log π_θ(y)

    python -m experiments.opd_staleness            # CI-sized (≈10 min on 2 shared CPU cores)
    python -m experiments.opd_staleness --full     # the demo model sizes, 3 seeds, lags up to 64
    python -m experiments.opd_staleness --real     # an RL-trained SmolLM2-135M teaches its base (accumulates)
    python -m experiments.opd_staleness --real --pair truncated  # SmolLM2-135M teaches its first 8 layers

Writes experiments/results/opd_staleness.json, experiments/results/opd_staleness.md (table) and
docs/figures/opd_staleness.png.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common

ARMS: dict[str, dict] = {
    "forward_kl": {"loss.name": "opd_forward_kl", "loss.hparams": {}},
    "reverse_kl": {"loss.name": "opd_reverse_kl", "loss.hparams": {}},
    "reverse_kl_recompute": {"loss.name": "opd_reverse_kl", "loss.hparams": {"online_advantage": True}},
}

# A weak student (short SFT) and a strong teacher; the learning rate is high enough that 16 stale
# versions are a real distance in parameter space within a CPU budget.
SETTINGS = {
    "ci": {
        "base": "opd_default", "steps": 150, "eval_every": 25, "seeds": 1, "lags": [0, 4, 16],
        "overrides": {
            "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 2, "model.n_kv_heads": 1,
            "model.head_dim": 32, "model.d_ff": 192, "sft.steps": 100,
            # 1500 teacher steps: after 700 the teacher scored 0.08 greedy on an Intel Xeon (0.80 on an AMD EPYC)
            "distill.teacher_d_model": 128, "distill.teacher_n_layers": 2, "distill.teacher_sft_steps": 1500,
            "optim.lr": 1e-3, "optim.warmup_steps": 0, "rollout.prompts_per_step": 16, "rollout.group_size": 4,
            "eval.num_prompts": 256,
        },
    },
    "full": {
        "base": "opd_default", "steps": 300, "eval_every": 25, "seeds": 3, "lags": [0, 4, 16, 64],
        "overrides": {"optim.lr": 1e-3, "optim.warmup_steps": 0, "rollout.prompts_per_step": 16,
                      "rollout.group_size": 4, "eval.num_prompts": 512},
    },
}


# The real model: two teacher/student pairs (`--pair`) sharing the tokenizer and chat template, each with its
# own results file. Both run configs/smollm2_opd.py's loop (8 x 4 rollouts, 16 new tokens, lr 1e-5, held-out
# KLs on 64 prompts).
#   rl_expert  an RL-trained copy of SmolLM2-135M-Instruct (`rl_teacher`: configs/smollm2_grpo.py, seed 100,
#              20 GRPO steps; held-out accuracy about 0.44 against the instruct model's 0.25) teaches the
#              instruct model it started from. Both are coherent models close in parameter space, as in
#              distilling an RL expert back into its base.
#   truncated  the 30-layer SmolLM2-135M-Instruct teaches its own first 8 layers (configs/smollm2_opd.py as
#              it stands). The truncated copy writes no coherent text, and 20 steps of distillation raised its
#              held-out KL under every arm (docs/RESULTS.md): kept as a record.
REAL_PAIRS = {
    "rl_expert": {"results": "opd_staleness_smollm2_rl", "short": "RL-trained teacher",
                  "model": "an RL-trained copy of SmolLM2-135M-Instruct (GRPO, 20 steps, seed 100) teaching the "
                           "instruct model it started from"},
    "truncated": {"results": "opd_staleness_smollm2", "short": "8-layer student",
                  "model": "SmolLM2-135M-Instruct teaching its first 8 layers (configs/smollm2_opd.py)"},
}
RL_TEACHER = {"seed": 100, "num_steps": 20, "eval.every": 20}  # over configs/smollm2_grpo.py
REAL_SETTINGS = {
    "ci": {"base": "smollm2_opd", "steps": 20, "eval_every": 5, "seeds": 3, "lags": [0, 4]},
    "full": {"base": "smollm2_opd", "steps": 200, "eval_every": 20, "seeds": 3, "lags": [0, 4, 16, 64],
             "overrides": {"rollout.prompts_per_step": 32, "eval.num_prompts": 512, "task.held_out": 512,
                           "sampler.max_new_tokens": 32}},
}


def rl_teacher(workdir: str) -> dict:
  """The rl_expert pair's teacher, made once under `workdir` and reused: configs/smollm2_grpo.py trained with
  `RL_TEACHER`, exported as a Hugging Face folder. Returns {"path", "recipe", "eval_accuracy"} (its held-out
  accuracy before and after the GRPO run)."""
  from experiments.export_policy import export
  from jaxrl_llm import loop
  out = os.path.join(workdir, "opd_real", "teacher_grpo_s{seed}_{num_steps}steps".format(**RL_TEACHER))
  info_file = os.path.join(out, "teacher_run.json")
  if not os.path.exists(info_file):
    c = common.make_config("smollm2_grpo", RL_TEACHER)
    run_dir, tmp = out + ".run", out + ".tmp"
    for d in (run_dir, tmp, out):
      shutil.rmtree(d, ignore_errors=True)
    rows = loop.run(c, run_dir)
    export(c, run_dir, tmp)
    with open(os.path.join(run_dir, "run_info.json")) as f:
      start = json.load(f).get("eval_accuracy_initial")
    acc = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    with open(os.path.join(tmp, "teacher_run.json"), "w") as f:  # written last: marks a complete teacher
      json.dump({"recipe": {"config": "configs/smollm2_grpo.py", **RL_TEACHER},
                 "eval_accuracy": {"start": start, "end": acc[-1] if acc else None}}, f)
    os.replace(tmp, out)
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints of a real model are large
  with open(info_file) as f:
    return {"path": out, **json.load(f)}


def main_real(args, argv) -> str:
  """The real-model grid of `args.pair` (seed-major); results accumulate in its file (`REAL_PAIRS`)."""
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, REAL_SETTINGS)
  pair = REAL_PAIRS[args.pair]
  arms = args.arms.split(",") if args.arms else list(ARMS)
  lags = [int(x) for x in args.lags.split(",")] if args.lags else setting["lags"]
  extra = dict(setting.get("overrides", {}))
  payload = {"setting": f"smollm2-{name}", "pair": args.pair, "short": pair["short"], "model": pair["model"],
             "base": setting["base"], "seeds": seeds, "lags": lags, "arms": {a: ARMS[a] for a in ARMS}}
  if args.pair == "rl_expert" and not args.dry_run:
    from jaxrl_llm.models.gguf import default_cache_dir
    teacher = rl_teacher(args.workdir)
    extra.update({"model.init_from": str(default_cache_dir()), "distill.teacher": teacher["path"]})
    payload["teacher"] = {k: teacher[k] for k in ("recipe", "eval_accuracy")}
  payload["overrides"] = {k: v for k, v in extra.items() if k != "distill.teacher"}  # no machine-local paths

  def run_cell(r: dict) -> dict:
    over = {**extra, **ARMS[r["arm"]], "seed": r["seed"], "num_steps": steps, "eval.every": eval_every,
            "rollout.mode": "fixed_lag", "rollout.lag": r["lag"]}
    wd = os.path.join(args.workdir, "opd_real", f"{args.pair}_{r['arm']}_lag{r['lag']}_s{r['seed']}")
    out = run_with_probe(setting["base"], over, wd)
    shutil.rmtree(wd, ignore_errors=True)  # checkpoints of a real model are large
    return out

  return common.run_cells(pair["results"], "opd_staleness", plan(arms, lags, seeds), ("arm", "lag", "seed"),
                          steps, args, run_cell, payload, argv, grid_argv=("--pair", args.pair))


def plan(arms: list[str], lags: list[int], seeds: int) -> list[dict]:
  """(arm, lag, seed) runs, arm-major so each loss's compiled steps are reused across lags."""
  return [{"arm": a, "lag": lag, "seed": s} for s in range(seeds) for a in arms for lag in lags]


def run_overrides(setting: dict, r: dict, steps: int, init_from: str, teacher_cache: str) -> dict:
  return {**setting["overrides"], **ARMS[r["arm"]], "seed": r["seed"], "num_steps": steps,
          "eval.every": min(setting["eval_every"], steps), "rollout.mode": "fixed_lag", "rollout.lag": r["lag"],
          "model.init_from": init_from, "sft.steps": 0, "distill.teacher_cache_dir": teacher_cache}


def teacher_accuracy(base: str, overrides: dict) -> float:
  """Held-out greedy accuracy of the (cached) teacher, evaluated exactly like the student."""
  import jax
  from jaxrl_llm import loop
  from jaxrl_llm.distill import teacher as teacher_lib
  c = common.make_config(base, overrides)
  r = loop.setup(c)
  cfg, params = teacher_lib.load_teacher(c, r.P, r.train_examples, r.model_cfg.vocab_size, r.encoder)
  return loop.evaluate(params, cfg, c, r.test, r.task, jax.random.key(0), r.encoder.tokenizer)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _dense_kls(student_params, teacher_params, student_cfg, teacher_cfg, temperature, seq, pos, seg, mask_BN):
  """Token-mean exact KL(π_θ ‖ p) and KL(p ‖ π_θ) over the vocabulary on the given completion states."""
  from jaxrl_llm.distill import teacher as teacher_lib
  n = mask_BN.shape[1]
  lq = jax.nn.log_softmax(teacher_lib.teacher_logits(student_params, student_cfg, seq, pos, seg, n) / temperature, -1)
  lp = jax.nn.log_softmax(teacher_lib.teacher_logits(teacher_params, teacher_cfg, seq, pos, seg, n) / temperature, -1)
  den = jnp.maximum(mask_BN.sum(), 1.0)
  rev = (jnp.exp(lq) * (lq - lp)).sum(-1)
  fwd = (jnp.exp(lp) * (lp - lq)).sum(-1)
  return (rev * mask_BN).sum() / den, (fwd * mask_BN).sum() / den


def heldout_kls(params, r, teacher) -> dict:
  """Exact reverse / forward KL to the teacher on fresh held-out samples of the student `params`.

  The states are completions `params` samples (at the sampler's temperature, fixed key) for the
  held-out prompts, so the numbers measure the distillation objective itself, free of the staleness
  of the training batches.
  """
  from jaxrl_llm.sampling import generate
  from jaxrl_llm.sft import full_sequence
  tcfg, tparams = teacher
  g = generate(params, jnp.asarray(r.test.tokens_BP), jnp.asarray(r.test.len_B), jax.random.key(1234),
               r.sampler_model_cfg, r.samp_cfg)
  seq = full_sequence(r.test, np.asarray(g["tokens_BN"]), np.asarray(g["mask_BN"]), r.encoder.tokenizer.pad_id)
  mask = jnp.asarray(g["mask_BN"], jnp.float32)
  rev, fwd = _dense_kls(params, tparams, r.model_cfg, tcfg, float(r.c.sampler.temperature), *seq, mask)
  return {"kl_rev": float(rev), "kl_fwd": float(fwd)}


def divergence_probe(r, teacher):
  """(`on_step` hook, list): at each evaluation, appends {"step", **heldout_kls(current params)}."""
  out: list[dict] = []

  def on_step(row, store):
    if "eval_accuracy" in row:
      snap = store.acquire(store.latest_version)
      try:
        out.append({"step": row["step"], **heldout_kls(snap.params, r, teacher)})
      finally:
        store.release(snap)

  return on_step, out


def run_with_probe(base: str, overrides: dict, workdir: str) -> dict:
  """`common.run_one` plus held-out teacher–student KLs at every evaluation (`divergence_probe`)."""
  from jaxrl_llm import loop, policy_init
  from jaxrl_llm.distill import teacher as teacher_lib
  c = common.make_config(base, overrides)
  shutil.rmtree(workdir, ignore_errors=True)
  r = loop.setup(c)
  teacher = teacher_lib.load_teacher(c, r.P, r.train_examples, r.model_cfg.vocab_size, r.encoder)
  on_step, kls = divergence_probe(r, teacher)
  kl0 = heldout_kls(policy_init.initial_policy(c, r.model_cfg, r.k_init)[1], r, teacher)
  t0 = time.perf_counter()
  rows = loop.run(c, workdir, on_step=on_step)
  with open(os.path.join(workdir, "run_info.json")) as f:
    info = json.load(f)
  summary = common.summarize(rows, info)
  late = kls[-3:]
  summary["kl_rev_heldout_late"] = sum(k["kl_rev"] for k in late) / len(late) if late else None
  summary["kl_fwd_heldout_late"] = sum(k["kl_fwd"] for k in late) / len(late) if late else None
  summary["kl_rev_heldout_initial"], summary["kl_fwd_heldout_initial"] = kl0["kl_rev"], kl0["kl_fwd"]
  return {"summary": summary, "curves": {**common.curves(rows), "heldout_kl": [{"step": -1, **kl0}] + kls},
          "wall_s": time.perf_counter() - t0}


METRICS = (("eval_accuracy_late", "held-out greedy accuracy (mean of the last 3 evaluations; higher is better)"),
           ("kl_rev_heldout_late", "held-out KL(π_θ ‖ teacher), exact over the vocabulary on fresh student samples "
            "(mean of the last 3 evaluations; lower is better)"),
           ("kl_fwd_heldout_late", "held-out KL(teacher ‖ π_θ) on the same states (lower is better)"))


def cell(results: list[dict], arm: str, lag: int, key: str):
  """Mean over seeds of `summary[key]` for (arm, lag), or None."""
  xs = [r["summary"][key] for r in results
        if r["arm"] == arm and r["lag"] == lag and "summary" in r and r["summary"].get(key) is not None]
  return sum(xs) / len(xs) if xs else None


def table(results: list[dict], lags: list[int], teacher_acc: dict) -> str:
  """Markdown: one arm × lag table per metric of `METRICS` (means over seeds)."""
  out = []
  for key, what in METRICS:
    out += [f"**{what}**", "", "| arm | " + " | ".join(f"lag {lag}" for lag in lags) + " |",
            "|" + "---|" * (len(lags) + 1)]
    for arm in ARMS:
      vals = [cell(results, arm, lag, key) for lag in lags]
      out.append(f"| {arm} | " + " | ".join("n/a" if v is None else f"{v:.3f}" for v in vals) + " |")
    out.append("")
  ok = [r["summary"] for r in results if "summary" in r]
  if ok:
    out.append(f"Student after its SFT warm start: accuracy {ok[0]['eval_accuracy_initial']:.3f}, held-out "
               f"KL(π_θ ‖ teacher) {ok[0]['kl_rev_heldout_initial']:.3f}, KL(teacher ‖ π_θ) "
               f"{ok[0]['kl_fwd_heldout_initial']:.3f}. Teacher accuracy: "
               + ", ".join(f"seed {s}: {a:.3f}" for s, a in teacher_acc.items()) + ".")
  return "\n".join(out) + "\n"


def plot(results: list[dict], lags: list[int], teacher_acc: dict, path: str) -> None:
  """Late held-out reverse KL and accuracy vs lag per arm, and the KL curves at the largest lag."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  for arm in ARMS:
    for ax, key in zip(axes[:2], ("kl_rev_heldout_late", "eval_accuracy_late")):
      ys = [cell(results, arm, lag, key) for lag in lags]
      ax.plot(range(len(lags)), [float("nan") if y is None else y for y in ys], marker="o", label=arm)
    for r in results:
      if r["arm"] == arm and r["lag"] == max(lags) and r["seed"] == 0 and "curves" in r:
        kl = r["curves"]["heldout_kl"]
        axes[2].plot([k["step"] + 1 for k in kl], [k["kl_rev"] for k in kl], marker=".", label=arm)
  if teacher_acc:
    axes[1].axhline(sum(teacher_acc.values()) / len(teacher_acc), color="gray", ls="--", label="teacher")
  for ax in axes[:2]:
    ax.set_xticks(range(len(lags)), [str(x) for x in lags])
    ax.set_xlabel("rollout lag (fixed_lag)")
  axes[0].set_ylabel("held-out KL(student ‖ teacher)")
  axes[0].set_title("late held-out reverse KL (lower is better)")
  axes[1].set_ylabel("held-out accuracy")
  axes[1].set_title("late held-out accuracy")
  axes[2].set_xlabel("learner steps")
  axes[2].set_ylabel("held-out KL(student ‖ teacher)")
  axes[2].set_title(f"lag {max(lags)}")
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--arms", default="", help=f"comma-separated subset of {list(ARMS)}")
  p.add_argument("--lags", default="", help="comma-separated lags replacing the setting's")
  p.add_argument("--figure", default=os.path.join(common.ROOT, "docs", "figures", "opd_staleness.png"))
  p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct from configs/smollm2_opd.py")
  p.add_argument("--pair", default="rl_expert", choices=list(REAL_PAIRS),
                 help="(--real) teacher/student pair: an RL-trained teacher, or an 8-layer student")
  p.add_argument("--redo", action="store_true", help="(--real) rerun cells already in the results file")
  args = p.parse_args(argv)
  if args.real:
    for a in (args.arms.split(",") if args.arms else []):
      if a not in ARMS:
        raise SystemExit(f"unknown arm {a!r}; valid: {', '.join(ARMS)}")
    return main_real(args, argv)
  name = "full" if args.full else "ci"
  setting = SETTINGS[name]
  base = setting["base"] if args.base == "default" else args.base
  seeds = args.seeds or setting["seeds"]
  steps = args.steps or setting["steps"]
  arms = args.arms.split(",") if args.arms else list(ARMS)
  for a in arms:
    if a not in ARMS:
      raise SystemExit(f"unknown arm {a!r}; valid: {', '.join(ARMS)}")
  lags = [int(x) for x in args.lags.split(",")] if args.lags else setting["lags"]
  runs = plan(arms, lags, seeds)
  if args.dry_run:
    for r in runs:
      print(r)
    return ""

  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  teacher_cache = os.path.join(args.workdir, "teachers")
  results, warm, teacher_acc = [], {}, {}
  for i, r in enumerate(runs):
    s = r["seed"]
    if s not in warm:
      shared = {**setting["overrides"], "seed": s, "distill.teacher_cache_dir": teacher_cache}
      warm[s] = common.warm_start(base, shared, os.path.join(args.workdir, "warm", f"opd_{name}_s{s}"))
      teacher_acc[s] = teacher_accuracy(base, shared)
      common.log(f"seed {s}: student warm start {warm[s]}, teacher accuracy {teacher_acc[s]:.3f}")
    wd = os.path.join(args.workdir, "opd_staleness", f"{name}_{r['arm']}_lag{r['lag']}_s{s}")
    out = run_with_probe(base, run_overrides(setting, r, steps, warm[s], teacher_cache), wd)
    results.append({**r, **out})
    sm = out.get("summary", {})
    common.log(f"{i + 1}/{len(runs)} {r} acc {sm.get('eval_accuracy_initial')} -> {sm.get('eval_accuracy_late')}, KL_rev "
               f"{sm.get('kl_rev_heldout_initial')} -> {sm.get('kl_rev_heldout_late')} "
               f"({out.get('wall_s', 0):.0f}s){' ' + out['error'] if 'error' in out else ''}")
  md = table(results, lags, teacher_acc)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "opd_staleness.md"), "w") as f:
    f.write(md)
  plot(results, lags, teacher_acc, args.figure)
  print(md)
  return common.write_results("opd_staleness", {
      "setting": name, "base": base, "steps": steps, "seeds": seeds, "lags": lags, "arms": {a: ARMS[a] for a in arms},
      "overrides": setting["overrides"], "teacher_accuracy": {str(k): v for k, v in teacher_acc.items()},
      "table_md": md, "figure": os.path.relpath(args.figure, common.ROOT), "runs": results}, args.out, argv)


if __name__ == "__main__":
  print(main())
