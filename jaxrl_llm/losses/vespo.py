"""VESPO: a closed-form gamma-shaped kernel on the unnormalised sequence importance weight."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry


@dataclasses.dataclass(frozen=True)
class Hparams:
  # Kernel shapes (k, λ) for Â >= 0 and Â < 0. These are the released run scripts' values
  # (FloyedShen/VESPO recipe/vespo/run/sync/vespo_N_8.sh); the code's docstring says (2, 1.5, 4, 2.5).
  k_pos: float = 2.0
  lam_pos: float = 3.0
  k_neg: float = 3.0
  lam_neg: float = 2.0
  token_bound: float = 20.0  # per-token log-ratio clamp
  seq_bound: float = 20.0  # clamp of the sequence log-weight log W
  # Fold the train/infer term into log W as the code's optional rollout-IS weights do: per token
  # log min(π_old/μ, tis_cap), i.e. verl's truncated token-level weights (threshold 2 in the released
  # scripts). tis_cap=None adds the raw log(π_old/μ).
  tis: bool = False
  tis_cap: Optional[float] = 2.0


def vespo_log_weight(inputs, hp: Hparams):
  """Detached sequence log-weight log W_i = clip(Σ_t m·clip(log π_θ/π_old) [+ Σ_t m·log min(ρ_t, C)], ±seq_bound),
  ρ_t = π_old/μ (log clamped to ±token_bound), C = tis_cap."""
  mask = inputs.mask_BN
  log_w = core.seq_sum(core.safe_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, mask, hp.token_bound), mask)
  if hp.tis:
    log_rho = core.safe_log_ratio(inputs.prox_logp_BN, inputs.behavior_logp_BN, mask, hp.token_bound)
    if hp.tis_cap is not None:
      if hp.tis_cap <= 0:
        raise ValueError(f"loss.hparams.tis_cap={hp.tis_cap!r}: must be positive or None")
      log_rho = jnp.minimum(log_rho, math.log(hp.tis_cap))
    log_w = log_w + core.seq_sum(log_rho, mask)
  return core.sg(jnp.clip(log_w, -hp.seq_bound, hp.seq_bound))


def vespo_kernel(log_w_B, k_B, lam_B):
  """φ(W) = exp(λ + k·log W − λ·W) = W^k·e^{λ(1−W)}, so φ(1) = 1; non-finite values map to 0."""
  phi = jnp.exp(lam_B + k_B * log_w_B - lam_B * jnp.exp(log_w_B))
  return jnp.where(jnp.isfinite(phi), phi, 0.0)


def vespo(inputs, hp: Hparams):
  """VESPO: ℓ_{i,t} = −sg(φ(W_i))·Â_{i,t}·log π_θ(y_t), W_i = Π_t π_θ/π_old (no length normalisation).

  φ is the variational-proposal kernel exp(λ + k log W − λ W) with (k, λ) = (k₊, λ₊) if the sequence
  advantage Â_i ≥ 0 else (k₋, λ₋); it is maximal at W = k/λ and vanishes for W → 0 and W → ∞, so
  extreme sequences are softly dropped. Everything is in log space; log W is clamped to ±20.
  Paper: "VESPO" (arXiv 2602.10693); code FloyedShen/VESPO (compute_policy_loss_vespo).
  With `tis`, log W also gets Σ_t log min(π_old/μ, tis_cap) (the code's truncated rollout-IS weights).
  Deviation from the code: the sign of Â_i uses the masked mean of Â over the response, not
  `advantages[:, 0]` (robust to left padding). The coefficient multiplies the per-token Â as the code does.
  Metric `log_w_at_bound`: fraction of sequences whose |log W| hit the clamp (φ ≈ 0: silently dropped).
  On-policy (π_θ = π_old, no TIS): log W = 0, φ = 1 exactly, gradient = vanilla PG gradient.
  """
  mask = inputs.mask_BN
  log_w_B = vespo_log_weight(inputs, hp)
  pos_B = core.seq_advantage(inputs.adv_BN, mask) >= 0
  k_B = jnp.where(pos_B, hp.k_pos, hp.k_neg)
  lam_B = jnp.where(pos_B, hp.lam_pos, hp.lam_neg)
  phi_B = vespo_kernel(log_w_B, k_B, lam_B)
  loss = core.reinforce(core.broadcast_seq(phi_B, inputs.adv_BN) * inputs.adv_BN, inputs.logp_BN, mask)
  has_B = core.seq_len(mask) > 0
  aux = {
      "phi_mean": core.seq_metric(phi_B, has_B),
      "log_w_at_bound": core.seq_metric(jnp.abs(log_w_B) >= hp.seq_bound, has_B),
      "log_w_abs_max": (jnp.max(jnp.where(has_B, jnp.abs(log_w_B), 0.0)), jnp.ones(())),
  }
  return core.apply_mask(loss, mask), aux


registry.register("vespo", vespo, Hparams, needs=("prox_logp", "behavior_logp"))
