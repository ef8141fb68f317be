"""Decode through the layer scan against the unstacked decode view (`model.decode_unroll`), on the real model.

  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python -m bench.decode_unroll [--model DIR] [--batch 16 64] [--prompt 48]
      [--new-tokens 64] [--kv-cache full int8]

SmolLM2-135M-Instruct (`make smollm2`; 30 layers) as workload R runs it (`layer_unroll=1`, fp32, temperature 1, no
stop ids so every row decodes every step), random prompt ids. For each batch and each setting, `sampling.generate`
of 1 and of `--new-tokens` tokens, each best of 2 after a compiling call; decode step = (time(N) - time(1)) /
(N - 1). `--kv-cache`: the sampler's cache formats to run (`sampler.kv_cache`: full, int8). Prints one JSON object
per (batch, cache, setting): the decode step and the 1-token call (the prefill) in ms, and the first (compiling)
call's seconds.
A bound for comparison is in bench/README.md's R_small roofline (parameters + KV cache read per step, or FLOPs).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.gguf import default_cache_dir
from jaxrl_llm.models.hf import load_hf
from jaxrl_llm.sampling import SamplerConfig, generate


def _timed(fn) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn()["tokens_BN"])
  return time.perf_counter() - t0


def measure(model_dir: str, batches: list[int], prompt: int, new_tokens: int,
            kv_caches: tuple[str, ...] = ("full",)) -> list[dict]:
  cfg0, params = load_hf(model_dir, param_dtype="float32")
  out = []
  for B in batches:
    toks = jnp.asarray(np.random.default_rng(0).integers(10, 1000, (B, prompt)), jnp.int32)
    lens = jnp.full((B,), prompt, jnp.int32)
    for kv_cache, unstacked in itertools.product(kv_caches, (False, True)):
      cfg = dataclasses.replace(cfg0, layer_unroll=1, decode_unroll=unstacked,
                                max_seq_len=max(cfg0.max_seq_len, prompt + new_tokens + 1))
      best, first = {}, {}
      for n in (1, new_tokens):
        sc = SamplerConfig(max_new_tokens=n, stop_ids=(), pad_id=0, temperature=1.0, kv_cache=kv_cache)
        first[n] = _timed(lambda: generate(params, toks, lens, jax.random.key(0), cfg, sc))
        best[n] = min(_timed(lambda r=r: generate(params, toks, lens, jax.random.key(r + 1), cfg, sc))
                      for r in range(2))
      out.append({"batch": B, "kv_cache": kv_cache, "decode_unroll": unstacked,
                  "decode_step_ms": round(1000 * (best[new_tokens] - best[1]) / (new_tokens - 1), 1),
                  "prefill_ms": round(1000 * best[1], 1),
                  "first_call_s": round(first[new_tokens], 1)})
      print(json.dumps(out[-1]), flush=True)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default=str(default_cache_dir()))
  ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
  ap.add_argument("--prompt", type=int, default=48)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--kv-cache", nargs="+", default=["full"], choices=["full", "int8"])
  a = ap.parse_args()
  measure(a.model, a.batch, a.prompt, a.new_tokens, tuple(a.kv_cache))


if __name__ == "__main__":
  main()
