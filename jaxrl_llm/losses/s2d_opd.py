"""S²D-OPD: Direct-OPD on the student's top-K support, supervised only on the top-ρ JSD states."""

from __future__ import annotations

import dataclasses
import fractions

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry
from jaxrl_llm.losses.opd_topk_kl import topk_valid


@dataclasses.dataclass(frozen=True)
class Hparams:
  rho: float = 0.1  # fraction of each response's valid states kept (paper default; 5–20% similar).
  alpha0: float = 2.5  # initial KL-anchor coefficient (Direct-OPD adaptive α).
  alpha_eps: float = 0.01
  alpha_min: float = 0.5
  alpha_max: float = 2.5
  adaptive_alpha: bool = True  # False keeps α = alpha0 (the carried state is returned unchanged).


def jsd_k_plus_1(la_BNk, lb_BNk, ok_BNk):
  """JSD(a, b) (β = ½) on K+1 classes: the valid slots plus one residual class 1 − Σ (clamped ≥ 0).

  No renormalisation, so by data processing it is ≤ the JSD of the full distributions.
  """
  pa = jnp.where(ok_BNk, jnp.exp(la_BNk), 0.0)
  pb = jnp.where(ok_BNk, jnp.exp(lb_BNk), 0.0)
  pa = jnp.concatenate([pa, jnp.maximum(1.0 - pa.sum(-1), 0.0)[..., None]], -1)
  pb = jnp.concatenate([pb, jnp.maximum(1.0 - pb.sum(-1), 0.0)[..., None]], -1)
  m = 0.5 * (pa + pb)

  def kl_to_m(x):
    pos = x > 0
    return jnp.where(pos, x * (jnp.log(jnp.where(pos, x, 1.0)) - jnp.log(jnp.where(pos, m, 1.0))), 0.0).sum(-1)

  return 0.5 * kl_to_m(pa) + 0.5 * kl_to_m(pb)


def top_rho_mask(score_BN, mask_BN, rho: float):
  """Per row, keep the k = max(1, ⌈ρ·n⌉) valid positions with the largest score (stable: earlier wins ties)."""
  valid = mask_BN > 0
  n = valid.sum(-1).astype(jnp.int32)
  # ⌈ρ·n⌉ in exact integer arithmetic (float32 0.1·10 rounds up to 2 otherwise).
  frac = fractions.Fraction(rho).limit_denominator(1000)
  k = jnp.where(n > 0, jnp.maximum(1, (n * frac.numerator + frac.denominator - 1) // frac.denominator), 0)
  order = jnp.argsort(jnp.where(valid, -score_BN, jnp.inf), axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1, stable=True)
  return valid & (rank < k[:, None])


def update_alpha(alpha, mean_reward, hp: Hparams):
  """α ← clip(α·(1 + ε·sgn(r̄)), α_min, α_max) (Direct-OPD's adaptive anchor coefficient)."""
  return jnp.clip(alpha * (1.0 + hp.alpha_eps * jnp.sign(mean_reward)), hp.alpha_min, hp.alpha_max)


def s2d_opd(inputs, hp: Hparams):
  """S²D-OPD (arXiv 2609.29142): Direct-OPD with selective supervision.

  Direct-OPD reward on candidate v: Δ_t(v) = log π_T(v|s_t) − log π_ref(v|s_t), T = post-RL small
  model (`teacher_topk_logp_BNk`), ref = its pre-RL checkpoint (`teacher_ref_topk_logp_BNk`), both at
  the candidate ids `teacher_topk_ids_BNk`, which for S²D are the *student's* top-K V_K(s_t) (K=16).
  Per state: ℓ_t = −Σ_{v∈V_K} sg[p̄(v)·Δ_t(v)]·log q_θ(v) + α·k3(π_θ, π_stu)_t, with
  p̄ = q_θ/Σ_{V_K} q_θ (current student, `student_topk_logp_BNk`, differentiable) and the KL anchor the
  per-token k3 ("low_var_kl") of the sampled token toward the initial student π_stu (`ref_logp_BN`).
  Selection: d̃_t = JSD(π̃_T, π̃_ref) on K+1 classes (candidates + residual, no renormalisation);
  per response keep the k = max(1, ⌈ρ·|valid|⌉) states with the largest d̃_t (stable ties). The mask
  applies to both terms and is returned as aux["keep_BN"]: the paper averages over retained states, i.e.
  `reduce(..., drop_rejected=True)`. ρ = 1 is Direct-OPD.
  State: α. This step uses the carried α; aux["state"] is α·(1 + ε·sgn(r̄)) clipped to [α_min, α_max],
  r̄ = mean over all valid states (not only retained ones) of Σ_v p̄(v)Δ_t(v).
  On-policy: no importance ratio; the sampled-token k3 anchor has gradient α(1 − π_stu/π_θ)∇log π_θ,
  zero when the student still equals π_stu.
  """
  mask = inputs.mask_BN
  lT, lR, lq = inputs.teacher_topk_logp_BNk, inputs.teacher_ref_topk_logp_BNk, inputs.student_topk_logp_BNk
  ok = topk_valid(inputs.teacher_topk_ids_BNk, lT, lR, lq) & (mask[..., None] > 0)
  z = lambda x: jnp.where(ok, x.astype(jnp.float32), 0.0)
  lT, lR, lq = z(lT), z(lR), z(lq)
  delta = jnp.where(ok, jnp.clip(lT - lR, -core.LOG_RATIO_BOUND, core.LOG_RATIO_BOUND), 0.0)
  # p̄: student probabilities renormalised over the valid candidates, no gradient.
  pbar = jax.nn.softmax(jnp.where(ok, core.sg(lq), -1e30), axis=-1)
  pbar = jnp.where(ok, pbar, 0.0)
  coef = core.sg(pbar * delta)
  reward_BN = coef.sum(-1)
  pg_BN = -(coef * lq).sum(-1)
  kl_BN = core.kl_estimate(inputs.logp_BN, inputs.ref_logp_BN, mask, "k3")
  alpha = jnp.asarray(inputs.state, jnp.float32)
  score = jsd_k_plus_1(lT, lR, ok)
  keep = top_rho_mask(score, mask, hp.rho)
  loss = jnp.where(keep, pg_BN + alpha * kl_BN, 0.0)
  mean_r = core.seq_sum(reward_BN, mask).sum() / jnp.maximum(core.fmask(mask).sum(), 1.0)
  new_alpha = update_alpha(alpha, mean_r, hp) if hp.adaptive_alpha else alpha
  aux = {
      "keep_BN": keep.astype(jnp.float32),
      "state": core.sg(new_alpha),
      "direct_reward": core.metric(reward_BN, mask),
      "direct_reward_kept": core.metric(reward_BN, keep),
      "kl_anchor": core.metric(kl_BN, keep),
      "jsd_k1": core.metric(score, mask),
      "keep_frac": core.metric(keep, mask),
      "alpha": (alpha, jnp.ones((), jnp.float32)),
  }
  return loss, aux


registry.register("s2d_opd", s2d_opd, Hparams, needs=("teacher_topk", "teacher_ref_topk", "student_topk", "ref_logp", "state"),
                  init_state=lambda hp: jnp.asarray(hp.alpha0, jnp.float32))
