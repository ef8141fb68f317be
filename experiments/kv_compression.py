"""KV-compressed rollouts: the bias of an int8 or sinks + window sampler KV cache, and training with it.

Two parts, on the tiny policy after its SFT warm start (`configs/default.py`, 2-digit addition):
1. The mismatch table. The held-out prompts are sampled (G completions each, same key) with each sampler
   cache (`sampler.kv_cache`: full / int8 / window) and every sampled token is rescored by the dense
   learner at the same parameters: Δ = log π_old − log μ per token (`experiments.mismatch_real.token_stats`:
   |Δ| mean/max, fractions outside the TIS / MIS / IcePop bands at their defaults). Memory per sequence: the
   bytes of the cache arrays `generate` allocates: P + N slots, or for the window cache a ring buffer of
   P + sinks + window slots when sinks + window < N (`models.cache.ring_layout`; otherwise the full cache is
   no larger); its row also gives the bytes of sinks + window slots (at most P + N), computed from shapes. `kept` is the mean fraction of causal keys a response token sees.
2. Training with the window cache: uncorrected (`ppo_clip` on the dense learner, π_old recomputed: blind to μ),
   TIS (π_old/μ truncated weights) and SMD (`smd`: PPO on the shadow forward + λ·KL(dense ‖ sg shadow)), over
   seeds; the training reward at the end (the compressed sampler's) and greedy held-out accuracy (also decoded
   with the compressed cache: the deployed policy).

    python -m experiments.kv_compression           # CI-sized, ~15 minutes on 2 cores
    python -m experiments.kv_compression --full

Writes experiments/results/kv_compression.json; `python -m experiments.report` renders it.
"""

from __future__ import annotations

import os

import numpy as np

from experiments import common
from experiments.mismatch_real import band_defaults, token_stats

BASE = {"optim.lr": 2e-4, "optim.warmup_steps": 5, "rollout.prompts_per_step": 8, "rollout.group_size": 8,
        "eval.num_prompts": 256, "rollout.mode": "sync", "rollout.old_logp": "recompute", **common.TASKS["arithmetic"]}
# 4 sinks (SMD's default) + a window of 4: on 2-digit addition ("<bos>ab+cd=", 7 prompt tokens) the first two answer
# tokens see the whole prompt and later ones lose the second operand's first digit (a window of 3 already loses it at
# the second answer token and leaves every method at ~0 reward: nothing to compare).
WINDOW = {"sampler.kv_sinks": 4, "sampler.kv_window": 4}
CACHES = {"full": {"sampler.kv_cache": "full"}, "int8": {"sampler.kv_cache": "int8"},
          "window": {"sampler.kv_cache": "window", **WINDOW}}
METHODS = {"none": {"loss.name": "ppo_clip"}, "tis": {"loss.name": "tis"}, "smd": {"loss.name": "smd"}}
SETTINGS = {
    "ci": {"steps": 200, "eval_every": 25, "seeds": 5, "prompts": 128, "group": 4},
    "full": {"steps": 400, "eval_every": 25, "seeds": 5, "prompts": 256, "group": 8},
}


def kept_fraction(positions_BT, segment_ids_BT, mask_BN, sinks: int, window: int) -> float:
  """Mean over response tokens of (keys the window cache kept) / (keys a full cache holds) for the query that
  drew the token (the column before it)."""
  from jaxrl_llm.models import cache as cache_lib
  pos, seg = np.asarray(positions_BT)[:, :-1], np.asarray(segment_ids_BT)[:, :-1]
  full = np.asarray(cache_lib.attention_mask(seg, seg))
  kept = full & np.asarray(cache_lib.window_visible(pos[:, :, None], pos[:, None, :], sinks, window))
  N = mask_BN.shape[1]
  frac_BN = kept.sum(-1)[:, -N:] / np.maximum(full.sum(-1)[:, -N:], 1)
  on = np.asarray(mask_BN) > 0
  return float(frac_BN[on].mean())


