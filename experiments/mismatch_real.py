"""Train/inference mismatch of the real SmolLM2-135M-Instruct: bf16 and int8 samplers against the fp32 learner.

A measurement, not a training run: the held-out chat prompts of configs/smollm2_grpo.py are sampled
(G completions each, the config's temperature) by each sampler variant, and every sampled token is
rescored by the fp32 learner at the same parameters. Per token, Δ = log π_old − log μ (π_old: fp32
learner, μ: the sampler's own log-prob of the token it drew). Reported per sampler:
- |Δ| mean, median, p99, max over completion tokens, and the mean per-sequence |Σ Δ|;
- the fraction of tokens whose k = π_old/μ = exp(Δ) falls outside IcePop's kept band [α, β]
  (`losses/icepop.py` defaults), outside MIS's token band [lower, upper] (`losses/mis.py`), and above
  the TIS cap C (`losses/tis.py`): the tokens those corrections would mask or clip;
- the fp32 sampler as the control: its Δ is the cached-decode vs full-forward reduction-order noise.

    python -m experiments.mismatch_real                 # 64 prompts x 4 completions, ≈ 3 min on 2 cores
    python -m experiments.mismatch_real --prompts 256 --group 8 --new-tokens 64   # an accelerator

Needs the model folder (`make smollm2`). Writes experiments/results/mismatch_real.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import numpy as np

from experiments import common

VARIANTS = ("float32", "bfloat16", "int8")


def band_defaults() -> dict:
  """The bounds the corrections use by default, read from their hyper-parameter dataclasses."""
  from jaxrl_llm.losses import icepop, mis, tis
  ice, m, t = icepop.Hparams(), mis.Hparams(), tis.Hparams()
  return {"icepop": (ice.alpha, ice.beta), "mis": (m.lower[0], m.upper[0]), "tis_cap": t.cap}


def token_stats(delta_BN: np.ndarray, mask_BN: np.ndarray, bands: dict) -> dict:
  """Summary statistics of Δ = log π_old − log μ over the completion tokens (mask 1)."""
  on = mask_BN > 0
  d = delta_BN[on].astype(np.float64)
  a = np.abs(d)
  k_lo, k_hi = bands["icepop"]
  m_lo, m_hi = bands["mis"]
  seq = np.abs(np.where(on, delta_BN, 0.0).sum(axis=1))
  return {
      "tokens": int(on.sum()),
      "abs_mean": float(a.mean()), "abs_median": float(np.median(a)),
      "abs_p99": float(np.quantile(a, 0.99)), "abs_max": float(a.max()),
      "seq_abs_sum_mean": float(seq[on.any(axis=1)].mean()),
      "icepop_out_frac": float(np.mean((d < math.log(k_lo)) | (d > math.log(k_hi)))),
      "mis_out_frac": float(np.mean((d < math.log(m_lo)) | (d > math.log(m_hi)))),
      "tis_capped_frac": float(np.mean(d > math.log(bands["tis_cap"]))),
  }


def main(argv=None) -> str:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--prompts", type=int, default=64, help="held-out prompts")
  p.add_argument("--group", type=int, default=4, help="completions per prompt")
  p.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default: the config's)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=common.RESULTS_DIR)
  args = p.parse_args(argv)

  import jax
  import jax.numpy as jnp
  from jaxrl_llm import loop, policy_init
  from jaxrl_llm.sampling import generate
  from jaxrl_llm.sampling.quantize import int8_weight_only

  over = {"eval.num_prompts": args.prompts, "task.held_out": args.prompts, "seed": args.seed}
  if args.new_tokens:
    over["sampler.max_new_tokens"] = args.new_tokens
  c = common.make_config("smollm2_grpo", over)
  run = loop.setup(c)
  model_cfg, params = policy_init.initial_policy(c, run.model_cfg, run.k_init, run.encoder.tokenizer.vocab_size)
  G = args.group
  tokens_BP = jnp.asarray(np.repeat(run.test.tokens_BP, G, axis=0))
  len_B = jnp.asarray(np.repeat(run.test.len_B, G, axis=0))
  bands = band_defaults()
  key = jax.random.key(args.seed)
  rows = {}
  for variant in VARIANTS:
    t0 = time.perf_counter()
    if variant == "int8":  # weight-only int8 round trip, fp32 compute (the loop's sampler.quantization=int8)
      s_cfg, s_params = model_cfg, int8_weight_only(params)
    else:
      s_cfg = dataclasses.replace(model_cfg, dtype=variant)
      s_params = jax.tree.map(lambda x: x.astype(variant) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    out = generate(s_params, tokens_BP, len_B, key, s_cfg, run.samp_cfg)  # same key: same noise per variant
    mask_BN = np.asarray(out["mask_BN"])
    old_BN = np.asarray(run.score(params, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"],
                                  out["mask_BN"]))
    delta_BN = np.where(mask_BN > 0, old_BN - np.asarray(out["behavior_logp_BN"]), 0.0)
    rows[variant] = {**token_stats(delta_BN, mask_BN, bands), "seconds": time.perf_counter() - t0}
    common.log(f"{variant}: {rows[variant]}")
  return common.write_results("mismatch_real", {
      "model": "SmolLM2-135M-Instruct (configs/smollm2_grpo.py)", "prompts": len(run.test.examples),
      "group": G, "max_new_tokens": c.sampler.max_new_tokens, "temperature": c.sampler.temperature,
      "bands": bands, "variants": rows}, args.out, argv)


if __name__ == "__main__":
  print(main())
