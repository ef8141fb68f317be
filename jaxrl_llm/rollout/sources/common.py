"""What several batch sources share: the pinned-version sampler call and reward settings (π_old: `rollout.old_logp`).

Nothing here knows a run mode; the sources (one file each) decide which version generates which step.
`run` is the loop's static wiring (`loop.Run`); a source reads only `c`, `task`, `train_examples`, `P`,
`encoder`, `k_sample`, `sampler_model_cfg`, `samp_cfg`, `score` and `mesh` (None: one device; else
generation is split over its batch axes, over every process: `jaxrl_llm.multiprocess`) from it.
"""

from __future__ import annotations

import time

import ml_collections
import numpy as np

from jaxrl_llm import multiprocess
from jaxrl_llm.keys import fold_in
from jaxrl_llm.rollout import collect
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.sampling import generate


def reward_policy(c: ml_collections.ConfigDict):
  """The run's reward settings (`reward.*`; defaults when a config has no `reward` section)."""
  from jaxrl_llm.tasks.reward import RewardPolicy
  r = c.get("reward")
  if r is None:
    return RewardPolicy()
  return RewardPolicy(timeout_s=float(r.timeout_s), max_abs=float(r.max_abs), executor=r.executor, workers=r.workers)


def replay_on(c: ml_collections.ConfigDict) -> bool:
  """Whether experience replay is on (`rollout.replay.capacity` > 0); cheap enough to ask every step."""
  r = c.rollout.get("replay")
  return r is not None and bool(r.capacity)


def replay_config(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict | None:
  """`rollout.replay` with `fresh_per_step` resolved (0 -> prompts_per_step), or None when replay is off."""
  if not replay_on(c):
    return None
  r = c.rollout.replay.copy_and_resolve_references()
  r.fresh_per_step = r.fresh_per_step or c.rollout.prompts_per_step
  return r


def sync_rollout(run, store: ParamStore, steps: list[int], version: int, v_b: int, n: int | None = None,
                 call: int = 0) -> list[dict]:
  """Generates the batches of learner steps `steps` in one sampler call, with the pinned snapshot v_b.

  sync / fixed_lag pass one step; staged passes a whole stage (μ-GRPO generates the stage at once).
  The prompts of step t depend only on (seed, t), so a stage regenerated after a resume is identical.
  Replay passes `n` prompts per step (default rollout.prompts_per_step) and the index `call` of the
  step's sampler call; prompts and sampler key then depend on (seed, t, call); call 0 is the default draw.
  """
  c = run.c
  G, n = c.rollout.group_size, n or c.rollout.prompts_per_step
  snap = store.acquire(v_b)
  try:
    ps = [collect.prompts_for_step(run.train_examples, t, n, c.seed, run.P, call, run.encoder) for t in steps]
    p = collect.Prompts(np.repeat(np.concatenate([q.tokens_BP for q in ps]), G, 0),
                        np.repeat(np.concatenate([q.len_B for q in ps]), G),
                        [ex for q in ps for ex in q.examples for _ in range(G)])
    key = fold_in(fold_in(run.k_sample, v_b), steps[0])
    key = fold_in(key, call) if call else key
    t0 = time.perf_counter()
    out, owners = multiprocess.generate_on_mesh(generate, snap.params, p.tokens_BP, p.len_B, key,  # numpy: no eager put
                                                run.sampler_model_cfg, run.samp_cfg, run.mesh)
    time_gen = time.perf_counter() - t0
  finally:
    store.release(snap)
  reward_B, status = multiprocess.score_rows(  # several processes: each scores the rows its devices generated
      lambda ex, t: collect.score_completions(run.task, ex, t, reward_policy(c), tokenizer=run.encoder.tokenizer)[:2],
      p.examples, out["tokens_BN"], owners)
  B = n * G
  keys = ("sequence_BT", "positions_BT", "segment_ids_BT", "mask_BN", "behavior_logp_BN")
  if "routes_BTLk" in out and c.model.routing_replay:  # R3: the learner replays the sampler's expert ids
    keys += ("routes_BTLk",)
  return [{**{k_: out[k_][i * B:(i + 1) * B] for k_ in keys}, "reward_B": reward_B[i * B:(i + 1) * B],
           "versions_BN": np.full((B, out["mask_BN"].shape[1]), v_b, np.int32),
           "lag_B": np.full((B,), version - v_b, np.int32),  # staged: recomputed when consumed
           "reward_errors": (status["error"] + status["timeout"]) if i == 0 else 0,
           "time_generate_s": time_gen if i == 0 else 0.0} for i in range(len(steps))]
