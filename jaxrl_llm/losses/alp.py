"""ALP (Adaptive Layerwise Perturbation): one clipped ratio π_{θ,δ}/μ from a perturbed training forward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = jax.lax.stop_gradient

MODES = ("token", "sequence", "cum_token")


@dataclasses.dataclass(frozen=True)
class Hparams:
  mode: str = "sequence"  # token | sequence | cum_token (code default: sequence).
  geometric: bool = False  # sequence/cum_token: mean instead of sum of log-ratios (code is_geometric=False).
  clip_low: float = 0.5  # ratio clipped to [1 - clip_low, 1 + clip_high] = [0.5, 4.0].
  clip_high: float = 3.0
  dual_clip: float = 3.0  # multi-turn recipe; the single-turn recipe uses 10.0.
  perturb_std: float = 0.02  # initial σ_ℓ (single-turn script default); the learner owns log σ as trainable params.
  perturb_lr: float = 5e-4  # σ's own AdamW learning rate (code: a separate param group).

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"loss.hparams.mode={self.mode!r}: must be one of {MODES}")
    if not self.dual_clip > 1.0:
      raise ValueError(f"loss.hparams.dual_clip={self.dual_clip}: must be > 1")


def log_ratio(logp_BN, behavior_logp_BN, mask_BN, mode: str, geometric: bool):
  """ALP log-ratio per token, with the GSPO-token trick for sequence / prefix statistics.

  token:     log ρ_t = log π_t - log μ_t.
  sequence:  log ρ_t = sg(L) + log π_t - sg(log π_t), L = Σ_t m·(log π - log μ) (or the mean).
  cum_token: as sequence with L_t the prefix sum (or prefix mean) over counted tokens up to t.
  The value is the statistic; the gradient w.r.t. log π_t is ρ_t (one token's share). Clamped to ±20
  after assembly (per-token log-ratios are also sanitised and clamped first, core.safe_log_ratio).
  """
  lr = core.safe_log_ratio(logp_BN, sg(behavior_logp_BN), mask_BN)
  if mode == "token":
    return lr
  m = core.fmask(mask_BN)
  if mode == "sequence":
    stat = core.broadcast_seq(core.seq_mean(lr, mask_BN) if geometric else core.seq_sum(lr, mask_BN), lr)
  else:
    stat = jnp.cumsum(m * lr, axis=-1)
    if geometric:
      stat = stat / jnp.maximum(jnp.cumsum(m, axis=-1), 1.0)
  logp = core.safe_logp(logp_BN, mask_BN)
  out = sg(stat) + logp - sg(logp)
  return jnp.where(mask_BN > 0, jnp.clip(out, -core.LOG_RATIO_BOUND, core.LOG_RATIO_BOUND), 0.0)


def alp(inputs, hp: Hparams):
  """ALP: ℓ_t = dual-clipped PPO surrogate of ρ = π_{θ,δ}/μ with clip [1-0.5, 1+3.0] and c = 3.

  `logp_BN` must come from the *perturbed* training forward (model hook `perturb=(log_sigma_L, key)`:
  h_ℓ ← h_ℓ + σ_ℓ·ξ on every decoder layer's input, learnable σ_ℓ = exp(s_ℓ)); μ is the unperturbed
  sampler. One unified ratio replaces the separate staleness and mismatch ratios ("bypass": no π_old).
  Modes (see `log_ratio`): token, sequence (default: the *sum* of log-ratios, i.e. the full product
  ratio, unless geometric=True) and cum_token (prefix sums). No extra rollout IS weights.
  Surrogate: max(-Â·ρ, -Â·clip(ρ, 1-clip_low, 1+clip_high)), then min(·, -Â·c) for Â < 0.
  Aggregation in the reference code: token-mean.
  Paper: arXiv 2603.19470; code amazon-science/adaptive-layerwise-perturbation
  (compute_policy_loss_perturbed). Difference: the code does not clamp per-token log-ratios before the
  sequence sum; we do (±20, as everywhere), which only matters for already-degenerate tokens.
  On-policy without perturbation (π_θ = μ): ρ = 1 in every mode, gradient = vanilla PG -Â·∇log π.
  """
  mask = inputs.mask_BN
  lr = log_ratio(inputs.logp_BN, inputs.behavior_logp_BN, mask, hp.mode, hp.geometric)
  surr, clipped = core.clipped_surrogate(jnp.exp(lr), inputs.adv_BN, hp.clip_low, hp.clip_high, hp.dual_clip)
  aux = {"clip_frac": core.metric(clipped, mask), **core.ratio_diagnostics(lr, mask, "ratio")}
  return core.apply_mask(surr, mask), aux


registry.register("alp", alp, Hparams, needs=("behavior_logp", "perturb"))
