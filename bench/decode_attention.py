"""Decode-step attention as dots against `layers.decode_attention` (summed products), at SmolLM2-135M's shapes.

  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python -m bench.decode_attention [--batch 1 16 64] [--slots 113] [--step]

One decode step's attention over every layer (30 layers, 9 query heads on 3 key/value heads, head dim 64, as
SmolLM2-135M-Instruct; `--slots` cache slots: workload R_small's prompt 48 + 64 new tokens + 1), random
queries, keys and values, each layer's cache its own buffer as in the decode loop: "dots" is the formulation
decode loops used before (`einsum` over keys [B, K, S, hd] and values [B, K, hd, S], the layouts XLA:CPU's dots
want), "sums" is `layers.decode_attention` over keys [B, K, hd, S] and values [B, K, S, hd]. Best of 5 after a
compiling call, the two taking turns in the same process. `--step` also times the real model's whole decode step
with the current code (`make smollm2` first; as bench/decode_unroll.py), for the share attention takes of it.
Prints one JSON object per batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxrl_llm.models import layers

L, K, Q, HD = 30, 3, 3, 64  # SmolLM2-135M


def _dots(q_BTHd, k_BKSd, v_BKdS, mask_BTS):
  B, T, H, hd = q_BTHd.shape
  q = q_BTHd.reshape(B, T, K, Q, hd)
  s = jnp.einsum("btkqd,bksd->bkqts", q, k_BKSd, preferred_element_type=jnp.float32) * hd ** -0.5
  p = jax.nn.softmax(jnp.where(mask_BTS[:, None, None], s, layers.MASK_VALUE), axis=-1)
  return jnp.einsum("bkqts,bkds->btkqd", p, v_BKdS).reshape(B, T, H, hd)


def _chain(fn):
  """Every layer's attention in turn (each query from the last output, so none is skipped)."""
  def run(q, ks, vs, mask):
    for k, v in zip(ks, vs):
      q = fn(q, k, v, mask)
    return q
  return jax.jit(run)


def _best(fn, *args, reps: int = 5) -> float:
  return common.time_calls(lambda: fn(*args), repeats=reps)["best_s"]


def attention_ms(B: int, S: int, n_layers: int = L) -> dict:
  keys = jax.random.split(jax.random.key(0), 2 * n_layers + 1)
  q = jax.random.normal(keys[0], (B, 1, K * Q, HD))
  k_BKSd = [jax.random.normal(keys[1 + i], (B, K, S, HD)) for i in range(n_layers)]
  v_BKdS = [jax.random.normal(keys[1 + n_layers + i], (B, K, HD, S)) for i in range(n_layers)]
  k_BKdS, v_BKSd = [jnp.swapaxes(x, 2, 3) for x in k_BKSd], [jnp.swapaxes(x, 2, 3) for x in v_BKdS]
  mask = jnp.ones((B, 1, S), bool)
  dots, sums = _chain(_dots), _chain(layers.decode_attention)
  diff = float(jnp.max(jnp.abs(dots(q, k_BKSd, v_BKdS, mask) - sums(q, k_BKdS, v_BKSd, mask))))
  t_dots, t_sums = _best(dots, q, k_BKSd, v_BKdS, mask), _best(sums, q, k_BKdS, v_BKSd, mask)
  cache_bytes = 2 * n_layers * B * K * S * HD * 4
  return {"batch": B, "slots": S, "dots_ms": round(1e3 * t_dots, 2), "sums_ms": round(1e3 * t_sums, 2),
          "speedup": round(t_dots / t_sums, 2), "sums_cache_GB_per_s": round(cache_bytes / t_sums / 1e9, 1),
          "max_abs_diff": diff}


def decode_step_ms(B: int, prompt: int, new_tokens: int) -> float:
  from jaxrl_llm.models.gguf import default_cache_dir
  from jaxrl_llm.models.hf import load_hf
  from jaxrl_llm.sampling import SamplerConfig, generate
  cfg, params = load_hf(str(default_cache_dir()), param_dtype="float32")
  cfg = dataclasses.replace(cfg, layer_unroll=1, max_seq_len=max(cfg.max_seq_len, prompt + new_tokens + 1))
  toks = jnp.asarray(np.random.default_rng(0).integers(10, 1000, (B, prompt)), jnp.int32)
  lens = jnp.full((B,), prompt, jnp.int32)
  best = {}
  for n in (1, new_tokens):
    sc = SamplerConfig(max_new_tokens=n, stop_ids=(), pad_id=0, temperature=1.0)
    best[n] = _best(lambda: generate(params, toks, lens, jax.random.key(0), cfg, sc)["tokens_BN"], reps=2)
  return round(1e3 * (best[new_tokens] - best[1]) / (new_tokens - 1), 1)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
  ap.add_argument("--slots", type=int, default=113)
  ap.add_argument("--step", action="store_true", help="also time the real model's decode step")
  a = ap.parse_args()
  for B in a.batch:
    row = attention_ms(B, a.slots)
    if a.step:
      row["decode_step_ms"] = decode_step_ms(B, 48, 64)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
