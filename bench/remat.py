"""The fused reference + train step of a real-model workload under each `model.remat` mode, taking turns.

  python -m bench.remat                                   # workload R_small on SmolLM2 (`make smollm2` first)
  python -m bench.remat --modes full,dots --rounds 5 --markdown bench/profiles/R_small_remat.md

Every mode trains its own copy of the same weights on the same batch: one rollout of the workload's first prompts,
sampled once (`grpo_step.sample`) and made into the learner's batch. Round 0 compiles each mode's step; rounds
1..`--rounds` time one call per mode, the order rotating from round to round, so drift in the machine's speed falls
on every mode alike. A row: the median and best seconds, and the first mode's median over this one (> 1: faster).
What `model.remat="auto"` would choose for the workload (`memory.choose_remat`: the first mode of the platform's
order, `memory.REMAT_ORDER`, whose step fits the machine's budget) is printed beside the table.

The steps run back to back here, with no sampling between them. In the GRPO loop the ranking on this CPU was not the
same: "dots" 1.06x "full" here (bench/profiles/R_small_remat.md), level with it in the loop, where the step runs
after each rollout (bench/profiles/R_small_remat_loop.md, `python -m bench.run --variants`). `memory.REMAT_ORDER`
follows the loop; this script isolates the step's own cost (bench/gpu.sh runs it on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

from bench import common, grpo_real, grpo_step

MODES = ("full", "dots", "none")


def measure(variant: str, model_dir: str | None, modes: tuple[str, ...], rounds: int) -> tuple[list[dict], str]:
  """(one row per mode: seconds of each timed round, median, best, and the first mode's median over its own;
  what `model.remat="auto"` chooses for the workload)."""
  base = grpo_real.build(variant, model_dir, remat=modes[0])
  ctxs = {modes[0]: base, **{m: grpo_real.build(variant, model_dir, remat=m, base=base) for m in modes[1:]}}
  p, key = grpo_real._batch_of(base, 0)
  gen = grpo_step.sample(base, base["state"].params, p, key)[0]
  B = gen["mask_BN"].shape[0]
  adv_BN = jnp.asarray(np.random.default_rng(0).standard_normal((B, 1)), jnp.float32) * gen["mask_BN"]
  batches = {m: grpo_step.learner_batch(c, gen, adv_BN)[0] for m, c in ctxs.items()}
  secs = {m: [] for m in modes}
  for r in range(rounds + 1):
    for i in range(len(modes)):
      m = modes[(i + r) % len(modes)]
      c = ctxs[m]
      state = c.pop("state")  # donated by the step, as in the loop
      t0 = time.perf_counter()
      c["state"] = common.block(c["train_step"](state, batches[m], key, c["ref_params"]))[0]
      if r:  # round 0 compiled it
        secs[m].append(time.perf_counter() - t0)
  first = statistics.median(secs[modes[0]])
  auto = grpo_real._remat(base["cfg"], "auto", base["run"], base["P"])
  return [{"remat": m, "seconds": secs[m], "median_s": statistics.median(secs[m]), "best_s": min(secs[m]),
           "first_over_this": first / statistics.median(secs[m])} for m in modes], auto


def table(rows: list[dict], first: str) -> str:
  lines = [f"| remat | median | best | {first} / this |", "|---|---|---|---|"]
  lines += [f"| {r['remat']} | {r['median_s']:.2f} s | {r['best_s']:.2f} s | {r['first_over_this']:.2f}× |"
            for r in rows]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variant", default="R_small", help="bench.workloads.REAL's workload")
  p.add_argument("--model", default=None, help="a Hugging Face folder (default: the imported SmolLM2)")
  p.add_argument("--modes", default=",".join(MODES), help="model.remat modes, the first the reference")
  p.add_argument("--rounds", type=int, default=3, help="timed rounds after the compiling one")
  p.add_argument("--markdown", default=None, help="also write the table here, the command and the machine above it")
  args = p.parse_args(argv)
  modes = tuple(args.modes.split(","))
  if any(m not in MODES for m in modes) or len(set(modes)) < len(modes) or args.rounds < 1:
    raise SystemExit(f"--modes: a comma list of distinct {MODES}; --rounds >= 1 (got {args.modes!r}, {args.rounds})")
  head = common.run_header()
  rows, auto = measure(args.variant, args.model, modes, args.rounds)
  common.write_profile(args.markdown, f"The fused reference + train step of workload {args.variant} by `model.remat`",
                       "bench.remat", argv, head,
                       f"{table(rows, modes[0])}\n\n`model.remat=\"auto\"` chooses {auto!r} for this workload on this "
                       "machine.")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
