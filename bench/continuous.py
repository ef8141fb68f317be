"""Long-tailed rollouts: static batches (`sampling.generate`) against continuous batching (`sampling.continuous`).

  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python bench/continuous.py [--dist geometric|episode] [--requests 128]
      [--slots 16] [--new-tokens 128] [--stop-ids 16] [--chunk 8] [--d-model 128] [--layers 2]

Two length distributions (`--dist`), both on toy models of the same shape (V = 512):
  - geometric: a model at init (next-token distributions close to uniform over V) with the first `--stop-ids`
    token ids as stop ids: every step stops a row with probability ≈ stop_ids / V, so completion lengths are
    geometric (mean V / stop_ids, capped at N): the long tail of reasoning traces;
  - episode: agent episodes, most short and some truncated at the cap. `episode_lengths` draws each request's
    length (80 % uniform in [1, N/8], 10 % in (N/8, N), 10 % at N, never stopping), and `chain_params` makes a
    model that realises them exactly: its layers' output projections are zero (the same FLOPs, no contribution),
    and embedding and head make token i predict i + 1 with a margin of ~30 nats, so a prompt ending in token
    V − 1 − L emits L tokens up to the stop id V − 1 (`realised_lengths_ok` checks every length).
Both paths decode the same R requests with the same per-request keys (identical tokens, checked), B = S rows at a
time: static batches of S requests each decode until their longest row stops; continuous batching refills a slot
as soon as its request stops. `measure` returns (and the CLI prints) one JSON object: wall seconds (best of
--repeats after a warm-up run that compiles), generated tokens per second, and the share of decode slot-steps
spent on rows that had already stopped (or on empty slots). `python -m bench.run --only-tail` measures both
distributions into bench/results.json and the README's long-tail table.

Measured once (2026-12-03, CPU: 2 cores shared with 4 other jobs, load ~9, so times are noisy; geometric, defaults:
128 requests, 16 slots, N = 128, stop probability 1/32 per step, mean length 34.8, 4,458 tokens, tokens identical):
static 2.65 s (1.68 k tok/s), 65.6 % of decode slot-steps wasted on stopped rows; continuous (chunk 8) 1.86 s
(2.40 k tok/s, 1.42x), 23.1 % wasted; with --chunk 4: static 2.38 s, continuous 1.32 s (1.80x), 18.5 % wasted.
What continuous batching still wastes: a stopped row waits for its chunk's end, and the last requests decode
with the queue empty (the same tail the static path has, once).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampling import SamplerConfig, continuous, generate


def static_run(params, prompts_RP, len_R, keys_R, cfg, sc, batch: int) -> dict:
  """`generate` over consecutive batches of `batch` requests: host outputs and decode slot-step counters."""
  toks, slot_steps, live_steps = [], 0, 0
  for i in range(0, len(len_R), batch):
    out = jax.device_get(generate(params, prompts_RP[i:i + batch], len_R[i:i + batch], keys_R[i:i + batch], cfg, sc))
    lengths = out["lengths_B"]
    slot_steps += batch * (int(lengths.max()) - 1)  # decode steps after column 0 (sampled from the prefill)
    live_steps += int((lengths - 1).sum())
    toks.append(out["tokens_BN"])
  return {"tokens_BN": np.concatenate(toks), "slot_steps": slot_steps, "live_steps": live_steps}


def timed(fn, repeats: int) -> tuple[dict, float]:
  """(result, best wall seconds of `repeats` calls after a first one that compiles)."""
  out, best = fn(), float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - t0)
  return out, best


DISTS = ("geometric", "episode")
V = 512  # vocabulary of both toy models


def episode_lengths(rng: np.random.Generator, R: int, N: int) -> np.ndarray:
  """Completion lengths of R agent-like episodes, capped at N: 80 % uniform in [1, N/8], 10 % uniform in
  (N/8, N), 10 % at the cap N (truncated: they never stop)."""
  short = max(N // 8, 1)
  kind = rng.choice(3, size=R, p=(0.8, 0.1, 0.1))
  mid = rng.integers(short + 1, N, R) if N > short + 1 else np.full(R, N)
  return np.where(kind == 0, rng.integers(1, short + 1, R), np.where(kind == 1, mid, N)).astype(np.int32)


def chain_params(cfg: ModelConfig, key) -> dict:
  """Params of `cfg` whose greedy-and-sampled next token after i is i + 1 (at temperature 1: the next best
  logit is ~30 nats lower): each layer's attention and MLP output projections are zero, so the residual stream
  is the token's embedding (unit rows), and the head's column j is the embedding of j − 1 scaled so that the
  final RMSNorm's output scores the match at ~60."""
  params = init_params(cfg, key)
  E = np.array(jax.random.normal(jax.random.fold_in(key, 1), (cfg.vocab_size, cfg.d_model)))
  E /= np.linalg.norm(E, axis=1, keepdims=True)
  head = np.roll(E, 1, axis=0).T * (60.0 / np.sqrt(cfg.d_model))  # column j: E[j - 1]
  layers = {**params["layers"], "wo": jnp.zeros_like(params["layers"]["wo"]),
            "w_down": jnp.zeros_like(params["layers"]["w_down"])}
  return {**params, "embed": jnp.asarray(E, params["embed"].dtype), "layers": layers,
          "final_norm": jnp.ones_like(params["final_norm"]), "lm_head": jnp.asarray(head, params["lm_head"].dtype)}


