"""Workload R: our GRPO step on the real SmolLM2-135M-Instruct (its weights, tokenizer and chat template).

Chat-templated 2-digit addition prompts (task `arithmetic_chat` through `tasks.encoder.Encoder`),
`prompts × G` completions of up to N new tokens (stop at the tokenizer's stop ids), k3 KL β = 0.04 to
a frozen copy of the initial weights, one update per batch, fp32 learner: `grpo_step.step` with this
model, tokenizer and width (`bench.workloads.REAL` names the sizes).

Besides the step time, `phases` times each phase on its own (prefill, decode, reference scoring, train)
with its peak RSS, and `roofline` sets each against the FLOPs / bytes it must at least move on this
machine (`bench/peak.py`'s peak and bandwidth measured in the same run).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common, grpo_step, workloads
from jaxrl_llm import learner
from jaxrl_llm import memory as memory_lib
from jaxrl_llm.keys import fold_in
from jaxrl_llm.models import ModelConfig, load_hf
from jaxrl_llm.rollout import collect
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.tasks import get_task
from jaxrl_llm.policy_init import tokenizer_for_checkpoint
from jaxrl_llm.tasks.encoder import Encoder, measured_width

DECODE_BATCH = 64  # decode is also measured at this batch (the decode target)


def default_model_dir() -> str:
  from jaxrl_llm.models.gguf import default_cache_dir  # numpy-only: no torch
  return str(default_cache_dir())


def _remat(cfg: ModelConfig, remat: str, run: dict, P: int) -> str:
  """`remat`, with "auto" decided as a run's `model.remat="auto"` is (`memory.choose_remat` against the machine's
  budget), for this workload's step: one learner micro-batch of every row, the frozen reference beside the policy."""
  if remat != "auto":
    return remat
  B = run["prompts_per_step"] * run["group_size"]
  shape = memory_lib.StepShape(rows=B, prompt=P, new=run["max_new_tokens"], micro_rows=B, frozen_copies=1,
                               sampler_copy=False)
  return memory_lib.choose_remat(cfg, shape, memory_lib.budget_bytes(0.0)).remat


def build(variant: str = "R_small", model_dir: str | None = None, *, remat: str | None = None,
          shared_prefill: bool = False, run: dict | None = None, features: dict | None = None,
          base: dict | None = None) -> dict:
  """Everything one step of workload `variant` needs (a `grpo_step.step` context) from a HF folder.

  `features` (`bench/features.py`): speed features of our side (its remat overrides `remat`); `base`: a context
  built before for the same workload and folder, whose weights, tokenizer and frozen reference this one shares
  (a feature variant: the model is read once; the train state is its own copy)."""
  if variant not in workloads.REAL:
    raise ValueError(f"workload {variant!r}: must be one of {sorted(workloads.REAL)}")
  run = {**workloads.REAL_RUN, **workloads.REAL[variant], **(run or {})}
  model_dir = model_dir or default_model_dir()
  if base is None:
    rss_base = rss_bytes()  # the runtime (Python, JAX, XLA) before any model array exists
    cfg, params = load_hf(model_dir, param_dtype="float32")
    encoder = Encoder(tokenizer_for_checkpoint(model_dir), chat_template="chat")
    ref_params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
  else:
    rss_base, cfg, encoder, ref_params = base["rss_base"], base["cfg"], base["encoder"], base["ref_params"]
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), ref_params)
  task = get_task("arithmetic_chat", num_digits=run["num_digits"])
  sample = [task.make_example(np.random.default_rng(s)) for s in range(64)]
  P = measured_width(encoder, [ex["prompt"] for ex in sample])
  N = run["max_new_tokens"]
  cfg = dataclasses.replace(cfg, remat=_remat(cfg, remat or run["remat"], run, P), layer_unroll=run["layer_unroll"],
                            max_seq_len=max(cfg.max_seq_len, P + N))
  # Shared prompts (as loop.run does): the sampler prefills each group's prompt once, and the reference
  # scorer and the learner run it once per group; G = 1 is the row-by-row path.
  G = run["group_size"] if shared_prefill else 1
  tok = encoder.tokenizer
  sampler_cfg = SamplerConfig(max_new_tokens=N, stop_ids=tok.stop_ids, pad_id=tok.pad_id,
                              temperature=run["temperature"], group_size=G)
  cfg, sampler_cfg, feats = grpo_step.with_features(cfg, sampler_cfg, features)
  tx = learner.make_optimizer(run["lr"], grad_clip=1.0)
  score = learner.make_score_fn(cfg, run["temperature"], group_size=G)
  return {
      "variant": variant, "model_dir": model_dir, "rss_base": rss_base, "task": task, "encoder": encoder, "P": P, "cfg": cfg,
      "run": {**run, "prompt_width": P, "shared_prefill": bool(shared_prefill)}, "features": feats,
      "sampler_cfg": sampler_cfg,
      "state": learner.init_state(params, tx),
      "ref_params": ref_params,
      "score": score,
      "train_step": learner.fuse_reference(
          learner.make_train_step(cfg, tx, "ppo_clip", {"eps_low": run["epsilon"], "eps_high": run["epsilon"]},
                                  temperature=run["temperature"], agg_mode="seq-mean-token-mean",
                                  kl_coef=run["beta"], kl_estimator="k3", group_size=G), score),
      "rng": np.random.default_rng(run["seed"]),
      "key": jax.random.key(run["seed"] + 1),
  }


