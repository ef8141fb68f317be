"""Building blocks every loss composes: sanitised log-ratios, sequence statistics, clipping, KL estimators.

Numerics (methods-rl.md §1):
- Padding may hold -inf log-probs and (-inf) - (-inf) = NaN. A single `where` after the arithmetic
  still back-propagates NaN, so inputs are sanitised *before* any arithmetic ("double where").
- Every log-ratio is clamped to ±LOG_RATIO_BOUND before `exp`; sequence sums are taken in float32.
- Empty masks: every denominator is max(count, 1).
- Ties at clip boundaries use explicit `where` with a documented rule instead of `maximum`/`minimum`,
  which split the gradient 50/50 on ties.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
sg = jax.lax.stop_gradient

LOG_RATIO_BOUND = 20.0


def valid(mask_BN: Array, *logps_BN: Array) -> Array:
  """Boolean mask of positions that count and whose log-probs are all finite."""
  ok = mask_BN > 0
  for x in logps_BN:
    ok = ok & jnp.isfinite(x)
  return ok


def safe_log_ratio(num_BN: Array, den_BN: Array, mask_BN: Array, bound: float = LOG_RATIO_BOUND) -> Array:
  """log(num/den) in float32, 0 where masked or non-finite, clamped to ±bound (double-where safe)."""
  ok = valid(mask_BN, num_BN, den_BN)
  num = jnp.where(ok, num_BN.astype(jnp.float32), 0.0)
  den = jnp.where(ok, den_BN.astype(jnp.float32), 0.0)
  return jnp.where(ok, jnp.clip(num - den, -bound, bound), 0.0)


def safe_logp(logp_BN: Array, mask_BN: Array) -> Array:
  """Log-probs with masked / non-finite positions replaced by 0 (keeps gradients finite)."""
  ok = valid(mask_BN, logp_BN)
  return jnp.where(ok, logp_BN, 0.0).astype(jnp.float32)


def fmask(mask_BN: Array) -> Array:
  return (mask_BN > 0).astype(jnp.float32)


def seq_len(mask_BN: Array) -> Array:
  """Number of counted tokens per sequence, float32 [B]."""
  return fmask(mask_BN).sum(-1)


def seq_sum(x_BN: Array, mask_BN: Array) -> Array:
  """Masked sum over time in float32 [B]."""
  return jnp.where(mask_BN > 0, x_BN.astype(jnp.float32), 0.0).sum(-1)


def seq_mean(x_BN: Array, mask_BN: Array) -> Array:
  """Masked mean over time [B]; 0 for empty sequences."""
  return seq_sum(x_BN, mask_BN) / jnp.maximum(seq_len(mask_BN), 1.0)


def seq_max(x_BN: Array, mask_BN: Array, empty: float = 0.0) -> Array:
  """Masked max over time [B]; `empty` (a neutral, in-bounds value) for empty sequences."""
  m = mask_BN > 0
  out = jnp.max(jnp.where(m, x_BN.astype(jnp.float32), -jnp.inf), axis=-1)
  return jnp.where(m.any(-1), out, empty)


def broadcast_seq(x_B: Array, like_BN: Array) -> Array:
  return jnp.broadcast_to(x_B[:, None], like_BN.shape)


def seq_advantage(adv_BN: Array, mask_BN: Array) -> Array:
  """Sequence advantage as the masked mean of per-token advantages (robust to left/right padding)."""
  return seq_mean(adv_BN, mask_BN)


# ---------------------------------------------------------------------------------------------
# Metrics: (sum, count) pairs so micro-batch and multi-device means are exact.


def metric(x_BN: Array, mask_BN: Array) -> tuple[Array, Array]:
  """Masked (sum, count) of a per-token quantity."""
  m = fmask(mask_BN)
  return (jnp.where(m > 0, sg(x_BN).astype(jnp.float32), 0.0).sum(), m.sum())


def seq_metric(x_B: Array, valid_B: Array) -> tuple[Array, Array]:
  v = (valid_B > 0).astype(jnp.float32)
  return (jnp.where(v > 0, sg(x_B).astype(jnp.float32), 0.0).sum(), v.sum())


def max_metric(x_BN: Array, mask_BN: Array) -> tuple[Array, Array]:
  """A max, carried as (max, 1). Metric names ending in `_max` are combined with max, not summed."""
  m = mask_BN > 0
  mx = jnp.max(jnp.where(m, sg(x_BN).astype(jnp.float32), -jnp.inf))
  return (jnp.where(m.any(), mx, 0.0), jnp.ones((), jnp.float32))


def masked_quantile(x_BN: Array, mask_BN: Array, q: float) -> Array:
  """Lower empirical quantile over masked entries: the smallest x with empirical CDF >= q.

  Jittable (static shapes): masked entries sort last as +inf. Returns 0 for an empty mask.
  """
  m = (mask_BN > 0).reshape(-1)
  x = jnp.where(m, x_BN.reshape(-1).astype(jnp.float32), jnp.inf)
  xs = jnp.sort(x)
  n = m.sum()
  idx = jnp.clip(jnp.ceil(q * n).astype(jnp.int32) - 1, 0, x.shape[0] - 1)
  return jnp.where(n > 0, xs[idx], 0.0)


def ratio_diagnostics(log_ratio_BN: Array, mask_BN: Array, prefix: str) -> dict:
  """Importance-ratio tail metrics: mean, max, p99 (as a max-combined metric) and normalised ESS.

  ESS/N = (Σw)² / (N Σw²) over counted tokens; 1 when all weights are equal.
  """
  lr = sg(log_ratio_BN)
  w = jnp.where(mask_BN > 0, jnp.exp(lr), 0.0)
  n = jnp.maximum(fmask(mask_BN).sum(), 1.0)
  ess = jnp.square(w.sum()) / jnp.maximum(n * jnp.square(w).sum(), 1e-30)
  return {
      f"{prefix}_mean": metric(jnp.exp(lr), mask_BN),
      f"{prefix}_max": max_metric(jnp.exp(lr), mask_BN),
      f"{prefix}_p99_max": (jnp.exp(masked_quantile(lr, mask_BN, 0.99)), jnp.ones(())),
      f"{prefix}_ess": (ess, jnp.ones(())),
  }


# ---------------------------------------------------------------------------------------------
# Surrogates and weights.


def clipped_surrogate(ratio_BN: Array, adv_BN: Array, eps_low, eps_high, dual_clip=None):
  """PPO clipped surrogate loss per token: max(-A·r, -A·clip(r, 1-eps_low, 1+eps_high)).

  Dual clip (Ye et al. 2020), for A < 0 only: min(loss, -A·c) with c > 1.
  Tie rule: the clipped branch is taken only when it is strictly larger, so at r exactly on a
  boundary the gradient flows through r (no 50/50 split).
  Returns (loss_BN, clipped_BN) where clipped_BN marks tokens whose gradient the clip removed.
  """
  clipped_ratio = jnp.clip(ratio_BN, 1.0 - eps_low, 1.0 + eps_high)
  unclipped = -adv_BN * ratio_BN
  clipped = -adv_BN * clipped_ratio
  use_clip = clipped > unclipped
  loss = jnp.where(use_clip, clipped, unclipped)
  if dual_clip is not None:
    cap = -adv_BN * dual_clip
    use_dual = (adv_BN < 0) & (loss > cap)
    loss = jnp.where(use_dual, cap, loss)
    use_clip = use_clip | use_dual
  return loss, use_clip


def truncate(w_BN: Array, cap) -> Array:
  """min(w, cap) with the gradient (if any) flowing through w below the cap."""
  return jnp.where(w_BN > cap, cap, w_BN)


def reinforce(coef_BN: Array, logp_BN: Array, mask_BN: Array) -> Array:
  """Detached-coefficient form: loss = -sg(coef)·log π, so ∇ = -coef·∇log π. Its value means nothing."""
  return jnp.where(mask_BN > 0, -sg(coef_BN) * safe_logp(logp_BN, mask_BN), 0.0)


def apply_mask(loss_BN: Array, mask_BN: Array) -> Array:
  """Zeroes the loss outside the mask with a where (a multiply would propagate NaN from padding)."""
  return jnp.where(mask_BN > 0, loss_BN, 0.0)


# ---------------------------------------------------------------------------------------------
# KL estimators of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman's k1/k2/k3).


def kl_k1(logp_BN: Array, ref_logp_BN: Array) -> Array:
  return logp_BN - ref_logp_BN


def kl_k2(logp_BN: Array, ref_logp_BN: Array) -> Array:
  return 0.5 * jnp.square(logp_BN - ref_logp_BN)


def kl_k3(logp_BN: Array, ref_logp_BN: Array) -> Array:
  """exp(ref-logp) - (ref-logp) - 1: unbiased, non-negative, low variance (GRPO's KL, verl low_var_kl)."""
  d = jnp.clip(ref_logp_BN - logp_BN, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
  return jnp.exp(d) - d - 1.0


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(logp_BN: Array, ref_logp_BN: Array, mask_BN: Array, estimator: str = "k3") -> Array:
  """Per-token KL estimate, 0 on masked / non-finite positions (double-where safe)."""
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"kl estimator {estimator!r} not in {sorted(KL_ESTIMATORS)}")
  ok = valid(mask_BN, logp_BN, ref_logp_BN)
  a = jnp.where(ok, logp_BN, 0.0).astype(jnp.float32)
  b = jnp.where(ok, ref_logp_BN, 0.0).astype(jnp.float32)
  return jnp.where(ok, KL_ESTIMATORS[estimator](a, b), 0.0)


def kl_to_ref_term(inputs, coef: float, estimator: str = "k3") -> tuple[Array, dict]:
  """β·KL(π_θ‖π_ref) per token, to add to any loss before `reduce` (GRPO's KL term)."""
  kl = kl_estimate(inputs.logp_BN, inputs.ref_logp_BN, inputs.mask_BN, estimator)
  return coef * kl, {"kl_ref": metric(kl, inputs.mask_BN)}


def entropy_term(inputs, coef: float) -> tuple[Array, dict]:
  """-coef·H(π_θ) per token (an entropy bonus), to add to any loss before `reduce`."""
  ent = jnp.where(inputs.mask_BN > 0, inputs.entropy_BN, 0.0)
  return -coef * ent, {"entropy": metric(ent, inputs.mask_BN)}
