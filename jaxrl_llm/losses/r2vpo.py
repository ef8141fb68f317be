"""R²VPO: ratio-variance regularised policy optimisation with a primal–dual multiplier (reconstruction)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = core.sg


@dataclasses.dataclass(frozen=True)
class Hparams:
  # All three defaults are placeholders [GUESS]: the paper's values were not readable.
  delta: float = 0.02  # variance budget δ on Var_batch(r).
  dual_lr: float = 10.0  # η_λ, step size of the dual ascent on λ.
  lambda_init: float = 1.0  # λ_0, the multiplier before the first step.
  # Stale-data budget: a sequence whose behaviour ratio π_old/μ has a second moment about 1 above it is
  # reweighted by sqrt(stale_delta / moment) instead of discarded; 0 turns the reweighting off. [GUESS]
  stale_delta: float = 0.1


def r2vpo(inputs, hp: Hparams):
  """R²VPO (reconstruction, unverified): L = −mean(r·Â) + λ·(Var_batch(r) − δ), r = π_θ/π_old.

  The variance of the importance ratio over the batch's tokens is a smooth replacement for PPO's
  hard clip; λ ≥ 0 is a Lagrange multiplier updated by dual ascent after each step:
      λ ← max(0, λ + η_λ·(Var_batch(r) − δ))     (returned as aux["state"]; unchanged on an empty batch).
  Papers: arXiv 2601.03320; 2605.26784. Only the abstracts were readable, and no code: the estimator
  (global centred variance over tokens), the unclipped surrogate, and the defaults are our
  reconstruction of "constrain the second central moment of the ratio, primal–dual" (methods-rl §7.3).
  Stale data (the abstract: "reweighting stale samples rather than discarding them"; reconstruction [GUESS]):
  each sequence's surrogate term −Â·r is scaled by w_b = min(1, sqrt(stale_delta / v_b)), where
  v_b = mean over its tokens of (ρ_t − 1)², ρ = π_old/μ its behaviour ratio (whose expectation under μ is 1):
  the factor that brings the sequence's contribution back inside the variance budget. w is detached; a fresh
  sequence (ρ ≡ 1) keeps w = 1, so on-policy nothing changes; `stale_weight_mean` / `stale_reweighted_frac`
  report it. Without a behaviour record (`behavior_logp_BN` None) w = 1.
  Per-token form: with N = Σ m and r̄ = (1/N)Σ m·r (not detached),
      ℓ_t = −Â_t·r_t + λ·((r_t − r̄)² − δ),
  so `reduce(ℓ, mask, "token-mean")` equals the objective above exactly, value and gradient
  (∂/∂r_t = −Â_t/N + 2λ(r_t − r̄)/N). Use token-mean: other modes re-weight the per-token
  contributions, so the penalty is then a length-weighted variance around the global mean. The batch
  is whatever this call sees (micro-batching changes Var). r uses the ±20 clamped log-ratio.
  On-policy (π_θ = π_old): r ≡ 1, Var = 0 and its gradient 2λ(r − r̄)/N = 0, so the gradient is the
  vanilla PG gradient −Â·∇log π; λ then decays by η_λ·δ per step towards 0.
  """
  mask = inputs.mask_BN
  lam = jnp.asarray(inputs.state, jnp.float32)
  lr = core.safe_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, mask)
  ratio = jnp.exp(lr)
  m = core.fmask(mask)
  n = m.sum()
  mean_r = jnp.where(m > 0, ratio, 0.0).sum() / jnp.maximum(n, 1.0)
  dev2 = jnp.square(ratio - mean_r)
  var = jnp.where(m > 0, dev2, 0.0).sum() / jnp.maximum(n, 1.0)
  w_B = _stale_weights(inputs, hp.stale_delta)
  loss = -inputs.adv_BN * ratio * w_B[:, None] + sg(lam) * (dev2 - hp.delta)
  new_lam = jnp.where(n > 0, jnp.maximum(0.0, lam + hp.dual_lr * (sg(var) - hp.delta)), lam)
  one = jnp.ones((), jnp.float32)
  aux = {
      "ratio_var": (sg(var), one),
      "lambda": (sg(lam), one),
      "constraint_violation": (sg(var) - hp.delta, one),
      **core.ratio_diagnostics(lr, mask, "ratio"),
      "stale_weight_mean": core.seq_metric(w_B, core.seq_len(mask) > 0),
      "stale_reweighted_frac": core.seq_metric((w_B < 1).astype(jnp.float32), core.seq_len(mask) > 0),
      "state": sg(new_lam),
  }
  return core.apply_mask(loss, mask), aux


def _stale_weights(inputs, stale_delta: float):
  """[B] detached weights min(1, sqrt(stale_delta / v_b)), v_b the per-sequence mean of (π_old/μ − 1)²."""
  mask = inputs.mask_BN
  if inputs.behavior_logp_BN is None or stale_delta <= 0:
    return jnp.ones(mask.shape[0], jnp.float32)
  rho = jnp.exp(core.safe_log_ratio(inputs.prox_logp_BN, inputs.behavior_logp_BN, mask))
  v_B = core.seq_mean(jnp.square(rho - 1.0), mask)
  return sg(jnp.where(v_B > stale_delta, jnp.sqrt(stale_delta / jnp.maximum(v_B, 1e-30)), 1.0))


registry.register("r2vpo", r2vpo, Hparams, needs=("prox_logp", "behavior_logp", "state"),
                  init_state=lambda hp: jnp.asarray(hp.lambda_init, jnp.float32))