def measure(base: str, warm: str, prompts: int, group: int, seed: int) -> dict:
  """The mismatch table: per cache, Δ statistics over the held-out prompts' sampled tokens and memory."""
  import jax
  import jax.numpy as jnp
  from jaxrl_llm import loop, policy_init
  from jaxrl_llm.models import cache as cache_lib
  from jaxrl_llm.sampling import generate
  rows = {}
  key = jax.random.key(seed)
  for name, over in CACHES.items():
    c = common.make_config(base, {**BASE, **over, "model.init_from": warm, "sft.steps": 0, "num_steps": 0,
                                  "eval.num_prompts": prompts, "seed": seed})
    run = loop.setup(c)
    model_cfg, params = policy_init.initial_policy(c, run.model_cfg, run.k_init, run.encoder.tokenizer.vocab_size)
    tokens_BP = jnp.asarray(np.repeat(run.test.tokens_BP[:prompts], group, 0))
    len_B = jnp.asarray(np.repeat(run.test.len_B[:prompts], group, 0))
    sc = run.samp_cfg
    out = generate(params, tokens_BP, len_B, key, model_cfg, sc)  # same key: same noise for every cache
    mask = np.asarray(out["mask_BN"])
    old = np.asarray(run.score(params, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], out["mask_BN"]))
    delta = np.where(mask > 0, old - np.asarray(out["behavior_logp_BN"]), 0.0)
    P_, N_ = tokens_BP.shape[1], sc.max_new_tokens
    slots = cache_lib.cache_slots(P_, N_, cache_lib.ring_layout(P_, N_, sc.kv_window_arg))  # what generate allocates
    shapes = jax.eval_shape(lambda: cache_lib.init_cache(model_cfg, 1, slots, sc.kv_dtype))
    row = {**token_stats(delta, mask, band_defaults()), "slots": slots, "bytes_per_seq": cache_lib.cache_bytes(shapes),
           "completion_len_mean": float(mask.sum(1).mean())}
    if sc.kv_window_arg is not None:
      row["ring_buffer_bytes_per_seq"] = cache_lib.ring_buffer_bytes(model_cfg, sc.kv_sinks, sc.kv_window, P_ + N_)
      row["kept_frac"] = kept_fraction(out["positions_BT"], out["segment_ids_BT"], mask, sc.kv_sinks, sc.kv_window)
    rows[name] = row
    common.log(f"mismatch {name}: {row}")
  return rows


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--methods", default="", help="comma-separated subset of methods")
  p.add_argument("--prompts", type=int, default=None,
                 help="held-out prompts of the mismatch table (default: setting's)")
  args = p.parse_args(argv)
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, SETTINGS)
  ms = args.methods.split(",") if args.methods else list(METHODS)
  runs = [{"method": m, "seed": s} for s in range(seeds) for m in ms]
  if args.dry_run:
    for r in runs:
      print(r)
    return ""
  common.enable_compile_cache(os.path.join(args.workdir, "xla_cache"))
  warm = {s: common.warm_start(args.base, {**BASE, "seed": s}, os.path.join(args.workdir, "warm", f"kv_s{s}"))
          for s in range(seeds)}
  prompts = args.prompts or setting["prompts"]
  table = measure(args.base, warm[0], prompts, setting["group"], 0)
  results = []
  for i, r in enumerate(runs):
    over = {**BASE, **CACHES["window"], **METHODS[r["method"]], "seed": r["seed"], "num_steps": steps,
            "eval.every": eval_every, "model.init_from": warm[r["seed"]], "sft.steps": 0}
    out = common.run_one(args.base, over, os.path.join(args.workdir, "kv", f"{r['method']}_s{r['seed']}"))
    results.append({**r, **out})
    s = out.get("summary", {})
    common.log(f"{i + 1}/{len(runs)} {r} reward {s.get('reward_mean_last')} acc {s.get('eval_accuracy_initial')} -> "
               f"{s.get('eval_accuracy_late')} ({out.get('wall_s', 0):.0f}s) {out.get('error', '')}")
  return common.write_results("kv_compression", {
      "setting": name, "steps": steps, "seeds": seeds, "eval_every": eval_every, "base_config": args.base,
      "base_overrides": BASE, "caches": CACHES, "methods": METHODS, "prompts": prompts,
      "group": setting["group"], "bands": band_defaults(), "mismatch": table, "runs": results}, args.out, argv)


if __name__ == "__main__":
  print(main())
