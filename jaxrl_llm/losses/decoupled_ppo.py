"""Decoupled PPO (AReaL): trust region on a proximal policy, IS correction to the behaviour policy."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = jax.lax.stop_gradient

FILTER_METRICS = (None, "ratio", "k1", "k2", "k3")
FILTER_LEVELS = ("token", "sequence")
FILTER_AGGS = ("sum", "mean", "max")
FILTER_ACTIONS = ("mask", "clamp")
UNFILTERED_WEIGHTS = ("ratio", "one")


@dataclasses.dataclass(frozen=True)
class Hparams:
  eps_low: float = 0.2  # AReaL eps_clip (its examples use 0.4).
  eps_high: float = 0.2  # AReaL eps_clip_higher.
  dual_clip: Optional[float] = None  # AReaL c_clip (> 1).
  # Behaviour filter on w = π_prox/μ (AReaL `rejection_sampling`); filter_metric=None disables it.
  filter_metric: Optional[str] = "ratio"  # ratio | k1 | k2 | k3 (KL estimators of π_prox vs μ).
  filter_level: str = "token"  # token | sequence.
  filter_agg: str = "mean"  # sequence level: sum | mean | max (ratio metric: in log space).
  filter_action: str = "mask"  # mask: w = 0 outside the bounds; clamp: w clipped to [lower, upper].
  filter_upper: float = 5.0
  filter_lower: Optional[float] = None
  # Behaviour weight when filter_metric=None: "ratio" (default here) applies the unfiltered
  # w = π_prox/μ; "one" applies none (w = 1), AReaL's convention when rejection sampling is off.
  unfiltered_weight: str = "ratio"

  def __post_init__(self):
    checks = (("filter_metric", FILTER_METRICS), ("filter_level", FILTER_LEVELS),
              ("filter_agg", FILTER_AGGS), ("filter_action", FILTER_ACTIONS),
              ("unfiltered_weight", UNFILTERED_WEIGHTS))
    for name, valid in checks:
      if getattr(self, name) not in valid:
        raise ValueError(f"loss.hparams.{name}={getattr(self, name)!r}: must be one of {valid}")
    if self.filter_action == "clamp" and self.filter_metric not in (None, "ratio"):
      raise ValueError("loss.hparams.filter_action='clamp' clamps the weight, so it needs filter_metric='ratio'")
    if self.dual_clip is not None and not self.dual_clip > 1.0:
      raise ValueError(f"loss.hparams.dual_clip={self.dual_clip}: must be > 1")


def _token_metric(log_w_BN, prox_BN, behav_BN, mask_BN, metric: str):
  """Per-token filter statistic. ratio/k1 return log w (aggregated in log space); k2/k3 the estimate."""
  if metric in ("ratio", "k1"):
    return log_w_BN
  # AReaL's KL estimators of π_prox against μ, Schulman convention (k3 = 1/w + log w - 1).
  return core.kl_estimate(prox_BN, behav_BN, mask_BN, metric)


def behavior_weight(prox_logp_BN, behavior_logp_BN, mask_BN, hp: Hparams):
  """Detached behaviour weight w = π_prox/μ after AReaL's filter. Returns (w_BN, keep_BN, filtered_BN).

  Token level: the statistic is w_t (ratio), log w_t (k1), ½(log w_t)² (k2) or k3; bounds inclusive.
  Sequence level: sum / mean / max of the statistic over the response (for ratio and k1 in log space,
  so "mean" is the geometric mean); for the ratio metric the weight itself becomes the geometric mean
  exp(mean_t log w_t) broadcast over the response (AReaL convention, matches GSPO). An empty response's
  max is 0 (in bounds).
  mask: out-of-bounds tokens (responses) get w = 0 and keep = 0. clamp: w is clipped to
  [lower or 0, upper] on out-of-bounds tokens (responses); keep = mask.
  """
  prox = sg(prox_logp_BN)
  behav = sg(behavior_logp_BN)
  log_w = core.safe_log_ratio(prox, behav, mask_BN)
  mask_b = mask_BN > 0
  if hp.filter_metric is None:
    w = jnp.exp(log_w) if hp.unfiltered_weight == "ratio" else jnp.ones_like(log_w)
    return core.apply_mask(w, mask_BN), core.fmask(mask_BN), jnp.zeros_like(log_w)
  stat = _token_metric(log_w, prox, behav, mask_BN, hp.filter_metric)
  if hp.filter_level == "sequence":
    agg = {"sum": core.seq_sum, "mean": core.seq_mean, "max": core.seq_max}[hp.filter_agg]
    stat = core.broadcast_seq(agg(stat, mask_BN), stat)
    if hp.filter_metric == "ratio":
      log_w = core.broadcast_seq(core.seq_mean(log_w, mask_BN), log_w)
  if hp.filter_metric == "ratio":
    # Compare the ratio in log space: exp of a sequence sum could overflow.
    stat = jnp.clip(stat, -core.LOG_RATIO_BOUND, core.LOG_RATIO_BOUND)
    lo = None if hp.filter_lower is None else jnp.log(jnp.float32(hp.filter_lower))
    hi = jnp.log(jnp.float32(hp.filter_upper))
  else:
    lo, hi = hp.filter_lower, hp.filter_upper
  in_bounds = stat <= hi
  if lo is not None:
    in_bounds = in_bounds & (stat >= lo)
  w = jnp.exp(log_w)
  if hp.filter_action == "mask":
    keep = (mask_b & in_bounds).astype(jnp.float32)
    filtered = mask_b & ~in_bounds
    w = keep * w
  else:
    clamped = jnp.clip(w, 0.0 if hp.filter_lower is None else hp.filter_lower, hp.filter_upper)
    w_new = jnp.where(in_bounds, w, clamped)
    filtered = mask_b & (w_new != w)
    keep = core.fmask(mask_BN)
    w = core.apply_mask(w_new, mask_BN)
  return w, keep, filtered.astype(jnp.float32)


def decoupled_ppo_loss(logp_BN, prox_logp_BN, behavior_logp_BN, adv_BN, mask_BN, hp: Hparams):
  """The decoupled-PPO per-token loss from explicit arrays (shared by a3po and ppo_ewma). Returns (loss_BN, aux)."""
  w, keep, filtered = behavior_weight(prox_logp_BN, behavior_logp_BN, mask_BN, hp)
  lr = core.safe_log_ratio(logp_BN, sg(prox_logp_BN), mask_BN)
  surr, clipped = core.clipped_surrogate(jnp.exp(lr), adv_BN, hp.eps_low, hp.eps_high, hp.dual_clip)
  log_w = core.safe_log_ratio(sg(prox_logp_BN), sg(behavior_logp_BN), mask_BN)
  aux = {"keep_BN": keep, "behave_filtered_frac": core.metric(filtered, mask_BN),
         "clip_frac": core.metric(clipped, keep), "behave_weight": core.metric(w, keep),
         **core.ratio_diagnostics(lr, mask_BN, "ratio"), **core.ratio_diagnostics(log_w, mask_BN, "behave_ratio")}
  return core.apply_mask(w * surr, mask_BN), aux


def decoupled_ppo(inputs, hp: Hparams):
  """Decoupled PPO: ℓ_t = w_t·max(-Â·r, -Â·clip(r, 1-ε_low, 1+ε_high)), r = π_θ/π_prox, w = sg(π_prox/μ).

  π_prox is the learner's policy before the current update (recomputed, `prox_logp_BN`); μ the
  behaviour policy that sampled (`behavior_logp_BN`, possibly several versions stale). The clip is a
  trust region around π_prox; w corrects the off-policy sampling. Optional dual clip (Â < 0):
  ℓ ← min(ℓ, -Â·c) before the weight.
  Behaviour filter (AReaL `rejection_sampling`, default metric=ratio, upper=5.0, token level, mask):
  see `behavior_weight`. Masked tokens are reported in aux["keep_BN"]; AReaL keeps the *original*
  token count in the denominator ("mask mode would inflate per-token gradients"), which is
  `reduce(..., drop_rejected=False)`, the default.
  With the filter off (filter_metric=None) `unfiltered_weight` picks the convention: "ratio" (default;
  w = π_prox/μ, unfiltered) or "one" (AReaL with no rejection sampling: no behaviour weight, w = 1).
  Paper: Hilton et al. 2021 (decoupled PPO); Fu et al. 2025, AReaL, arXiv 2505.24298
  (areal/utils/functional ppo_actor_loss_fn, apply_rejection_sampling).
  On-policy (π_θ = π_prox = μ): w = 1 (in bounds), r = 1, gradient = vanilla PG -Â·∇log π.
  """
  return decoupled_ppo_loss(inputs.logp_BN, inputs.prox_logp_BN, inputs.behavior_logp_BN, inputs.adv_BN,
                            inputs.mask_BN, hp)


registry.register("decoupled_ppo", decoupled_ppo, Hparams, needs=("prox_logp", "behavior_logp"))
