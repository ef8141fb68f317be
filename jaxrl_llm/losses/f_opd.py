"""f-OPD: freshness-weighted async OPD (rollout drift + supervision drift + lag). [2nd]/[GUESS]."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, opd_reverse_kl, registry


@dataclasses.dataclass(frozen=True)
class Hparams:
  # The paper's values are not public (spec A4 / addendum §8.1); these are the spec's starting guesses.
  alpha: float = 1.0  # weight of sqrt(rollout drift).
  beta: float = 1.0  # weight of sqrt(supervision drift).
  xi: float = 0.2  # freshness gate threshold.
  reg_coef: float = 0.1  # λ of the rollout-anchored regulariser [GUESS].
  # Adaptive buffer refresh (control c): flush the rollout buffer when the batch's mean freshness falls below this
  # [GUESS: the paper's threshold is not public]; 0 = never. A buffering source (async) then regenerates.
  refresh_below: float = 0.0
  # Base loss: sampled-token reverse KL in advantage form (see `opd_reverse_kl`).
  online_advantage: bool = False
  eps_low: float = 0.2
  eps_high: float = 0.2


def freshness(lag_B, roll_drift_B, sup_drift_B, alpha: float, beta: float):
  """f_i = exp(−α·sqrt(D_roll) − β·sqrt(D_sup)) / (τ_i + 1) ∈ (0, 1]; drifts clamped ≥ 0."""
  lag = jnp.maximum(lag_B.astype(jnp.float32), 0.0)
  penalty = alpha * jnp.sqrt(jnp.maximum(roll_drift_B, 0.0)) + beta * jnp.sqrt(jnp.maximum(sup_drift_B, 0.0))
  return jnp.exp(-penalty) / (lag + 1.0)


def freshness_gate(f_B, xi: float):
  """ReLU-like gate σ(f − ξ) = max(f − ξ, 0)/(1 − ξ) [GUESS: normalised so a fresh sample (f = 1) has weight 1]."""
  return jnp.maximum(f_B - xi, 0.0) / (1.0 - xi)


def should_refresh(f_B, valid_B, threshold: float):
  """Adaptive buffer refresh (control c): flush when the mean freshness of valid samples is below `threshold`."""
  v = (valid_B > 0).astype(jnp.float32)
  return (jnp.where(v > 0, f_B, 0.0).sum() / jnp.maximum(v.sum(), 1.0)) < threshold


def f_opd(inputs, hp: Hparams):
  """f-OPD (arXiv 2605.17862) [2nd: formulas from a secondary summary; reconstruction, check the paper].

  Per sequence i: rollout drift D_roll = mean over tokens of the k3 estimate of KL(μ ‖ π_θ) on the
  sampled tokens (they are drawn from μ; equal to KL(π_θ‖μ) to second order) [GUESS]; supervision
  drift D_sup = `sup_drift_B` (computed by the teacher-scoring stage; 0 for a frozen teacher whose
  context did not change); lag τ = `lag_B`. Freshness f = exp(−α√D_roll − β√D_sup)/(τ+1), weight
  w = max(f − ξ, 0)/(1 − ξ) (no gradient through w).
  ℓ_t = w_i·ℓ^base_t + λ·k3(μ ‖ π_θ)_t, with ℓ^base the sampled-token reverse-KL PPO surrogate of
  `opd_reverse_kl` (advantage form) and the second term the rollout-anchored regulariser (its gradient
  (π_θ/μ − 1)∇log π_θ pulls π_θ back toward the rollout policy). The buffer-flush control: with
  `refresh_below` > 0 the metric `refresh_buffer` is 1 when the batch's mean freshness is below it
  (`should_refresh`), and the loop then flushes a buffering source (async: `AsyncRollout.flush`; the row's
  `refresh_flushed` counts the groups thrown away). D_sup is 0 for every teacher here: each is frozen and scores
  the sample's own context when the batch is built, so its supervision cannot age (the term is there for a teacher
  that changes). Metrics: freshness, weight, drifts.
  On-policy (lag 0, μ = π_prox = π_θ, D_sup = 0): f = 1, w = 1, the regulariser's gradient is 0, and the
  loss equals `opd_reverse_kl` (gradient −(log p − log π_θ)∇log π_θ).
  """
  mask = inputs.mask_BN
  roll_BN = core.kl_estimate(core.sg(inputs.behavior_logp_BN), inputs.logp_BN, mask, "k3")
  d_roll = core.sg(core.seq_mean(roll_BN, mask))
  f = freshness(inputs.lag_B, d_roll, core.sg(inputs.sup_drift_B.astype(jnp.float32)), hp.alpha, hp.beta)
  w = core.sg(freshness_gate(f, hp.xi))
  base_hp = opd_reverse_kl.Hparams(online_advantage=hp.online_advantage, eps_low=hp.eps_low, eps_high=hp.eps_high)
  base_BN, aux = opd_reverse_kl.opd_reverse_kl(inputs, base_hp)
  loss = w[:, None] * base_BN + hp.reg_coef * roll_BN
  has = core.seq_len(mask) > 0
  aux.update(freshness=core.seq_metric(f, has), fresh_weight=core.seq_metric(w, has),
             roll_drift=core.seq_metric(d_roll, has), sup_drift=core.seq_metric(inputs.sup_drift_B, has))
  if hp.refresh_below > 0:  # 1 when the step asks the loop to flush its source's buffer (`loop`: refresh_flushed)
    aux["refresh_buffer"] = (should_refresh(f, has, hp.refresh_below).astype(jnp.float32), jnp.ones(()))
  return core.apply_mask(loss, mask), aux


registry.register("f_opd", f_opd, Hparams, needs=("teacher_logp", "prox_logp", "behavior_logp", "lag", "sup_drift"))
