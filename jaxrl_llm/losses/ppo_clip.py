"""PPO clipped surrogate, with clip-higher (asymmetric ε) and dual-clip options."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry


@dataclasses.dataclass(frozen=True)
class Hparams:
  eps_low: float = 0.2  # PPO paper.
  eps_high: float = 0.2  # DAPO clip-higher uses 0.28.
  dual_clip: Optional[float] = None  # c > 1 caps the loss of A<0 tokens (verl uses 3.0 when enabled).


def ppo_clip(inputs, hp: Hparams):
  """PPO-clip: ℓ_t = max(-Â·r, -Â·clip(r, 1-ε_low, 1+ε_high)), r = π_θ/π_old.

  Dual clip (for Â < 0): ℓ_t ← min(ℓ_t, -Â·c). GRPO is this loss with group advantages and
  seq-mean-token-mean aggregation; DAPO is this loss with ε_high = 0.28 and token-mean.
  Paper: Schulman et al. 2017 (PPO); Ye et al. 2020 (dual clip); Yu et al. 2025 (DAPO clip-higher).
  Anchor: `prox_logp` (recomputed π_old, or μ itself when the run's old-logp strategy is "behavior").
  On-policy (π_θ = π_old): r = 1, no clipping, gradient = vanilla PG gradient -Â·∇log π.
  """
  lr = core.safe_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, inputs.mask_BN)
  ratio = jnp.exp(lr)
  loss, clipped = core.clipped_surrogate(ratio, inputs.adv_BN, hp.eps_low, hp.eps_high, hp.dual_clip)
  aux = {"clip_frac": core.metric(clipped, inputs.mask_BN), **core.ratio_diagnostics(lr, inputs.mask_BN, "ratio")}
  return core.apply_mask(loss, inputs.mask_BN), aux


registry.register("ppo_clip", ppo_clip, Hparams, needs=("prox_logp",))
