"""LoRA sampling: merged weights per publish (what the ParamStore does) against adapters applied in the forward.

  python -m bench.lora_sampling [--d_model 256 --n_layers 4 --rank 16 --batch 16 --new 32]

Prints one JSON object: the seconds of a LoRA publish (copy the adapters, merge them into the sampler's base) and
of a full-weight publish, and the seconds of one `generate` call from the merged weights and from the policy with
its adapters unmerged, with the decode loop unrolled over layers (adapters merged once per call, before the loop)
and rolled (merged inside the layer scan at every decode step). Best of `--repeats` after one warm-up call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from bench import common
from jaxrl_llm.models import ModelConfig, init_params, lora
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.sampling import SamplerConfig, generate


def measure(d_model: int, n_layers: int, rank: int, batch: int, new: int, repeats: int) -> dict:
  cfg = ModelConfig(vocab_size=512, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                    head_dim=d_model // 4, d_ff=3 * d_model, max_seq_len=64 + new, layer_unroll=n_layers)
  base = init_params(cfg, jax.random.key(0))
  lc = lora.LoraConfig(rank, 2.0 * rank, tuple(lora.TARGETS))
  ad = lora.init_adapters(cfg, lc, jax.random.key(1))
  ad = ad.replace(weights={w: {**ab, "lora_B": 0.01 * jnp.ones_like(ab["lora_B"])} for w, ab in ad.weights.items()})
  policy = lora.attach(base, ad)
  out = {"config": {"d_model": d_model, "n_layers": n_layers, "rank": rank, "batch": batch, "new_tokens": new},
         "adapter_bytes_over_full": lora.nbytes(ad) / lora.nbytes(base)}
  store_lora, store_full = ParamStore(keep_last=1), ParamStore(keep_last=1)
  out["publish_lora_s"] = common.time_calls(lambda: store_lora.acquire(store_lora.publish(policy)).params,
                                            repeats=repeats)["best_s"]
  out["publish_full_s"] = common.time_calls(lambda: store_full.acquire(store_full.publish(base)).params,
                                            repeats=repeats)["best_s"]
  merged = store_lora.acquire().params
  scfg = SamplerConfig(max_new_tokens=new, stop_ids=(), pad_id=0, temperature=1.0)
  prompts = jax.random.randint(jax.random.key(2), (batch, 16), 3, cfg.vocab_size)
  lens = jnp.full((batch,), 16)
  for name, params, c in (("merged", merged, cfg), ("unmerged_unrolled", policy, cfg),
                          ("unmerged_rolled", policy, dataclasses.replace(cfg, layer_unroll=1)),
                          ("merged_rolled", merged, dataclasses.replace(cfg, layer_unroll=1))):
    fn = lambda p=params, c=c: generate(p, prompts, lens, jax.random.key(3), c, scfg)["tokens_BN"]
    out[f"generate_{name}_s"] = common.time_calls(fn, repeats=repeats)["best_s"]
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--n_layers", type=int, default=4)
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--new", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  a = p.parse_args()
  print(json.dumps(measure(a.d_model, a.n_layers, a.rank, a.batch, a.new, a.repeats), indent=2))


if __name__ == "__main__":
  main()
