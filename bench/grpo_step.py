"""Our full colocated GRPO step, timed piece by piece: generate → reward → advantages → reference
log-probs (KL β) and train step, as `loop.run` runs them (one program: `learner.fuse_reference`).
The same workload as `bench/peers/tunix_grpo.py`.

Host overhead = step wall time − the blocked jitted parts (generate, reference scoring + train step);
it covers decoding text, rewards, advantages and building the batch (and packing it).

Speed features (`bench/features.py`, a dict in `ctx["features"]`): continuous batching (`slots`: the batch
decodes through `sampling.continuous.generate_slots`, request r drawing with `fold_in(key, r)` as
`rollout.generation` does), the packed learner (`pack_width`: the batch carries a `packing.Packing`, as
`loop.pack_batch` builds it), speculative decoding (`spec_gamma`: in the sampler config, `sampling.generate`
dispatches) and remat (the model config's). Same prompts in the same order whatever the features.
`measure_many` runs several contexts (feature variants) block by block, taking turns with each other.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench import common, features as features_lib, workloads
from jaxrl_llm import learner, packing
from jaxrl_llm.keys import fold_in
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.rollout import collect
from jaxrl_llm.rollout.generation import request_keys
from jaxrl_llm.sampling import SamplerConfig, continuous, generate
from jaxrl_llm.tasks import get_task
from jaxrl_llm.tasks import tokenizer as tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER


def with_features(cfg: ModelConfig, sampler_cfg: SamplerConfig, features: dict | None
                  ) -> tuple[ModelConfig, SamplerConfig, dict]:
  """(model config, sampler config, complete features): remat into the model config, speculative decoding
  into the sampler config (the drafter depth resolved); slots and packing act in `step`."""
  f = features_lib.complete(features)
  if f["remat"]:
    cfg = dataclasses.replace(cfg, remat=f["remat"])
  if f["spec_gamma"]:
    f["spec_draft_layers"] = features_lib.draft_layers(f, cfg.n_layers)
    sampler_cfg = dataclasses.replace(sampler_cfg, spec_gamma=f["spec_gamma"], spec_draft_layers=f["spec_draft_layers"])
  return cfg, sampler_cfg, f


def build(model: dict, run: dict = workloads.GRPO_RUN, features: dict | None = None) -> dict:
  """Everything one GRPO step needs: configs, jitted functions, train state, frozen reference params."""
  task = get_task("arithmetic", num_digits=run["num_digits"])
  P = task.max_prompt_len + 1  # BOS + "ab+cd="
  N = run["max_new_tokens"]
  cfg = ModelConfig(**model, qk_norm=True, max_seq_len=P + N)
  params = init_params(cfg, jax.random.key(run["seed"]))
  sampler_cfg = SamplerConfig(max_new_tokens=N, stop_ids=tok.CHAR_TOKENIZER.stop_ids, pad_id=tok.pad_id,
                              temperature=run["temperature"])
  cfg, sampler_cfg, feats = with_features(cfg, sampler_cfg, features)
  tx = learner.make_optimizer(run["lr"], grad_clip=1.0)
  return {
      "task": task, "P": P, "cfg": cfg, "run": run, "features": feats,
      "sampler_cfg": sampler_cfg,
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


def sample(ctx: dict, params, p: collect.Prompts, key) -> tuple[dict, dict]:
  """(sampler output, feature stats): the static batch (`sampling.generate`, speculative when the sampler config
  says so) or, with `slots`, continuous batching; stats: the share of decode slot-steps wasted on finished or
  free slots (continuous: the engine's counters; static: rows that stopped before the batch's longest) and the
  speculative acceptance rate."""
  f = ctx.get("features") or features_lib.DEFAULTS
  if f["slots"]:
    out = continuous.generate_slots(params, p.tokens_BP, p.len_B, request_keys(key, len(p.len_B)), ctx["cfg"],
                                    ctx["sampler_cfg"], slots=f["slots"], chunk=f["slot_chunk"])
    stats = {"slot_wasted": 1 - out["live_steps"] / max(out["slot_steps"], 1)}
    if "spec_accept_rate" in out:  # the engine's draft-and-verify step
      stats["spec_accept_rate"] = float(out["spec_accept_rate"])
    return out, stats
  out = common.block(generate(params, p.tokens_BP, p.len_B, key, ctx["cfg"], ctx["sampler_cfg"]))
  lengths = np.asarray(out["lengths_B"])
  stats = {"slot_wasted": 1 - float((lengths - 1).clip(0).sum()) / max(len(lengths) * (int(lengths.max()) - 1), 1)}
  if "spec_accept_rate" in out:
    stats["spec_accept_rate"] = float(out["spec_accept_rate"])
  return out, stats


def learner_batch(ctx: dict, out: dict, adv_BN) -> tuple[learner.Batch, float]:
  """(the learner's batch of sampler output `out`, its fraction of padding token slots): packed into rows of
  `pack_width` ("auto": the padded width) when that feature is on, as `loop.pack_batch` does."""
  mask_BN = out["mask_BN"]
  B = mask_BN.shape[0]
  batch = learner.Batch(
      sequence_BT=out["sequence_BT"], positions_BT=out["positions_BT"], segment_ids_BT=out["segment_ids_BT"],
      mask_BN=mask_BN, adv_BN=adv_BN, behavior_logp_BN=out["behavior_logp_BN"],
      versions_BN=np.zeros(mask_BN.shape, np.int32), lag_B=np.zeros((B,), np.int32),  # host zeros: no dispatch
      # One iteration per batch, sampler = learner dtype: the sampler's log-probs are π_old (as Tunix).
      prox_logp_BN=out["behavior_logp_BN"])  # ref_logp_BN: scored inside the step
  width = (ctx.get("features") or features_lib.DEFAULTS)["pack_width"]
  seg_BT = np.asarray(out["segment_ids_BT"])
  if not width:
    return batch, packing.pad_frac(seg_BT)
  width = seg_BT.shape[1] if width == "auto" else width
  pk = packing.pack(np.asarray(out["sequence_BT"]), np.asarray(out["positions_BT"]), seg_BT, width)
  return batch.replace(pack=jax.tree.map(jnp.asarray, pk)), packing.pad_frac(pk.segment_ids_RW)


def rewards(ctx: dict, examples: list[dict], tokens_BN: np.ndarray) -> np.ndarray:
  """The task's rewards of completions decoded with the context's tokenizer (the real model's on workload R: the
  peers score the same text; decoding its ids as characters scored every completion 0)."""
  tokenizer = ctx.get("encoder", CHAR_ENCODER).tokenizer
  return collect.score_completions(ctx["task"], examples, tokens_BN, tokenizer=tokenizer)[0]


def step(ctx: dict, t: int) -> dict:
  """Runs GRPO step `t` in place on `ctx["state"]`; returns the wall seconds of each piece."""
  run, G = ctx["run"], ctx["run"]["group_size"]
  t0 = time.perf_counter()
  examples = [ctx["task"].make_example(ctx["rng"]) for _ in range(run["prompts_per_step"])]
  p = collect.encode_prompts([ex for ex in examples for _ in range(G)], ctx["P"], ctx.get("encoder", CHAR_ENCODER))
  key = fold_in(ctx["key"], t)

  t_gen = time.perf_counter()
  out, stats = sample(ctx, ctx["state"].params, p, key)
  gen_s = time.perf_counter() - t_gen
  reward_B = rewards(ctx, p.examples, np.asarray(out["tokens_BN"]))
  mask_BN = out["mask_BN"]
  adv_BN = collect.group_advantages(reward_B, G, "grpo", True, mask_BN)
  batch, pad_frac = learner_batch(ctx, out, adv_BN)
  B = mask_BN.shape[0]

  t_train = time.perf_counter()
  ctx["state"], metrics = ctx["train_step"](ctx["state"], batch, key, ctx["ref_params"])
  common.block(metrics)
  train_s = time.perf_counter() - t_train
  total = time.perf_counter() - t0
  return {"total_s": total, "generate_s": gen_s, "ref_train_s": train_s, "host_s": total - gen_s - train_s,
          "reward_mean": float(reward_B.mean()), "learner_pad_frac": pad_frac, **stats,
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
  return measure_many({"ours": ctx}, warmup, steps, rounds, between)["ours"]


def measure_many(ctxs: dict[str, dict], warmup: int = 2, steps: int = 5, rounds: int = 1,
                 between: Callable[[], None] | None = None) -> dict[str, dict]:
  """`measure` of several contexts (feature variants of one workload) taking turns: every context warms up,
  then each round runs one block of `steps` per context (the order rotating by one each round, so no context
  always runs right after the peer) and `between()` once. {name: summary}; each summary also holds the load
  average (1 min) at the end of each of its blocks."""
  names = list(ctxs)
  t0, first_s = time.perf_counter(), {}
  for name in names:
    ctx = ctxs[name]
    done = ctx.setdefault("steps_done", 0)
    for t in range(warmup):
      step(ctx, done + t)
    ctx["steps_done"] = done + warmup
    first_s[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
  if between is not None:
    between()
  rows = {n: [] for n in names}
  compiles = {n: 0 for n in names}
  load = {n: [] for n in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      ctx = ctxs[name]
      with common.count_compiles() as n_compiles:
        rows[name] += [step(ctx, ctx["steps_done"] + t) for t in range(steps)]
      compiles[name] += n_compiles[0]
      ctx["steps_done"] += steps
      load[name].append(os.getloadavg()[0])
    if between is not None:
      between()
  return {n: _summary(ctxs[n], rows[n], rounds, warmup, first_s[n], compiles[n], load[n]) for n in names}


def _summary(ctx: dict, rows: list[dict], rounds: int, warmup: int, first_s: float, compiles: int,
             load: list[float]) -> dict:
  med = {k: statistics.median(r[k] for r in rows) for k in ("total_s", "generate_s", "ref_train_s", "host_s")}
  med["best_total_s"] = min(r["total_s"] for r in rows)
  med["completion_len_mean"] = statistics.mean(r["completion_len_mean"] for r in rows)
  med["reward_mean"] = statistics.mean(r.get("reward_mean", 0.0) for r in rows)
  med["prompt_len_mean"] = statistics.mean(r.get("prompt_len_mean", 0.0) for r in rows)
  for k in ("learner_pad_frac", "slot_wasted", "spec_accept_rate"):  # feature stats, means over the timed steps
    if all(k in r for r in rows):
      med[k] = statistics.mean(r[k] for r in rows)
  med["step_s_each"] = [r["total_s"] for r in rows]
  return {**med, "rollouts_per_step": rows[0]["rollouts"], "steps": len(rows), "rounds": rounds, "warmup": warmup,
          "warmup_s": first_s, "compiles_after_warmup": compiles, "loadavg_blocks": load,
          "features": dict(ctx.get("features") or features_lib.DEFAULTS),
          "train_step_cache_size": ctx["train_step"]._cache_size(), "generate_cache_size": generate._cache_size()}
