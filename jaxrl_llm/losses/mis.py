"""Masked importance sampling (MIS) / rejection sampling for the training–inference mismatch."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = jax.lax.stop_gradient

CRITERIA = ("token_k1", "seq_sum_k1", "seq_mean_k1",
            "token_k2", "seq_sum_k2", "seq_mean_k2", "seq_max_k2",
            "token_k3", "seq_sum_k3", "seq_mean_k3", "seq_max_k3")
IS_LEVELS = (None, "token", "sequence")
MODES = ("decoupled", "bypass")


@dataclasses.dataclass(frozen=True)
class Hparams:
  # Rejection criteria "<level>_<metric>", AND-combined; `lower`/`upper` are parallel tuples.
  # k1 keeps the ratio statistic in [lower, upper]; k2/k3 keep the divergence <= upper (lower unused).
  criteria: tuple = ("token_k1",)
  lower: tuple = (0.5,)
  upper: tuple = (2.0,)
  veto: Optional[float] = None  # ROLL catastrophic veto: drop a response if any token has ρ < veto (1e-4).
  is_level: Optional[str] = "token"  # IS weight on kept tokens: None (pure rejection), "token", "sequence".
  is_cap: Optional[float] = None  # truncate the IS weight at C (Seq-MIS preset: 2.0).
  mode: str = "decoupled"  # "decoupled": ρ = π_old/μ, PPO-clip base; "bypass": ρ = π_θ/μ, REINFORCE base.
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: Optional[float] = None

  def __post_init__(self):
    # YAML gives lists; keep the dataclass hashable.
    for f in ("criteria", "lower", "upper"):
      object.__setattr__(self, f, tuple(getattr(self, f)))
    bad = [c for c in self.criteria if c not in CRITERIA]
    if bad:
      raise ValueError(f"loss.hparams.criteria: unknown {bad}; valid: {CRITERIA}")
    if not (len(self.criteria) == len(self.lower) == len(self.upper)):
      raise ValueError("loss.hparams.criteria, lower and upper must have the same length")
    if self.is_level not in IS_LEVELS:
      raise ValueError(f"loss.hparams.is_level={self.is_level!r}: must be one of {IS_LEVELS}")
    if self.mode not in MODES:
      raise ValueError(f"loss.hparams.mode={self.mode!r}: must be one of {MODES}")


def _log(x: float) -> float:
  return math.log(x) if x > 0 else -math.inf


def _token_divergence(log_rho_BN, metric: str):
  """Per-token statistic in the space where it is aggregated: log ρ (k1), ½(log ρ)² (k2), ρ - log ρ - 1 (k3).

  k3 = ρ - log ρ - 1 with ρ = π/μ and tokens drawn from μ is the low-variance estimate of KL(μ‖π).
  """
  if metric == "k1":
    return log_rho_BN
  if metric == "k2":
    return 0.5 * jnp.square(log_rho_BN)
  return jnp.expm1(log_rho_BN) - log_rho_BN


def _aggregate(x_BN, mask_BN, level: str):
  """Token statistic as is ([B, N]) or its masked sum / mean / max per sequence, broadcast ([B, N])."""
  if level == "token":
    return x_BN
  x_B = {"seq_sum": core.seq_sum, "seq_mean": core.seq_mean, "seq_max": core.seq_max}[level](x_BN, mask_BN)
  return core.broadcast_seq(x_B, x_BN)


def rejection_keep(log_rho_BN, mask_BN, criteria, lower, upper, veto=None):
  """Float {0,1} mask of tokens that pass every criterion (and the veto), within `mask_BN`.

  k1 is thresholded on the ratio itself, ρ_stat ∈ [lower, upper], compared in log space
  (log lower ≤ log ρ_stat ≤ log upper); ρ_stat is ρ_t, Π_t ρ_t or exp(mean_t log ρ_t) by level.
  k2/k3 keep stat ≤ upper. Bounds are inclusive.
  """
  keep = mask_BN > 0
  for crit, lo, hi in zip(criteria, lower, upper):
    level, metric = crit.rsplit("_", 1)
    stat = _aggregate(_token_divergence(log_rho_BN, metric), mask_BN, level)
    if metric == "k1":
      keep = keep & (stat >= _log(lo)) & (stat <= _log(hi))
    else:
      keep = keep & (stat <= hi)
  if veto is not None:
    bad_B = ((mask_BN > 0) & (log_rho_BN < _log(veto))).any(-1)
    keep = keep & ~bad_B[:, None]
  return keep.astype(jnp.float32)


def is_weight(log_rho_BN, mask_BN, level: Optional[str], cap: Optional[float]):
  """Detached IS weight ρ_t (token) or Π_t ρ_t (sequence, log sum clamped to ±20), optionally min(·, C)."""
  if level is None:
    return jnp.ones_like(log_rho_BN)
  if level == "token":
    log_w = log_rho_BN
  else:
    log_w = core.broadcast_seq(
        jnp.clip(core.seq_sum(log_rho_BN, mask_BN), -core.LOG_RATIO_BOUND, core.LOG_RATIO_BOUND), log_rho_BN)
  w = jnp.exp(sg(log_w))
  return w if cap is None else core.truncate(w, cap)


def mis(inputs, hp: Hparams):
  """Masked IS / rejection sampling: ℓ_t = keep_t·w_t·ℓ_base, keep from bounds on ρ, w = sg(ρ) (optional).

  ρ = π_old/μ in decoupled mode (base: PPO-clip on r = π_θ/π_old, weight applied after clipping) or
  sg(π_θ/μ) in bypass mode (base: REINFORCE, ℓ = -sg(keep·w)·Â·log π_θ, value meaningless).
  A token (or its whole response, at sequence level) is kept iff every criterion holds:
    token_k1   ρ_t ∈ [lo, hi]               seq_sum_k1  Π_t ρ_t ∈ [lo, hi]
    seq_mean_k1 exp(mean_t log ρ_t) ∈ [lo, hi] ("Geo-RS", length-invariant)
    {token, seq_sum, seq_mean, seq_max}_{k2, k3}: ½(log ρ)² or ρ - log ρ - 1 ≤ hi.
  Optional ROLL catastrophic veto drops a whole response if any token has ρ < veto.
  k1 direction (methods-rl §3.1 edge case): we threshold ρ itself in [lo, hi], as the verl docs state.
  verl HEAD compares -log ρ with [log lo, log hi], i.e. ρ ∈ [1/hi, 1/lo]; the two agree only when
  lo = 1/hi (e.g. the default [0.5, 2.0]).
  Presets: Token-MIS (default) token_k1 [0.5, 2.0] with token weights; Seq-MIS: is_level="sequence",
  is_cap=2.0, seq_sum_k1 [0.5, 2.0]; Geo-RS: is_level=None, seq_mean_k1 [0.999, 1.001];
  K3-RS: is_level=None, seq_mean_k3 ≤ 0.01; ROLL: token_k1 [0, 2], veto 1e-4 (+ seq_sum_k1 [0.1, 10]).
  Rejected tokens get zero loss and are reported in aux["keep_BN"]; `reduce(..., drop_rejected=True)`
  removes them from the denominator (verl rejection sampling), the default keeps them (AReaL).
  Paper: Yao et al. 2025 / Liu et al. 2025 "When Speed Kills Stability" (MIS); verl rollout_corr_helper;
  ROLL infer_correction.
  On-policy (π_θ = π_old = μ): ρ = 1 passes every criterion with lo ≤ 1 ≤ hi, w = 1, and the
  gradient is the vanilla PG gradient -Â·∇log π.
  """
  mask = inputs.mask_BN
  num = inputs.prox_logp_BN if hp.mode == "decoupled" else inputs.logp_BN
  log_rho = core.safe_log_ratio(sg(num), sg(inputs.behavior_logp_BN), mask)
  keep = rejection_keep(log_rho, mask, hp.criteria, hp.lower, hp.upper, hp.veto)
  w = keep * is_weight(log_rho, mask, hp.is_level, hp.is_cap)
  aux = {"keep_BN": keep, "masked_frac": core.metric(1.0 - keep, mask), "is_weight": core.metric(w, keep),
         **core.ratio_diagnostics(log_rho, mask, "mismatch_ratio")}
  if hp.mode == "decoupled":
    lr = core.safe_log_ratio(inputs.logp_BN, sg(inputs.prox_logp_BN), mask)
    surr, clipped = core.clipped_surrogate(jnp.exp(lr), inputs.adv_BN, hp.eps_low, hp.eps_high, hp.dual_clip)
    loss = w * surr
    aux["clip_frac"] = core.metric(clipped, keep)
  else:
    loss = core.reinforce(w * inputs.adv_BN, inputs.logp_BN, mask)
  return core.apply_mask(loss, mask), aux


registry.register("mis", mis, Hparams, needs=("prox_logp", "behavior_logp"))
