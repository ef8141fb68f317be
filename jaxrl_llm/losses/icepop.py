"""IcePop: a two-sided mask on the training–inference ratio, times PPO-clip."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class Hparams:
  alpha: float = 0.5  # lower edge of the kept band of k = π_old/μ (Ring-1T report).
  beta: float = 5.0  # upper edge.
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: Optional[float] = None

  def __post_init__(self):
    if not 0 < self.alpha <= self.beta:
      raise ValueError(f"loss.hparams.alpha/beta: need 0 < alpha <= beta, got {self.alpha}, {self.beta}")


def icepop(inputs, hp: Hparams):
  """IcePop: ℓ_t = M(k_t)·max(-Â·r, -Â·clip(r, 1-ε_low, 1+ε_high)), M(k) = k·1[α ≤ k ≤ β].

  k_t = π_old/μ = exp(logp_old - logp_behav), detached: the train engine at the *old* parameters over
  the sampler (not π_θ); r = π_θ/π_old. Inside the band the weight is k itself (an IS correction);
  outside it the token is discarded. Band edges are inclusive, compared in log space.
  Denominator: as in verl's IcePop the weights are zeroed but the mask is unchanged, so with the
  default `reduce(..., drop_rejected=False)` zeroed tokens stay in the denominator; aux["keep_BN"]
  still reports the band so `drop_rejected=True` works too.
  Equivalent to `mis` with criteria token_k1 [α, β], is_level="token", decoupled mode.
  Paper: Ling Team, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model" (Ring-1T), 2025.
  On-policy (π_θ = π_old = μ): k = 1 ∈ [α, β], M = 1, r = 1, gradient = vanilla PG -Â·∇log π.
  """
  mask = inputs.mask_BN
  log_k = core.safe_log_ratio(sg(inputs.prox_logp_BN), sg(inputs.behavior_logp_BN), mask)
  in_band = (log_k >= math.log(hp.alpha)) & (log_k <= math.log(hp.beta))
  keep = core.fmask(mask) * in_band
  m = keep * jnp.exp(log_k)
  lr = core.safe_log_ratio(inputs.logp_BN, sg(inputs.prox_logp_BN), mask)
  surr, clipped = core.clipped_surrogate(jnp.exp(lr), inputs.adv_BN, hp.eps_low, hp.eps_high, hp.dual_clip)
  aux = {"keep_BN": keep, "masked_frac": core.metric(1.0 - keep, mask), "clip_frac": core.metric(clipped, keep),
         **core.ratio_diagnostics(log_k, mask, "mismatch_ratio")}
  return core.apply_mask(m * surr, mask), aux


registry.register("icepop", icepop, Hparams, needs=("prox_logp", "behavior_logp"))