def setup(dist: str, requests: int, new_tokens: int, stop_ids: int, d_model: int, layers: int, prompt_width: int):
  """(params, cfg, sampler cfg, prompts_RP, len_R, keys_R, target lengths or None) of one distribution."""
  if dist not in DISTS:
    raise ValueError(f"--dist {dist!r}: one of {DISTS}")
  R, P, N = requests, prompt_width, new_tokens
  cfg = ModelConfig(vocab_size=V, d_model=d_model, n_layers=layers, n_heads=4, n_kv_heads=2,
                    head_dim=max(d_model // 4, 8), d_ff=4 * d_model, max_seq_len=P + N)
  rng = np.random.default_rng(0)
  len_R = rng.integers(max(P // 2, 1), P + 1, R).astype(np.int32)
  keys_R = jax.random.split(jax.random.key(1), R)
  if dist == "geometric":
    params = init_params(cfg, jax.random.key(0))
    sc = SamplerConfig(max_new_tokens=N, stop_ids=tuple(range(stop_ids)), temperature=1.0)
    prompts_RP = rng.integers(stop_ids, V, (R, P)).astype(np.int32)
    return params, cfg, sc, prompts_RP, len_R, keys_R, None
  if N > V - 3:
    raise ValueError(f"episode lengths up to N = {N} need N <= V - 3 = {V - 3}")
  target_R = episode_lengths(rng, R, N)
  params = chain_params(cfg, jax.random.key(0))
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(V - 1,), temperature=1.0)
  prompts_RP = rng.integers(1, V - 1, (R, P)).astype(np.int32)
  # The prompt's last token (column P - 1, left padding) starts the chain: V - 1 - L reaches the stop id after L
  # tokens; a capped request starts at 1 and never reaches it within N.
  prompts_RP[:, -1] = np.where(target_R < N, V - 1 - target_R, 1)
  return params, cfg, sc, prompts_RP, len_R, keys_R, target_R


def measure(dist: str = "geometric", requests: int = 128, slots: int = 16, new_tokens: int = 128, stop_ids: int = 16,
            chunk: int = 8, d_model: int = 128, layers: int = 2, prompt_width: int = 16, repeats: int = 3) -> dict:
  """Static batches against continuous batching on one distribution: the result row (see the module docstring)."""
  params, cfg, sc, prompts_RP, len_R, keys_R, target_R = setup(dist, requests, new_tokens, stop_ids, d_model, layers,
                                                                prompt_width)
  R, S = requests, slots
  st, t_static = timed(lambda: static_run(params, prompts_RP, len_R, keys_R, cfg, sc, S), repeats)
  cb, t_cont = timed(lambda: continuous.generate_slots(params, prompts_RP, len_R, keys_R, cfg, sc, slots=S,
                                                       chunk=chunk), repeats)
  lengths = cb["lengths_B"]
  tokens = int(lengths.sum())
  res = {
      "dist": dist, "requests": R, "slots": S, "chunk": chunk, "new_tokens": new_tokens,
      "d_model": d_model, "layers": layers, "device": jax.devices()[0].platform, "cpu_count": os.cpu_count(),
      "load_1min": os.getloadavg()[0],
      "length_mean": float(lengths.mean()), "length_max": int(lengths.max()), "tokens": tokens,
      "at_cap": float((lengths == new_tokens).mean()),
      "same_tokens": bool(np.array_equal(st["tokens_BN"], cb["tokens_BN"])),
      "static_s": round(t_static, 3), "continuous_s": round(t_cont, 3),
      "static_tokens_per_s": round(tokens / t_static, 1), "continuous_tokens_per_s": round(tokens / t_cont, 1),
      "speedup": round(t_static / t_cont, 2),
      "static_wasted": round(1 - st["live_steps"] / st["slot_steps"], 3),
      "continuous_wasted": round(1 - cb["live_steps"] / cb["slot_steps"], 3),
      "static_slot_steps": st["slot_steps"], "continuous_slot_steps": cb["slot_steps"],
  }
  if dist == "geometric":
    res["stop_prob"] = stop_ids / V
  else:
    res["realised_lengths_ok"] = bool(np.array_equal(lengths, target_R))
  return res


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dist", default="geometric", choices=DISTS)
  ap.add_argument("--requests", type=int, default=128)
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--stop-ids", type=int, default=16)
  ap.add_argument("--chunk", type=int, default=8)
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--prompt-width", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  a = ap.parse_args(argv)
  print(json.dumps(measure(a.dist, a.requests, a.slots, a.new_tokens, a.stop_ids, a.chunk, a.d_model, a.layers,
                           a.prompt_width, a.repeats)))


if __name__ == "__main__":
  main()