# ----------------------------------------------------------------------------- memory


def rss_bytes() -> int:
  with open("/proc/self/status") as f:
    return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class RssPeak:
  """`with RssPeak() as r: ...` then `r.peak` is the largest RSS (bytes) seen inside, sampled every
  `every_s` by a thread (a lower bound of the true peak: a spike shorter than `every_s` can slip by)."""

  def __init__(self, every_s: float = 0.01):
    self.every_s, self.peak, self._stop = every_s, 0, threading.Event()

  def _watch(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, rss_bytes())
      self._stop.wait(self.every_s)

  def __enter__(self):
    self.start = self.peak = rss_bytes()
    self._thread = threading.Thread(target=self._watch, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, rss_bytes())


def activation_bytes(cfg: ModelConfig, B: int, T: int, remat: str, N: int) -> int:
  """Bytes the backward pass keeps from the forward, from shapes (`jaxrl_llm.memory.activation_bytes`),
  the lm-head counted as whole [B, N, V] logits and their gradient (a bound: the learner forms them in chunks)."""
  return memory_lib.activation_bytes(cfg, B, T, remat, N, head_positions=N)


def memory_budget(cfg: ModelConfig, B: int, P: int, N: int, remat: str) -> dict:
  """Bytes each phase needs from shapes (`jaxrl_llm.memory.phase_bytes`): resident state (policy + reference +
  AdamW moments) plus what the phase adds (KV cache and the decode view's weight copy; scoring logits; gradients +
  activations), logits whole."""
  shape = memory_lib.StepShape(rows=B, prompt=P, new=N, micro_rows=B, frozen_copies=1, sampler_copy=False)
  phases = memory_lib.phase_bytes(cfg, shape, remat, whole_logits=True)
  return {k: phases[k] for k in ("params", "resident", "decode_view", "prefill", "decode", "reference", "train")}


# ----------------------------------------------------------------------------- phases


def _batch_of(ctx: dict, t: int):
  """One step's prompts (the next `prompts_per_step` examples, G times each) and its key."""
  run = ctx["run"]
  examples = [ctx["task"].make_example(ctx["rng"]) for _ in range(run["prompts_per_step"])]
  p = collect.encode_prompts([ex for ex in examples for _ in range(run["group_size"])], ctx["P"], ctx["encoder"])
  return p, fold_in(ctx["key"], t)


