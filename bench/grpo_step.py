"""Our full colocated GRPO step, timed piece by piece: generate → reward → advantages → reference
log-probs (KL β) and train step, as `loop.run` runs them (one program: `learner.fuse_reference`).
The same workload as `bench/peers/tunix_grpo.py`.

Host overhead = step wall time − the blocked jitted parts (generate, reference scoring + train step);
it covers decoding text, rewards, advantages and building the batch.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench import common, workloads
from jaxrl_llm import learner
from jaxrl_llm.keys import fold_in
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.rollout import collect
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.tasks import get_task
from jaxrl_llm.tasks import tokenizer as tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER


def build(model: dict, run: dict = workloads.GRPO_RUN) -> dict:
  """Everything one GRPO step needs: configs, jitted functions, train state, frozen reference params."""
  task = get_task("arithmetic", num_digits=run["num_digits"])
  P = task.max_prompt_len + 1  # BOS + "ab+cd="
  N = run["max_new_tokens"]
  cfg = ModelConfig(**model, qk_norm=True, max_seq_len=P + N)
  params = init_params(cfg, jax.random.key(run["seed"]))
  tx = learner.make_optimizer(run["lr"], grad_clip=1.0)
  return {
      "task": task, "P": P, "cfg": cfg, "run": run,
      "sampler_cfg": SamplerConfig(max_new_tokens=N, stop_ids=tok.CHAR_TOKENIZER.stop_ids, pad_id=tok.pad_id,
                                   temperature=run["temperature"]),
      "state": learner.init_state(params, tx),
      "ref_params": jax.tree.map(lambda x: jnp.array(x, copy=True), params),
      "train_step": learner.fuse_reference(
          learner.make_train_step(cfg, tx, "ppo_clip", {"eps_low": run["epsilon"], "eps_high": run["epsilon"]},
                                  temperature=run["temperature"], agg_mode="seq-mean-token-mean",
                                  kl_coef=run["beta"], kl_estimator="k3"),
          learner.make_score_fn(cfg, run["temperature"])),
      "rng": np.random.default_rng(run["seed"]),
      "key": jax.random.key(run["seed"] + 1),
  }


def step(ctx: dict, t: int) -> dict:
  """Runs GRPO step `t` in place on `ctx["state"]`; returns the wall seconds of each piece."""
  run, G = ctx["run"], ctx["run"]["group_size"]
  t0 = time.perf_counter()
  examples = [ctx["task"].make_example(ctx["rng"]) for _ in range(run["prompts_per_step"])]
  p = collect.encode_prompts([ex for ex in examples for _ in range(G)], ctx["P"], ctx.get("encoder", CHAR_ENCODER))
  key = fold_in(ctx["key"], t)

  t_gen = time.perf_counter()
  out = common.block(generate(ctx["state"].params, p.tokens_BP, p.len_B, key, ctx["cfg"], ctx["sampler_cfg"]))
  gen_s = time.perf_counter() - t_gen
  reward_B, _, _ = collect.score_completions(ctx["task"], p.examples, np.asarray(out["tokens_BN"]))
  mask_BN = out["mask_BN"]
  adv_BN = collect.group_advantages(reward_B, G, "grpo", True, mask_BN)
  seq = (out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"])
  B = mask_BN.shape[0]
  batch = learner.Batch(
      sequence_BT=seq[0], positions_BT=seq[1], segment_ids_BT=seq[2], mask_BN=mask_BN,
      adv_BN=adv_BN, behavior_logp_BN=out["behavior_logp_BN"],
      versions_BN=np.zeros(mask_BN.shape, np.int32), lag_B=np.zeros((B,), np.int32),  # host zeros: no dispatch
      # One iteration per batch, sampler = learner dtype: the sampler's log-probs are π_old (as Tunix).
      prox_logp_BN=out["behavior_logp_BN"])  # ref_logp_BN: scored inside the step

  t_train = time.perf_counter()
  ctx["state"], metrics = ctx["train_step"](ctx["state"], batch, key, ctx["ref_params"])
  common.block(metrics)
  train_s = time.perf_counter() - t_train
  total = time.perf_counter() - t0
  return {"total_s": total, "generate_s": gen_s, "ref_train_s": train_s, "host_s": total - gen_s - train_s,
          "reward_mean": float(reward_B.mean()),
          "rollouts": B, "completion_len_mean": float(np.asarray(mask_BN).sum(1).mean()),
          "decode_steps": int(np.asarray(out["lengths_B"]).max()), "prompt_len_mean": float(np.mean(p.len_B))}


def measure(ctx: dict, warmup: int = 2, steps: int = 5, rounds: int = 1,
            between: Callable[[], None] | None = None) -> dict:
  """Median seconds per GRPO step (and per piece) after `warmup` steps of `ctx` (from `build`).

  The timed steps run in `rounds` blocks of `steps`; `between()` (untimed) runs after the warm-up and
  after each block: the bench runs the peer's warm-up and blocks there, so both sides take turns on
  the same machine and see the same conditions.
  Also the compilations seen while timing (target 0) and the jitted functions' cache sizes.
  """
  t0 = time.perf_counter()
  done = ctx.setdefault("steps_done", 0)
  for t in range(warmup):
    step(ctx, done + t)
  done += warmup
  first_s = time.perf_counter() - t0
  if between is not None:
    between()
  rows, compiles = [], 0
  for _ in range(rounds):
    with common.count_compiles() as n_compiles:
      rows += [step(ctx, done + t) for t in range(steps)]
    compiles += n_compiles[0]
    done += steps
    if between is not None:
      between()
  ctx["steps_done"] = done
  med = {k: statistics.median(r[k] for r in rows) for k in ("total_s", "generate_s", "ref_train_s", "host_s")}
  med["best_total_s"] = min(r["total_s"] for r in rows)
  med["completion_len_mean"] = statistics.mean(r["completion_len_mean"] for r in rows)
  med["reward_mean"] = statistics.mean(r.get("reward_mean", 0.0) for r in rows)
  med["prompt_len_mean"] = statistics.mean(r.get("prompt_len_mean", 0.0) for r in rows)
  med["step_s_each"] = [r["total_s"] for r in rows]
  return {**med, "rollouts_per_step": rows[0]["rollouts"], "steps": len(rows), "rounds": rounds, "warmup": warmup,
          "warmup_s": first_s, "compiles_after_warmup": compiles,
          "train_step_cache_size": ctx["train_step"]._cache_size(), "generate_cache_size": generate._cache_size()}
