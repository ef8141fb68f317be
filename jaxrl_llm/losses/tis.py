"""Truncated importance sampling (TIS) for the training–inference mismatch."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = jax.lax.stop_gradient

LEVELS = ("token", "sequence")
MODES = ("decoupled", "bypass")


@dataclasses.dataclass(frozen=True)
class Hparams:
  level: str = "token"  # "token": w_t per token; "sequence": one w_i = min(Π_t ρ_t, C) per response.
  mode: str = "decoupled"  # "decoupled": ρ = π_old/μ on PPO-clip; "bypass": ρ = π_θ/μ on REINFORCE.
  cap: float = 2.0  # C (verl rollout_is_threshold=2.0; typical token 1.5-5, sequence 2-10).
  batch_normalize: bool = False  # rescale the truncated weights to mean 1 over the batch.
  eps_low: float = 0.2  # PPO clip of the decoupled base loss.
  eps_high: float = 0.2
  dual_clip: Optional[float] = None

  def __post_init__(self):
    if self.level not in LEVELS:
      raise ValueError(f"loss.hparams.level={self.level!r}: must be one of {LEVELS}")
    if self.mode not in MODES:
      raise ValueError(f"loss.hparams.mode={self.mode!r}: must be one of {MODES}")
    if not self.cap > 0:
      raise ValueError(f"loss.hparams.cap={self.cap}: must be > 0")


def truncated_weight(log_rho_BN, mask_BN, level: str, cap: float, batch_normalize: bool):
  """Detached TIS weight min(ρ, C) per token, or per sequence broadcast over its tokens; 0 off the mask.

  Sequence level works in log space: log Π_t ρ_t = Σ_t log ρ_t is clamped to ±20 before `exp`.
  Batch normalisation (after truncation) divides by the mean weight: over counted tokens at token
  level, over non-empty sequences at sequence level (each response counts once).
  Returns (w_BN, truncated_BN).
  """
  log_rho_BN = sg(log_rho_BN)
  if level == "token":
    log_w = log_rho_BN
  else:
    log_w_B = jnp.clip(core.seq_sum(log_rho_BN, mask_BN), -core.LOG_RATIO_BOUND, core.LOG_RATIO_BOUND)
    log_w = core.broadcast_seq(log_w_B, log_rho_BN)
  raw = jnp.exp(log_w)
  w = core.truncate(raw, cap)
  if batch_normalize:
    if level == "token":
      mean = core.seq_sum(w, mask_BN).sum() / jnp.maximum(core.seq_len(mask_BN).sum(), 1.0)
    else:
      has_B = core.seq_len(mask_BN) > 0
      mean = jnp.where(has_B, w[:, 0], 0.0).sum() / jnp.maximum(has_B.sum(), 1)
    w = w / jnp.maximum(mean, 1e-8)
  return core.apply_mask(w, mask_BN), raw > cap


def tis(inputs, hp: Hparams):
  """Truncated IS: ℓ_t = w·ℓ_base, w = sg(min(ρ, C)), token- or sequence-level.

  decoupled (3-policy, default): ρ = π_old/μ (train engine at the behaviour version over the sampler);
    ℓ_t = w·max(-Â·r, -Â·clip(r, 1-ε_low, 1+ε_high)), r = π_θ/π_old; the weight multiplies the PPO
    loss *after* clipping (TIS blog; verl rollout_corr_helper).
  bypass (π_old := μ): ρ = π_θ/μ detached; ℓ_t = -sg(w)·Â·log π_θ (verl compute_policy_loss_reinforce:
    the REINFORCE form, so the loss value is meaningless, only its gradient -w·Â·∇log π_θ is).
  Sequence level: w_i = min(exp(Σ_t log ρ_t), C). Products of long responses collapse towards 0 or C
  (the length trap); sequence caps are usually larger (2-10).
  Paper: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training" (TIS blog).
  Needs: both `prox_logp` and `behavior_logp` are declared because needs are static per name; bypass
  mode never reads `prox_logp_BN`.
  On-policy (π_θ = π_old = μ): ρ = 1 ≤ C, w = 1, and the gradient is the vanilla PG gradient -Â·∇log π.
  """
  mask = inputs.mask_BN
  if hp.mode == "decoupled":
    log_rho = core.safe_log_ratio(sg(inputs.prox_logp_BN), sg(inputs.behavior_logp_BN), mask)
  else:
    log_rho = core.safe_log_ratio(sg(inputs.logp_BN), sg(inputs.behavior_logp_BN), mask)
  w, truncated = truncated_weight(log_rho, mask, hp.level, hp.cap, hp.batch_normalize)
  aux = {"is_weight": core.metric(w, mask), "is_truncated_frac": core.metric(truncated, mask),
         **core.ratio_diagnostics(log_rho, mask, "mismatch_ratio")}
  if hp.mode == "decoupled":
    lr = core.safe_log_ratio(inputs.logp_BN, sg(inputs.prox_logp_BN), mask)
    surr, clipped = core.clipped_surrogate(jnp.exp(lr), inputs.adv_BN, hp.eps_low, hp.eps_high, hp.dual_clip)
    loss = w * surr
    aux["clip_frac"] = core.metric(clipped, mask)
  else:
    loss = core.reinforce(w * inputs.adv_BN, inputs.logp_BN, mask)
  return core.apply_mask(loss, mask), aux


registry.register("tis", tis, Hparams, needs=("prox_logp", "behavior_logp"))
