"""From a batch source's record to the learner's: advantages, DAPO's filter, π_old and the teachers' outputs.

The learner trains on the same `Rollout` record the source returned, with these fields added and the
host-only ones (rewards, group and request ids, stats) left on the host (`Rollout.learner_view`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from jaxrl_llm import advantages, losses
from jaxrl_llm import config as config_lib
from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout import collect, evict, old_logp
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.wiring import source_class


def prox_is_current(c: ml_collections.ConfigDict) -> bool:
  """Whether π_old is, by construction, the learner's current parameters (`old_logp.is_current`)."""
  on_policy = source_class(c).on_policy
  return old_logp.is_current(c.rollout.old_logp, on_policy, "perturb" in losses.get(c.loss.name).needs)


def prox_logp(run, store: ParamStore, state, extra, ro: Rollout, seq, routes=None) -> jax.Array | None:
  """The learner-side π_old of the sampled tokens by the run's `rollout.old_logp` strategy (`jaxrl_llm.rollout.old_logp`);
  None when π_old is the current parameters (`prox_is_current`) or the loss reads none
  (`config.old_logp_strategy`): the learner uses sg(log π_θ)."""
  if prox_is_current(run.c) or config_lib.old_logp_strategy(run.c) == "none":
    return None  # the learner takes sg(log π_θ) from its own forward: no separate scoring pass
  ctx = old_logp.OldLogpContext(run.score, store, state.params, state.version, extra["ewma"])
  return old_logp.compute(run.c.rollout.old_logp, ctx, ro, seq, routes)


def _every_sample_failed(ro: Rollout) -> bool:
  """Whether no row of `ro` has a usable outcome: every reward call failed (raised or timed out: `reward_errors`),
  or, with episodes, every environment failed (`env_errors`, `env_timeouts`) or never started (`env_too_long`).
  An episode ended by an invalid action is the policy's doing, a sample like any other (`reward_errors` counts it
  too, so episodes are judged by the environment's own counters)."""
  B = len(ro.reward_B)
  if ro.stat("env_errors", None) is None:
    failed = int(ro.stat("reward_errors") or 0)
  else:
    failed = sum(int(ro.stat(k) or 0) for k in ("env_errors", "env_timeouts", "env_too_long"))
  return B > 0 and failed >= B


def _distills(c: ml_collections.ConfigDict) -> bool:
  """Whether the loss learns from a teacher's log-probs (not from rewards): failed rewards leave its samples usable."""
  return any(n.startswith("teacher") for n in losses.get(c.loss.name).needs)


def make_batch(run, store: ParamStore, state, extra, ro: Rollout) -> tuple[Rollout, dict]:
  """(the learner's record of rollout `ro`, host metrics): `run` is the loop's `wiring.Run`."""
  c = run.c
  seq = old_logp.rollout_seq(ro)
  mask = jnp.asarray(ro.mask_BN)
  adv_B = collect.group_advantages(ro.reward_B, c.rollout.group_size, c.advantage.name, c.advantage.std_normalize)
  if config_lib.read(c, "advantage.turn_level") and ro.turn_reward_BK is not None:  # credit by return-to-go
    adv_B = jnp.asarray(collect.turn_advantages(ro.reward_B, ro.turn_reward_BK, ro.turn_BN, adv_B,
                                                c.rollout.group_size, c.advantage.name, c.advantage.std_normalize))
  if ro.adv_weight_B is not None:  # replay: over-stale groups down-weighted, after group normalisation
    adv_B = adv_B * jnp.asarray(ro.adv_weight_B).reshape((-1,) + (1,) * (adv_B.ndim - 1))
  info = {}
  if _every_sample_failed(ro) and not _distills(c):  # rewards of failures only: nothing to learn from (the
    mask = jnp.zeros_like(mask)                        # learner skips an update with no token, `updates_skipped_empty`)
  if c.rollout.dynamic_sampling:  # DAPO: groups whose rewards are all equal leave the loss and its denominator
    B = mask.shape[0]
    keep_B = advantages.dapo_keep_mask(jnp.asarray(ro.reward_B), jnp.arange(B) // c.rollout.group_size,
                                       B // c.rollout.group_size)
    mask = mask * keep_B[:, None]
    info["dapo_filtered_frac"] = float(1.0 - keep_B.mean())
  teacher = run.batch_extras(ro, seq, mask) if run.batch_extras is not None else None
  if ro.extra and "eviction_mask_BN" in ro.extra:  # episodes with eviction: SDCC's teacher is the current policy
    with_teacher = "teacher_logits" in losses.get(c.loss.name).needs
    teacher = {**(teacher or {}), **evict.sdcc_extras(state.params, ro.extra, run.model_cfg, c.sampler.temperature,
                                                      with_teacher)}
  # Distillation options (`jaxrl_llm.distill.extras`) may also give, under "_batch", the loss mask to train on
  # (ADWIN's prefix), the advantages (Open-MOPD's routed teacher reward) and host metrics for the row.
  over = teacher.pop("_batch", {}) if teacher else {}
  mask = over.get("mask_BN", mask)
  info.update(over.get("info", {}))
  routes = None if ro.routes_BTLk is None else jnp.asarray(ro.routes_BTLk)
  prox = jnp.asarray(ro.prox_logp_BN) if ro.prox_logp_BN is not None else prox_logp(run, store, state, extra, ro, seq,
                                                                                    routes)
  batch = ro.learner_view().replace(
      sequence_BT=seq[0], positions_BT=seq[1], segment_ids_BT=seq[2], mask_BN=mask,
      adv_BN=over.get("adv_BN", adv_B if adv_B.ndim == 2 else adv_B[:, None]) * mask,
      behavior_logp_BN=jnp.asarray(ro.behavior_logp_BN), versions_BN=jnp.asarray(ro.versions_BN),
      lag_B=jnp.asarray(ro.lag_B), prox_logp_BN=prox, routes_BTLk=routes,  # ref_logp_BN: scored in the step
      extra=teacher)
  return batch, info  # the mismatch |π_old − μ| is measured inside the train step
