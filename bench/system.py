"""Loop and system costs: `loop.run` step time, checkpoint save/restore, sparse-sync payload size."""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from bench import grpo_step, workloads
from jaxrl_llm import learner
from jaxrl_llm.models import ModelConfig, init_params


def loop_run(steps: int = 6) -> dict:
  """`jaxrl_llm.loop.run` on configs/default.py set to the 2L-d128 GRPO workload, no SFT or eval.

  Same model shape, qk-norm, 8×4 rollouts, 16 new tokens and β as `bench/grpo_step.py`, but the task
  tokenizer's vocabulary (64). Reports the medians of the loop's own metrics over the steps after the
  first (which compiles); compile counts are those of this run (`generate` is shared process-wide).
  """
  import importlib.machinery
  from jaxrl_llm import loop
  from jaxrl_llm.sampling import generate
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.py")
  spec = importlib.util.spec_from_loader("bench_default_config", importlib.machinery.SourceFileLoader(
      "bench_default_config", path))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  r = workloads.GRPO_RUN
  c.num_steps = steps
  c.sft.steps = 0
  c.eval.every = 0
  c.log.progress = False
  c.log.tensorboard = False
  c.rollout.prompts_per_step, c.rollout.group_size = r["prompts_per_step"], r["group_size"]
  c.sampler.max_new_tokens = r["max_new_tokens"]
  c.loss.kl_coef = r["beta"]
  m = workloads.GRPO["2L-d128"]
  for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
    c.model[k] = m[k]
  c.model.qk_norm = True
  generate_before = generate._cache_size()
  with tempfile.TemporaryDirectory() as d:
    rows = loop.run(c, d)
    import json
    with open(os.path.join(d, "run_info.json")) as f:
      info = json.load(f)
  later = rows[1:]
  step_s = statistics.median(x["time_step_s"] for x in later)
  gen_s = statistics.median(x["time_generate_s"] for x in later)
  return {"steps_timed": len(later), "time_step_s": step_s, "time_generate_s": gen_s,
          "time_step_minus_generate_s": step_s - gen_s,
          **{k: v for k, v in info.items() if k.startswith("compiles_")},
          "compiles_generate": generate._cache_size() - generate_before}


def _tree_bytes(tree) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def checkpoint_io(model: dict) -> dict:
  """Save and restore seconds of a full train state (params + AdamW moments) via `jaxrl_llm.checkpoint`."""
  if importlib.util.find_spec("jaxrl_llm.checkpoint") is None:
    return {"status": "skipped: jaxrl_llm/checkpoint.py not present"}
  from jaxrl_llm import checkpoint
  cfg = ModelConfig(**model)
  state = learner.init_state(init_params(cfg, jax.random.key(0)), learner.make_optimizer(1e-4))
  tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
  jax.block_until_ready(tree)
  with tempfile.TemporaryDirectory() as d:
    ckpt = checkpoint.Checkpointer(os.path.join(d, "ckpt"), keep=2)
    t0 = time.perf_counter()
    ckpt.save(1, tree, {"note": "bench"}, force=True)
    ckpt.wait()
    save_s = time.perf_counter() - t0
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    t0 = time.perf_counter()
    restored, _ = ckpt.restore(1, abstract)
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t0
    ckpt.close()
  nbytes = _tree_bytes(tree)
  return {"status": "ok", "state_bytes": nbytes, "save_s": save_s, "restore_s": restore_s,
          "save_bytes_per_s": nbytes / save_s, "restore_bytes_per_s": nbytes / restore_s}


def sparse_sync(ctx: dict, sync_every: tuple[int, ...] = (1, 4)) -> dict:
  """bf16 sparse-sync payload / dense bf16 bytes after k more GRPO optimiser steps of `ctx`, for each k.

  `ctx` (from `grpo_step.build`) should be past its first step: at step 0 the policy equals the
  reference, the KL gradient is exactly zero and almost nothing changes, which would flatter the payload.
  """
  if importlib.util.find_spec("jaxrl_llm.rollout.sparse_sync") is None:
    return {"status": "skipped: jaxrl_llm/rollout/sparse_sync.py not present"}
  from jaxrl_llm.rollout import sparse_sync as ss
  t = ctx.get("steps_done", 0)
  out = {"status": "ok", "dtype": "bfloat16", "after_steps": t}
  for k in sync_every:
    union, low = ss.init_union(ctx["state"].params), ss.cast(ctx["state"].params, jnp.bfloat16)
    for _ in range(k):
      grpo_step.step(ctx, t)
      t += 1
      union, low = ss.track_step(union, low, ctx["state"].params, jnp.bfloat16)
    payload = ss.pack(low, union)
    out[f"every_{k}"] = {"density": ss.density(union), "payload_bytes": ss.payload_bytes(payload),
                         "payload_ratio": ss.payload_ratio(payload)}
  ctx["steps_done"] = t
  return out
