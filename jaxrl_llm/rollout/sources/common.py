"""What several batch sources share: the pinned-version sampler call of whole learner steps.

Nothing here knows a run mode; the sources (one file each) decide which version generates which step.
A source is built from a `settings.SourceContext` (typed settings, the generation home `ctx.gen`, the
learner's scorer) and the run's ParamStore; π_old strategies live in `jaxrl_llm.rollout.old_logp`.
"""

from __future__ import annotations

import time

import numpy as np

from jaxrl_llm.record import Rollout, rows
from jaxrl_llm.rollout import cascade, episodes
from jaxrl_llm.rollout.generation import SAMPLER_STATS, SPEC_STATS  # noqa: F401 (SPEC_STATS re-exported)
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.rollout.settings import SourceContext


def sync_rollout(ctx: SourceContext, store: ParamStore, steps: list[int], version: int, v_b: int, n: int | None = None,
                 call: int = 0) -> list[Rollout]:
  """Generates the batches of learner steps `steps` in one sampler call, with the pinned snapshot v_b.

  sync / fixed_lag pass one step; staged passes a whole stage (μ-GRPO generates the stage at once).
  The prompts of step t depend only on (seed, t), so a stage regenerated after a resume is identical.
  Replay passes `n` prompts per step (default rollout.prompts_per_step) and the index `call` of the
  step's sampler call; prompts and sampler key then depend on (seed, t, call); call 0 is the default draw.
  The first record's stats hold the call's reward errors and sampler time (the others 0).
  """
  s, gen = ctx.settings, ctx.gen
  G, n = s.group_size, n or s.prompts_per_step
  if s.env is not None:
    return _episode_rollout(ctx, store, steps, version, v_b, n, call)
  if s.echo is not None:
    return _echo_rollout(ctx, store, steps, version, v_b, n, call)
  p = gen.step_prompts(steps, n, G, call)
  pats = {}
  if ctx.scaffold is not None:  # Pats: evidence cards in front of some rows' prompts (`jaxrl_llm.rollout.scaffold`)
    p, carded_B, pats = ctx.scaffold.apply(gen.encoder, p, G)
  snap = store.acquire(v_b)
  try:
    t0 = time.perf_counter()
    # several processes with slot engines: each runs its own replica (the store's view of the snapshot)
    params = snap.params if snap.worker_params is None else snap.worker_params
    out, owners = gen.sample(params, p, gen.step_key(v_b, steps[0], call))
    time_gen = time.perf_counter() - t0
  finally:
    store.release(snap)
  spec = {k: float(out[k]) for k in SAMPLER_STATS if k in out}  # speculative decoding's, slot counters: when on
  whole = gen.finish(out, p.examples, np.full(out["mask_BN"].shape, v_b, np.int32), owners, **spec)
  batches = _per_step(whole, len(steps), n * G, G, version - v_b, time_gen, *spec)
  if ctx.scaffold is not None:  # the cards learn from each step's groups in order; each batch gets its own stats
    B, tokens_BN = n * G, np.asarray(out["tokens_BN"])
    for i, ro in enumerate(batches):
      lo, hi = i * B, (i + 1) * B
      mine = ctx.scaffold.update(p.examples[lo:hi], tokens_BN[lo:hi], whole.reward_B[lo:hi], carded_B[lo:hi], G,
                                 gen.encoder.tokenizer)
      batches[i] = ro.replace(stats={**ro.stats, **mine, **(pats if i == 0 else {})})
  return batches


def _per_step(whole: Rollout, n_steps: int, B: int, G: int, lag: int, time_gen: float, *counters: str
              ) -> list[Rollout]:
  """One sampler call's record cut into the batches of its `n_steps` learner steps (B rows each), with lags
  (staged: recomputed when consumed) and group ids; the first batch's stats hold the call's reward errors,
  sampler time and `counters` (the others 0)."""
  first = {"reward_errors": whole.stat("reward_errors"), "time_generate_s": time_gen,
           **{k: whole.stats[k] for k in counters}}
  return [rows(whole, i * B, (i + 1) * B).replace(
              lag_B=np.full((B,), lag, np.int32), group_B=np.arange(B, dtype=np.int32) // G,
              stats=first if i == 0 else {k: 0.0 if k == "time_generate_s" else 0 for k in first})
          for i in range(n_steps)]


def _echo_rollout(ctx: SourceContext, store: ParamStore, steps: list[int], version: int, v_b: int, n: int,
                  call: int) -> list[Rollout]:
  """`sync_rollout` with ECHO's cascaded rollout (`rollout.echo`, `jaxrl_llm.rollout.cascade`): per step n/2 tasks,
  each a critic group of G diagnoses and a policy group of G refinements; each batch's stats its own echo metrics,
  the first also the three sampler calls' counters (`cascade.cascade`)."""
  s, G = ctx.settings, ctx.settings.group_size
  snap = store.acquire(v_b)
  try:
    params = snap.params if snap.worker_params is None else snap.worker_params
    whole, per_step, time_gen = cascade.echo_rollout(ctx.gen, params, steps, n, G, v_b, call, s.echo)
  finally:
    store.release(snap)
  out = _per_step(whole, len(steps), n * G, G, version - v_b, time_gen, *(k for k in SAMPLER_STATS if k in whole.stats))
  return [ro.replace(stats={**ro.stats, **mine}) for ro, mine in zip(out, per_step)]


def _episode_rollout(ctx: SourceContext, store: ParamStore, steps: list[int], version: int, v_b: int, n: int,
                     call: int) -> list[Rollout]:
  """`sync_rollout` with an environment (`settings.env`): n seeds × G multi-turn episodes per step, all steps
  played together with the pinned snapshot v_b (`rollout.episodes`); seeds depend on (seed, step, call) only.
  Each record's stats hold its own rows' episode counters (`episodes.row_counters`) and reward errors; the first
  also the call's sampler counters and time."""
  s, gen = ctx.settings, ctx.gen
  G = s.group_size
  seeds = [x for t in steps for x in episodes.episode_seeds(s.seed, t, n, call)]
  snap = store.acquire(v_b)
  try:
    t0 = time.perf_counter()
    whole = episodes.run_episodes(gen, snap.params, seeds, G, s.env, gen.step_key(v_b, steps[0], call), v_b,
                                  width=s.env.prompt_width)
    time_gen = time.perf_counter() - t0
  finally:
    store.release(snap)
  B, st = n * G, whole.stats
  info_keys = tuple(sorted({k for info in st["episode_info"] for k in info}))  # reported by some row: 0 in the others
  per_row = episodes.row_counters(st["episode_statuses"], st["episode_turns"], whole.mask_BN, whole.env_mask_BN,
                                  whole.versions_BN, st["episode_info"], info_keys)
  # the call's own counters (prefills, slot steps, speculation's rates, evictions) stay on its first batch; each
  # batch's episode counters are its own rows' (staged plays a stage's steps in one call)
  call_level = [k for k in st if (k.startswith("env_") or k in SAMPLER_STATS) and k not in per_row]
  out = _per_step(whole, len(steps), B, G, version - v_b, time_gen, *call_level)
  for i, ro in enumerate(out):
    lo, hi = i * B, (i + 1) * B
    mine = episodes.row_counters(st["episode_statuses"][lo:hi], st["episode_turns"][lo:hi], whole.mask_BN[lo:hi],
                                 whole.env_mask_BN[lo:hi], whole.versions_BN[lo:hi], st["episode_info"][lo:hi],
                                 info_keys)
    out[i] = ro.replace(stats={**ro.stats, **mine})
  return out
