"""Sampler throughput of `sampling.generate`: prefill and decode tokens/s against compute / bandwidth bounds.

prefill: `generate` with one new token (the prefill plus one sampled column), B·P / time.
decode:  (time(N) − time(1)) per B·(N − 1) decoded tokens (best-of-k times). Stopping is disabled (no stop ids) so every row
decodes all N tokens.
Bounds: prefill is compute bound (2·N_params·tokens + attention, lm-head on the last position only,
at the matmul peak); a decode step
is bound by max(FLOPs / peak, bytes / copy bandwidth), the bytes being every weight and the whole
KV cache read once per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench import common, workloads
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampling import SamplerConfig, generate


def _time_generate(params, cfg: ModelConfig, B: int, P: int, N: int, repeats: int) -> float:
  """Best-of-`repeats` seconds of one `generate` call (best: decode is a difference of two timings, so
  contention spikes in either would distort it)."""
  prompt_BP = jax.random.randint(jax.random.key(1), (B, P), 4, cfg.vocab_size, jnp.int32)
  len_B = jnp.full((B,), P, jnp.int32)
  scfg = SamplerConfig(max_new_tokens=N, stop_ids=(), pad_id=0, temperature=1.0)
  key = jax.random.key(2)
  return common.time_calls(lambda: generate(params, prompt_BP, len_B, key, cfg, scfg), warmup=1,
                           repeats=repeats)["best_s"]


def measure(peak_flops: float, bandwidth: float, batches=workloads.SAMPLER_BATCHES,
            new_tokens=workloads.SAMPLER_NEW_TOKENS, model: dict = workloads.SAMPLER_MODEL,
            P: int = workloads.SAMPLER_PROMPT_LEN, repeats: int = 1) -> list[dict]:
  """One row per (batch, new tokens) with achieved and bound tokens/s."""
  rows = []
  for B in batches:
    for N in new_tokens:
      cfg = ModelConfig(**model, max_seq_len=P + N)
      params = init_params(cfg, jax.random.key(0))
      # Prefill and short generations are cheap: more repeats keep time(N) − time(1) meaningful.
      t1 = _time_generate(params, cfg, B, P, 1, 3 * repeats)
      tN = _time_generate(params, cfg, B, P, N, repeats if N > 32 else 3 * repeats)
      prefill_tps = B * P / t1
      prefill_bound = B * P * peak_flops / common.prefill_flops(cfg, B, P)
      step_flops = common.forward_flops(cfg, B, P + N, causal=False)  # one new token per row, full cache
      step_bytes = common.param_bytes(cfg, 4) + common.kv_cache_bytes(cfg, B, P + N, 4)
      decode_step_bound_s = max(step_flops / peak_flops, step_bytes / bandwidth)
      decode_tps = B * (N - 1) / max(tN - t1, 1e-9)
      rows.append({"batch": B, "prompt_len": P, "new_tokens": N, "generate_s": tN, "prefill_s": t1,
                   "prefill_tokens_per_s": prefill_tps, "prefill_bound_tokens_per_s": prefill_bound,
                   "prefill_frac_of_bound": prefill_tps / prefill_bound,
                   "decode_tokens_per_s": decode_tps, "decode_bound_tokens_per_s": B / decode_step_bound_s,
                   "decode_frac_of_bound": decode_tps * decode_step_bound_s / B,
                   "decode_bound_kind": "compute" if step_flops / peak_flops >= step_bytes / bandwidth else "memory",
                   "compiles_generate": generate._cache_size()})
  return rows
