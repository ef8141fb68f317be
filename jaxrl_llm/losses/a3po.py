"""A-3PO: decoupled PPO with the proximal policy interpolated from μ and π_θ by parameter versions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, decoupled_ppo, registry

sg = jax.lax.stop_gradient

PROX_METHODS = ("loglinear", "linear")


@dataclasses.dataclass(frozen=True)
class Hparams(decoupled_ppo.Hparams):
  prox_method: str = "loglinear"  # AReaL `prox_logp_method` default.

  def __post_init__(self):
    super().__post_init__()
    if self.prox_method not in PROX_METHODS:
      raise ValueError(f"loss.hparams.prox_method={self.prox_method!r}: must be one of {PROX_METHODS}")


def interpolation_weight(versions_BN, current_version):
  """α = clamp((v_prox - v_μ)/(v_θ - v_μ), 0, 1) per token, v_θ = current version, v_prox = v_θ - 1.

  α = 0 where v_μ ≥ v_θ (no update since sampling, or a token newer than the learner, as AReaL) or
  v_μ < 0 (prompt / unversioned tokens).
  Lag 1 gives α = 0 (π_prox = μ); lag n gives α = (n-1)/n.
  """
  v_mu = versions_BN.astype(jnp.float32)
  v_theta = jnp.asarray(current_version, jnp.float32)
  den = v_theta - v_mu
  ok = (den > 0) & (v_mu >= 0)
  alpha = jnp.clip((v_theta - 1.0 - v_mu) / jnp.where(ok, den, 1.0), 0.0, 1.0)
  return jnp.where(ok, alpha, 0.0)


def approx_prox_logp(logp_BN, behavior_logp_BN, alpha_BN, mask_BN, method: str = "loglinear"):
  """Detached log π_prox interpolated between log μ and sg(log π_θ); 0 at masked / non-finite positions.

  loglinear: log μ + α·(sg(log π_θ) - log μ)  (geometric interpolation of the probabilities).
  linear:    log((1-α)·μ + α·sg(π_θ)), computed exactly with logaddexp (AReaL adds 1e-10 inside the log
             for safety; logaddexp needs no epsilon, so tiny probabilities may differ slightly).
  """
  ok = core.valid(mask_BN, logp_BN, behavior_logp_BN)
  new = jnp.where(ok, sg(logp_BN), 0.0).astype(jnp.float32)
  behav = jnp.where(ok, sg(behavior_logp_BN), 0.0).astype(jnp.float32)
  if method == "loglinear":
    prox = behav + alpha_BN * (new - behav)
  else:
    # log(0) = -inf at α ∈ {0, 1} is intended: logaddexp(-inf, x) = x.
    prox = jnp.logaddexp(jnp.log1p(-alpha_BN) + behav, jnp.log(alpha_BN) + new)
  return sg(jnp.where(ok, prox, 0.0))


def a3po(inputs, hp: Hparams):
  """A-3PO: decoupled PPO (see `decoupled_ppo`) with log π_prox approximated instead of recomputed.

  α from per-token versions (`interpolation_weight`); log π_prox = log μ + α·(sg(log π_θ) - log μ)
  (loglinear, default) or the linear mixture. Then ℓ_t = w·max(-Â·r, -Â·clip(r)), r = π_θ/π_prox,
  w = sg(π_prox/μ), with decoupled_ppo's behaviour filter. In value w = exp(α·Δ) and r = exp((1-α)·Δ),
  Δ = log π_θ - log μ. π_prox depends on sg(π_θ), so it is recomputed at every micro-step (it is cheap).
  Saves the learner's proximal forward pass; needs per-token generation versions and the current version.
  Lag 1 (v_θ - v_μ = 1) gives α = 0: PPO anchored on μ with w = 1.
  Paper: arXiv 2512.06547 (A-3PO); AReaL docs/en/algorithms/prox_approx.md
  (compute_prox_logp_approximations).
  On-policy (π_θ = μ, any α): π_prox = μ = π_θ in value, w = r = 1, gradient = vanilla PG -Â·∇log π.
  """
  alpha = interpolation_weight(inputs.versions_BN, inputs.current_version)
  prox = approx_prox_logp(inputs.logp_BN, inputs.behavior_logp_BN, alpha, inputs.mask_BN, hp.prox_method)
  loss, aux = decoupled_ppo.decoupled_ppo_loss(inputs.logp_BN, prox, inputs.behavior_logp_BN, inputs.adv_BN,
                                               inputs.mask_BN, hp)
  aux["prox_alpha"] = core.metric(alpha, inputs.mask_BN)
  return loss, aux


registry.register("a3po", a3po, Hparams, needs=("behavior_logp", "versions"))
