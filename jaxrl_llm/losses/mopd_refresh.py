"""Open-MOPD M4: the student reward rebuilt from the current student at every inner update (arXiv 2608.19098)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry
from jaxrl_llm.losses.opd_topk_kl import topk_valid

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Hparams:
  pass  # M4 has no hyper-parameter of its own; M1/M2's row weights come from `distill.mopd` (the advantage path)


def refresh_reward(student_topk_logp_BNk: Array, teacher_topk_logp_BNk: Array, mask_BN: Array) -> Array:
  """M4: r_t(v) = sg[(log p_d(v) − log q(v))·p̄_q(v)] on the cached top-k ids, from the current student `log q`.

  p̄_q is the student's probability renormalised over the k ids. Invalid slots (non-finite) and masked
  positions give 0. Called with each inner update's fresh `log q` (IS cannot fix a stale reward, only a stale
  sampler).
  """
  lq, lp = jax.lax.stop_gradient(student_topk_logp_BNk), teacher_topk_logp_BNk
  ok = jnp.isfinite(lq) & jnp.isfinite(lp) & (mask_BN[..., None] > 0)
  lq0, lp0 = jnp.where(ok, lq, 0.0), jnp.where(ok, lp, 0.0)
  pbar = jnp.where(ok, jax.nn.softmax(jnp.where(ok, lq0, -1e30), axis=-1), 0.0)
  return jnp.where(ok, (lp0 - lq0) * pbar, 0.0)


def mopd_refresh(inputs, hp: Hparams):
  """Open-MOPD's M4 student-reward refresh as a loss: ℓ_t = −Σ_{v ∈ I_t} r_t(v)·log q_θ(v), with
  r_t(v) = sg[(log p_d(v) − log q_θ(v))·p̄_θ(v)] (`refresh_reward`) over the routed teacher's top-k ids I_t.

  The learner computes `log q_θ` at I_t in every inner update (each minibatch and epoch), so the reward is rebuilt
  from the current student there, not frozen at rollout time (the paper's point: importance sampling corrects a
  stale sampler, not a stale reward). The gradient, −Σ_v p̄_θ(v)(log p_d(v) − log q_θ(v))∇log q_θ(v), is the
  reverse-KL direction from the student, renormalised over I_t, toward the teacher. Reads `student_topk_logp_BNk`
  (differentiable) and `teacher_topk_*`; not `logp_BN`. On-policy or stale alike: the reward never ages.
  [GUESS]: the surrogate's form (the abstract gives r_t(v) only); M1/M2 row weights are not applied here.
  """
  mask = inputs.mask_BN
  ok = topk_valid(inputs.teacher_topk_ids_BNk, inputs.teacher_topk_logp_BNk, inputs.student_topk_logp_BNk)
  ok = ok & (mask[..., None] > 0)
  lq = jnp.where(ok, inputs.student_topk_logp_BNk.astype(jnp.float32), 0.0)
  lp = jnp.where(ok, inputs.teacher_topk_logp_BNk.astype(jnp.float32), -jnp.inf)
  r = refresh_reward(jnp.where(ok, lq, -jnp.inf), lp, mask)
  loss = core.apply_mask(-(r * lq).sum(-1), mask)
  return loss, {"mopd_refresh_reward": core.metric(r.sum(-1), mask)}


registry.register("mopd_refresh", mopd_refresh, Hparams, needs=("teacher_topk", "student_topk"))
