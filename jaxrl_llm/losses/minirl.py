"""MiniRL (Qwen, "Stabilizing RL with LLMs"): untruncated π_θ/μ with a one-sided PPO-style token mask."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class Hparams:
  eps_low: float = 0.2  # as used by DPPO's reimplementation "following zheng2025stabilizing".
  eps_high: float = 0.27


def minirl(inputs, hp: Hparams):
  """MiniRL: ℓ_t = -M_t·sg(ρ_t)·r_t·Â_t, ρ = π_old/μ, r = π_θ/π_old, so ∇ℓ_t = -M_t·(π_θ/μ)·Â_t·∇log π_θ.

  M_t = 0 iff (Â > 0 and sg(r) > 1+ε_high) or (Â < 0 and sg(r) < 1-ε_low): the PPO clip expressed as
  a mask, computed on the *recomputed* ratio r (strict inequalities: a ratio exactly on the boundary
  keeps its gradient). No truncation of ρ (C = ∞).
  The token-level surrogate Σ_t (π_θ/μ)·Â is the paper's first-order approximation of the sequence
  objective, valid while both the train/infer gap and staleness stay small.
  Paper: Zheng et al. 2025, arXiv 2512.01374 (as characterised in the DPPO paper's appendix; no official
  code). The paper argues against length normalisation: aggregate with seq-mean-token-sum or a constant
  normaliser (seq-mean-token-sum-norm); the exact normaliser was not verified.
  Caveat (DPPO): anchored on the recomputed π_old this fails to control the mismatch in their sanity test.
  On-policy (π_θ = π_old = μ): ρ = r = 1, M = 1, gradient = vanilla PG -Â·∇log π.
  """
  mask = inputs.mask_BN
  adv = inputs.adv_BN
  log_rho = core.safe_log_ratio(sg(inputs.prox_logp_BN), sg(inputs.behavior_logp_BN), mask)
  lr = core.safe_log_ratio(inputs.logp_BN, sg(inputs.prox_logp_BN), mask)
  r = jnp.exp(lr)
  r_sg = sg(r)
  drop = ((adv > 0) & (r_sg > 1.0 + hp.eps_high)) | ((adv < 0) & (r_sg < 1.0 - hp.eps_low))
  keep = core.fmask(mask) * ~drop
  loss = -keep * jnp.exp(log_rho) * r * adv
  aux = {"keep_BN": keep, "masked_frac": core.metric(1.0 - keep, mask),
         **core.ratio_diagnostics(log_rho, mask, "mismatch_ratio"), **core.ratio_diagnostics(lr, mask, "ratio")}
  return core.apply_mask(loss, mask), aux


registry.register("minirl", minirl, Hparams, needs=("prox_logp", "behavior_logp"))
