"""Learner step throughput: tokens/s and MFU of `learner.make_train_step` on synthetic batches."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from bench import common
from jaxrl_llm import hugepages, learner
from jaxrl_llm.models import ModelConfig, init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_batch(cfg: ModelConfig, B: int, T: int, P: int, params, key) -> learner.Batch:
  """B full-length rows of T random tokens; the last T − P are the completion (behaviour = current policy)."""
  N = T - P
  k_tok, k_adv = jax.random.split(key)
  seq_BT = jax.random.randint(k_tok, (B, T), 4, cfg.vocab_size, jnp.int32)
  pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  seg_BT = jnp.ones((B, T), jnp.int32)
  mask_BN = jnp.ones((B, N), jnp.float32)
  logp_BN = learner.make_score_fn(cfg, 1.0)(params, seq_BT, pos_BT, seg_BT, mask_BN)
  adv_B = jnp.where(jax.random.bernoulli(k_adv, 0.5, (B,)), 1.0, -1.0)
  return learner.Batch(sequence_BT=seq_BT, positions_BT=pos_BT, segment_ids_BT=seg_BT, mask_BN=mask_BN,
                       adv_BN=adv_B[:, None] * mask_BN, behavior_logp_BN=logp_BN,
                       versions_BN=jnp.zeros((B, N), jnp.int32), lag_B=jnp.zeros((B,), jnp.int32),
                       prox_logp_BN=logp_BN)


def measure(spec: dict, peak_flops: float, warmup: int = 1, repeats: int = 3) -> dict:
  """tokens/s (B·T per step), MFU (6·N·tokens + attention, over the B·(T−1) positions) and HFU (the
  FLOPs the step executes: the last layer skips the prompt positions' outputs, see
  `common.skipped_train_flops`)."""
  B, T, P = spec["batch"], spec["seq_len"], spec["prompt_len"]
  cfg = ModelConfig(**spec["model"], max_seq_len=T)
  params = init_params(cfg, jax.random.key(0))
  tx = learner.make_optimizer(1e-4, grad_clip=1.0)
  holder = {"state": learner.init_state(params, tx)}
  step = learner.make_train_step(cfg, tx, "ppo_clip", temperature=1.0, agg_mode="token-mean")
  batch = synthetic_batch(cfg, B, T, P, params, jax.random.key(1))
  key = jax.random.key(2)

  def one():
    holder["state"], metrics = step(holder["state"], batch, key)
    return metrics

  for _ in range(warmup):
    common.block(one())
  cache_after_warmup = step._cache_size()
  with common.count_compiles() as n_compiles:
    t = common.time_calls(one, warmup=0, repeats=repeats)
  flops = common.train_flops(cfg, B, T - 1)  # the model scores positions 0..T-2
  executed = flops - common.skipped_train_flops(cfg, B, P - 1)  # prompt positions are not scored
  return {"batch": B, "seq_len": T, "matmul_params": common.matmul_params(cfg), "step_s": t["median_s"],
          "best_step_s": t["best_s"], "tokens_per_s": B * T / t["median_s"], "flops_per_step": flops,
          "achieved_flops_per_s": flops / t["median_s"], "mfu": flops / t["median_s"] / peak_flops,
          "executed_flops_per_step": executed, "hfu": executed / t["median_s"] / peak_flops,
          "page_faults_per_step": t["page_faults"], "huge_pages": hugepages.active(),
          "compiles_after_warmup": n_compiles[0] + step._cache_size() - cache_after_warmup}


def measure_in_subprocess(name: str, peak_flops: float, huge_pages: bool, repeats: int = 3,
                          timeout_s: float = 600) -> dict:
  """`measure(workloads.LEARNER[name])` in a fresh process started with or without the glibc huge-page
  tunable (it only takes effect at process start): the same-run comparison of `jaxrl_llm.hugepages`."""
  import json
  import subprocess
  import sys
  env = dict(os.environ)
  tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb")]
  if huge_pages:
    tunables.append(hugepages.TUNABLE)
  if tunables:
    env["GLIBC_TUNABLES"] = ":".join(tunables)
  env[hugepages.OPT_IN] = "0"  # the child keeps exactly the tunables set here
  code = (f"import json; from bench import learner_mfu, workloads; "
          f"print(json.dumps(learner_mfu.measure(workloads.LEARNER[{name!r}], {peak_flops!r}, repeats={repeats})))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout_s)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if not lines:
    raise RuntimeError(f"learner {name} subprocess failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
  return json.loads(lines[-1])