def phases(ctx: dict, t: int) -> dict:
  """Times prefill (a 1-token generate), generate, reference scoring alone and the fused reference +
  train step on one batch, each once (after an untimed call when the step has not compiled it), with
  each phase's peak RSS; and prefill / generate at batch `DECODE_BATCH` (the prompts tiled). With speed
  features on (`ctx["features"]`), generate and the train step run the features' path (the roofline's
  FLOP model stays the padded static one); prefill and the batch-64 extra run the static sampler.

  decode = generate − prefill. The train step, the last phase, takes the context's state itself and donates it,
  as the loop's step does (a copy would keep a second set of weights and AdamW moments alive in the phase's peak
  RSS, which the budget does not hold); the context's state is then the updated one.
  """
  p, key = _batch_of(ctx, t)
  cfg, scfg = ctx["cfg"], ctx["sampler_cfg"]
  one = dataclasses.replace(scfg, max_new_tokens=1, spec_gamma=0)
  out = {}

  def timed(name, fn, warm=True):
    if warm:
      common.block(fn())  # compile (first time) and warm
    with RssPeak() as r:
      t0 = time.perf_counter()
      res = common.block(fn())
      out[name + "_s"] = time.perf_counter() - t0
    out[name + "_peak_rss"] = r.peak
    return res

  params = ctx["state"].params
  timed("prefill", lambda: generate(params, p.tokens_BP, p.len_B, key, cfg, one))
  # the step compiled it; its features' path (continuous batching, speculative decoding) when on
  gen = timed("generate", lambda: grpo_step.sample(ctx, params, p, key)[0], warm=False)
  out["decode_s"] = out["generate_s"] - out["prefill_s"]
  out["decode_steps"] = int(np.asarray(gen["lengths_B"]).max())
  out["completion_len_mean"] = float(np.asarray(gen["mask_BN"]).sum(1).mean())
  if p.tokens_BP.shape[0] != DECODE_BATCH:  # the decode target is set at batch 64: measure it there too
    reps = -(-DECODE_BATCH // p.tokens_BP.shape[0])
    tok64, len64 = (np.tile(x, (reps,) + (1,) * (x.ndim - 1))[:DECODE_BATCH] for x in (p.tokens_BP, p.len_B))
    timed("prefill_b64", lambda: generate(params, tok64, len64, key, cfg, one))
    g64 = timed("generate_b64", lambda: generate(params, tok64, len64, key, cfg, scfg))
    out["decode_b64_s"] = out["generate_b64_s"] - out["prefill_b64_s"]
    out["decode_b64_steps"] = int(np.asarray(g64["lengths_B"]).max())
    del g64
  mask_BN = gen["mask_BN"]
  timed("reference", lambda: ctx["score"](ctx["ref_params"], gen["sequence_BT"], gen["positions_BT"],
                                          gen["segment_ids_BT"], mask_BN))
  B = mask_BN.shape[0]
  adv_BN = jnp.asarray(np.random.default_rng(t).standard_normal((B, 1)), jnp.float32) * mask_BN
  batch, _ = grpo_step.learner_batch(ctx, gen, adv_BN)  # packed when the features say so
  state = ctx.pop("state")  # donated below
  with RssPeak() as r:  # the step compiled it already
    t0 = time.perf_counter()
    ctx["state"] = common.block(ctx["train_step"](state, batch, key, ctx["ref_params"]))[0]
    out["ref_train_s"] = time.perf_counter() - t0
  out["ref_train_peak_rss"] = r.peak
  out["train_s"] = out["ref_train_s"] - out["reference_s"]
  out["rss_now"] = rss_bytes()
  return out


def roofline(ctx: dict, ph: dict, step_s: float, peak_flops: float, bandwidth: float) -> dict:
  """Per phase: model FLOPs and the bytes it must move, achieved rates, its bound (max of compute and
  memory time) and the fraction of that bound reached; the whole step's lower bound (the sum) and the
  fraction of it the measured median step reaches.

  FLOP model: `bench.common` (N = matmul parameters, lm-head included). Decode: `decode_steps` steps at
  the full batch (the loop runs until the longest row stops), context P + n at step n; each step reads
  every parameter and the KV cache filled so far. Train: 6·N·tokens + attention over B × (P + N)
  (the recompute of remat is extra work, not part of the bound).
  """
  cfg, run = ctx["cfg"], ctx["run"]
  B = run["prompts_per_step"] * run["group_size"]
  P, N = ctx["P"], run["max_new_tokens"]
  T = P + N
  pbytes = common.param_bytes(cfg, 4)
  dec = decode_roofline(cfg, B, P, ph["decode_steps"], ph["decode_s"], peak_flops, bandwidth)
  rows = {
      "prefill": (common.prefill_flops(cfg, B, P), pbytes + common.kv_cache_bytes(cfg, B, P, 4), ph["prefill_s"]),
      "reference": (common.forward_flops(cfg, B * T, T), pbytes + 4 * B * N * cfg.vocab_size, ph["reference_s"]),
      "train": (common.train_flops(cfg, B, T), 8 * pbytes, ph["train_s"]),  # params, grads, m, v: read + write
  }
  out = {}
  for name, (flops, nbytes, secs) in rows.items():
    bound = max(flops / peak_flops, nbytes / bandwidth)
    out[name] = _rates(flops, nbytes, secs, bound, "compute" if flops / peak_flops >= nbytes / bandwidth else "memory",
                       peak_flops, bandwidth)
  out = {"prefill": out["prefill"], "decode": dec, "reference": out["reference"], "train": out["train"]}
  total_bound = sum(x["bound_s"] for x in out.values())
  if "decode_b64_s" in ph:
    out["decode_b64"] = decode_roofline(cfg, DECODE_BATCH, P, ph["decode_b64_steps"], ph["decode_b64_s"], peak_flops,
                                        bandwidth)
  out["step"] = {"lower_bound_s": total_bound, "measured_s": step_s, "of_lower_bound": total_bound / step_s}
  return out


def _rates(flops, nbytes, secs, bound, kind, peak_flops, bandwidth) -> dict:
  return {"flops": flops, "bytes": nbytes, "seconds": secs, "flops_per_s": flops / secs, "bytes_per_s": nbytes / secs,
          "of_peak_flops": flops / secs / peak_flops, "of_bandwidth": nbytes / secs / bandwidth, "bound_s": bound,
          "bound_kind": kind, "of_bound": bound / secs}


def decode_roofline(cfg: ModelConfig, B: int, P: int, lengths_max: int, secs: float, peak_flops: float,
                    bandwidth: float) -> dict:
  """Decode after the prefill: `lengths_max − 1` steps at batch B (the first new token comes out of
  the prefill call), context P + n at step n; each step reads every parameter and the KV cache so far.
  The bound sums max(compute, memory) per step; its kind is the larger of the two totals."""
  pbytes = common.param_bytes(cfg, 4)
  S = max(lengths_max - 1, 1)
  flops = nbytes = bound = 0.0
  for n in range(1, S + 1):
    f = common.forward_flops(cfg, B, P + n, causal=False)
    b = pbytes + common.kv_cache_bytes(cfg, B, P + n, 4)
    flops, nbytes, bound = flops + f, nbytes + b, bound + max(f / peak_flops, b / bandwidth)
  kind = "compute" if flops / peak_flops >= nbytes / bandwidth else "memory"
  return {**_rates(flops, nbytes, secs, bound, kind, peak_flops, bandwidth), "batch": B, "steps": S}


def memory(ctx: dict, ph: dict) -> dict:
  """Peak RSS of each phase against `memory_budget` (ratio > 1: more than the shapes need), also less
  the runtime's RSS before the model was loaded (Python, JAX, XLA: no model array)."""
  run = ctx["run"]
  B = run["prompts_per_step"] * run["group_size"]
  budget = memory_budget(ctx["cfg"], B, ctx["P"], run["max_new_tokens"], ctx["cfg"].remat)
  pairs = {"prefill": "prefill", "decode": "generate", "reference": "reference", "train": "ref_train"}
  base = ctx.get("rss_base", 0)
  out = {name: {"peak_rss": ph[f"{key}_peak_rss"], "budget": budget[name],
                "over_budget": ph[f"{key}_peak_rss"] / budget[name],
                "over_budget_less_runtime": (ph[f"{key}_peak_rss"] - base) / budget[name]}
         for name, key in pairs.items()}
  out["budget_parts"] = budget
  out["runtime_rss"] = base
  return out


def summary_env() -> dict:
  """What else ran on the machine: `uptime`'s load averages now."""
  return {"loadavg": list(os.getloadavg())}
