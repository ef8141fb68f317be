"""Open-MOPD (arXiv 2608.19098, spec A6): multi-teacher OPD budget control.

M0 hard routing: each prompt's domain picks exactly one teacher.
M1 token-share balancing: per-sequence weight g*_d / o_d, rescaled to a token-weighted mean of 1; it
   multiplies the advantage, not the mask.
M2 gap-following (direction "multiply"): factor clip((m_d / ref_d)^α, 0.05, 20), m_d a statistic of
   |reward| over the domain's tokens, ref_d anchored at its first value (or an EMA).
M4 student reward refresh: before each inner update, rebuild r_t(v) = sg[(log p_d(v) − log q(v))·p̄_q(v)]
   from the *current* student on the cached top-k ids (IS cannot fix a stale reward, only a stale sampler).
M1/M2 are host-side per-batch numbers (numpy); M4 is jittable: `refresh_reward`, trained by the loss
`mopd_refresh` (`jaxrl_llm.losses.mopd_refresh`), which rebuilds the reward at every inner update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.losses.mopd_refresh import refresh_reward  # noqa: F401  (M4: the loss `mopd_refresh` trains on it)

Array = jax.Array

STATS = ("mean", "q75", "q90", "top10")


def route(domain_B: Array, per_teacher_YB_: Array) -> Array:
  """Hard routing: row b takes teacher domain_B[b]'s values from a [Y, B, ...] stack."""
  return jnp.take_along_axis(per_teacher_YB_, domain_B.reshape((1, -1) + (1,) * (per_teacher_YB_.ndim - 2)), 0)[0]


def token_share_weights(domain_B, ntok_B, target_share_Y) -> np.ndarray:
  """M1: w_b = g*_d / o_d with o_d the observed token share, g* renormalised over the domains present,
  then rescaled so Σ_b ntok_b·w_b / Σ_b ntok_b = 1. Sequences of an absent/zero-token batch get 1."""
  domain_B, ntok_B = np.asarray(domain_B), np.asarray(ntok_B, np.float64)
  g = np.asarray(target_share_Y, np.float64)
  tok_Y = np.bincount(domain_B, weights=ntok_B, minlength=g.shape[0])
  total = tok_Y.sum()
  if total <= 0:
    return np.ones_like(ntok_B)
  present = tok_Y > 0
  g = np.where(present, g, 0.0)
  g = g / g.sum()
  o = tok_Y / total
  w_B = np.where(present[domain_B], g[domain_B] / np.where(present, o, 1.0)[domain_B], 0.0)
  return w_B / ((ntok_B * w_B).sum() / total)


def domain_magnitude(abs_reward_BN, mask_BN, domain_B, num_domains: int, stat: str = "mean") -> np.ndarray:
  """M2 magnitude m_d of |reward| over each domain's counted tokens; NaN for a domain with no tokens."""
  if stat not in STATS:
    raise ValueError(f"gap statistic {stat!r} must be one of {STATS}")
  a, m, d = np.asarray(abs_reward_BN, np.float64), np.asarray(mask_BN) > 0, np.asarray(domain_B)
  out = np.full(num_domains, np.nan)
  for k in range(num_domains):
    x = a[(d == k)[:, None] & m]
    if x.size == 0:
      continue
    if stat == "mean":
      out[k] = x.mean()
    elif stat == "top10":
      out[k] = np.sort(x)[-max(1, int(np.ceil(0.1 * x.size))):].mean()
    else:
      out[k] = np.quantile(x, {"q75": 0.75, "q90": 0.9}[stat])
  return out


def update_reference(ref_Y, m_Y, mode: str = "anchored", decay: float = 0.9) -> np.ndarray:
  """ref_d: the first observed magnitude ("anchored") or an EMA ("ema"); NaN entries mean "not yet seen"."""
  ref, m = np.asarray(ref_Y, np.float64), np.asarray(m_Y, np.float64)
  seen, new = np.isfinite(ref), np.isfinite(m)
  if mode == "anchored":
    return np.where(seen, ref, m)
  if mode == "ema":
    return np.where(seen & new, decay * ref + (1 - decay) * m, np.where(seen, ref, m))
  raise ValueError(f"gap reference mode {mode!r} must be 'anchored' or 'ema'")


def gap_factor(m_Y, ref_Y, alpha: float = 1.0, lo: float = 0.05, hi: float = 20.0) -> np.ndarray:
  """M2 (multiply): clip((m_d / ref_d)^α, lo, hi); 1 where either is unknown or ref_d = 0."""
  m, ref = np.asarray(m_Y, np.float64), np.asarray(ref_Y, np.float64)
  ok = np.isfinite(m) & np.isfinite(ref) & (ref > 0)
  ratio = np.where(ok, m / np.where(ok, ref, 1.0), 1.0)
  return np.where(ok, np.clip(np.power(np.maximum(ratio, 0.0), alpha), lo, hi), 1.0)


def domain_loss_weights(domain_B, ntok_B, target_share_Y, m_Y=None, ref_Y=None, alpha: float = 1.0,
                        renormalize: bool = True) -> np.ndarray:
  """M1 × M2 per-sequence advantage weights [B]. `renormalize` rescales the product to token-weighted mean 1
  again [GUESS: the fork's order of operations is not pinned]; gap factors then shift budget between domains."""
  w = token_share_weights(domain_B, ntok_B, target_share_Y)
  if m_Y is not None:
    w = w * gap_factor(m_Y, ref_Y, alpha)[np.asarray(domain_B)]
  if renormalize:
    ntok = np.asarray(ntok_B, np.float64)
    s = (ntok * w).sum()
    w = w * (ntok.sum() / s) if s > 0 else w
  return w


