"""PPO-EWMA (Hilton et al.): decoupled PPO whose proximal policy is an EWMA of past weights."""

from __future__ import annotations

import dataclasses

from jaxrl_llm.losses import decoupled_ppo, registry


@dataclasses.dataclass(frozen=True)
class Hparams(decoupled_ppo.Hparams):
  """Same hyper-parameters as decoupled_ppo. β_prox (the EWMA decay) is a run option of the rollout /
  learner side that maintains the EWMA parameter copy, not of this loss."""


def ppo_ewma(inputs, hp: Hparams):
  """PPO-EWMA: decoupled PPO with π_prox = π_{θ_EWMA}; ℓ_t = w·max(-Â·r, -Â·clip(r)), r = π_θ/π_EWMA, w = sg(π_EWMA/μ).

  θ_EWMA ← β_prox·θ_EWMA + (1-β_prox)·θ after every optimiser step; its log-probs of the sampled tokens
  arrive in `prox_logp_BN` (an extra forward pass of the EWMA copy): the loss needs `ewma_prox`, which only a
  run with `rollout.old_logp="ewma"` provides (`rollout.ewma_beta` = β_prox; configs/ppo_ewma_tiny.py), so it
  cannot silently run as decoupled PPO against a recomputed π_old. Centring the trust region on an
  average of recent policies makes PPO batch-size invariant. Filter and denominator as in decoupled_ppo.
  Paper: Hilton, Cobbe, Schulman 2021, "Batch size-invariance for policy optimization" (arXiv 2110.00641).
  The "revised PPO-EWMA" of Guan et al. (arXiv 2605.12070, "missing old logits") could not be pinned
  down (abstract only, no public code): this is Hilton's weight-EWMA version.
  On-policy (π_θ = π_EWMA = μ): w = r = 1, gradient = vanilla PG -Â·∇log π.
  """
  return decoupled_ppo.decoupled_ppo(inputs, hp)


registry.register("ppo_ewma", ppo_ewma, Hparams, needs=("prox_logp", "behavior_logp", "ewma_prox"))
