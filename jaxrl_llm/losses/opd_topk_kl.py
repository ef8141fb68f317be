"""OPD top-k sparse KL against a finite teacher-score cache, with an optional residual-mass bucket."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

DIRECTIONS = ("forward", "reverse", "skewed")
# Residual masses below this are fp32 cancellation noise of 1 − Σ_k (K = V leaves ~1e-7): treat as 0.
RESIDUAL_FLOOR = 1e-6


@dataclasses.dataclass(frozen=True)
class Hparams:
  direction: str = "forward"  # async-opd kl_loss_mode=forward_kl.
  residual: bool = False  # add the tail class 1 − Σ_k (spec's recommended option; S²D-OPD uses it).
  skew_alpha: float = 0.5  # "skewed": α·forward + (1−α)·reverse per element (async-opd default 0.5).
  token_clip: Optional[float] = None  # clamp each element to ±token_clip (OPSD uses 0.05); None = off.


def topk_valid(ids_BNk, *logps_BNk):
  """Valid cache slots: id ≥ 0 and every log-prob finite (invalid slots never use -inf ids)."""
  ok = ids_BNk >= 0
  for x in logps_BNk:
    ok = ok & jnp.isfinite(x)
  return ok


def residual_log_mass(logp_BNk, ok_BNk):
  """(log r, r > floor) for r = max(1 − Σ_k exp(logp_k), 0) over valid slots, float32, double-where safe."""
  mass = jnp.where(ok_BNk, jnp.exp(logp_BNk), 0.0).sum(-1)
  r = 1.0 - mass
  has = r > RESIDUAL_FLOOR
  return jnp.where(has, jnp.log(jnp.where(has, r, 1.0)), 0.0), has


def _elementwise(wp, wq, d, direction, alpha):
  """Per-element KL terms from weights p, q and d = log q − log p: forward p·(−d), reverse q·d."""
  fwd, rev = wp * -d, wq * d
  return {"forward": fwd, "reverse": rev, "skewed": alpha * fwd + (1.0 - alpha) * rev}[direction]


def opd_topk_kl(inputs, hp: Hparams):
  """Sparse KL over the teacher's cached top-k ids I_t (spec A1.4).

  With p_k = teacher prob and q_k = π_θ prob (full-vocabulary normalised) at the same id:
    forward  Σ_k p_k (log p_k − log q_k)      (async-opd `sparse_forward_kl`; a lower bound on the full KL)
    reverse  Σ_k q_k (log q_k − log p_k)      (`sparse_reverse_kl`; ignores student mass outside I_t)
    skewed   α·forward + (1−α)·reverse per element, optionally each element clamped to
             ±`token_clip` (zero gradient where clamped).
  `residual=True` adds one tail class per side, p_r = 1 − Σ_k p_k and q_r = 1 − Σ_k q_k (clamped ≥ 0,
  q_r differentiable), so both compressed distributions sum to 1 and the KL on K+1 classes is ≤ the
  full KL (data processing). With K = V and no residual (or with it) the loss equals the dense KL.
  Reads `student_topk_logp_BNk` (log π_θ at `teacher_topk_ids_BNk`, differentiable) and
  `teacher_topk_logp_BNk`; not `logp_BN`. Invalid slots: id < 0 or a non-finite log-prob; teacher
  top-k ids are assumed distinct (sampled caches must be deduplicated first).
  On-policy: identical to its off-policy form (no ratio); the target is the teacher's, so staleness
  changes only the visited states.
  """
  if hp.direction not in DIRECTIONS:
    raise ValueError(f"loss.hparams.direction={hp.direction!r}: must be one of {DIRECTIONS}")
  mask = inputs.mask_BN
  ok = topk_valid(inputs.teacher_topk_ids_BNk, inputs.teacher_topk_logp_BNk, inputs.student_topk_logp_BNk)
  ok = ok & (mask[..., None] > 0)
  lp = jnp.where(ok, inputs.teacher_topk_logp_BNk.astype(jnp.float32), 0.0)
  lq = jnp.where(ok, inputs.student_topk_logp_BNk.astype(jnp.float32), 0.0)
  lp = jax.lax.stop_gradient(lp)
  bound = core.LOG_RATIO_BOUND
  d = jnp.where(ok, jnp.clip(lq - lp, -bound, bound), 0.0)
  elems = _elementwise(jnp.where(ok, jnp.exp(lp), 0.0), jnp.where(ok, jnp.exp(lq), 0.0), d, hp.direction,
                       hp.skew_alpha)
  if hp.residual:
    lpr, has_p = residual_log_mass(lp, ok)
    lqr, has_q = residual_log_mass(lq, ok)
    # A tail present on one side only: the other side's log-mass is floored, the ±20 clamp bounds it.
    floor = jnp.log(RESIDUAL_FLOOR)
    d_r = jnp.clip(jnp.where(has_q, lqr, floor) - jnp.where(has_p, lpr, floor), -bound, bound)
    tail = _elementwise(jnp.where(has_p, jnp.exp(lpr), 0.0), jnp.where(has_q, jnp.exp(lqr), 0.0), d_r,
                        hp.direction, hp.skew_alpha)
    elems = jnp.concatenate([elems, jnp.where(mask > 0, tail, 0.0)[..., None]], axis=-1)
  if hp.token_clip is not None:
    elems = jnp.clip(elems, -hp.token_clip, hp.token_clip)
  loss = core.apply_mask(elems.sum(-1), mask)
  mass_p = jnp.where(ok, jnp.exp(lp), 0.0).sum(-1)
  return loss, {"kl_topk": core.metric(loss, mask), "teacher_topk_mass": core.metric(mass_p, mask)}


registry.register("opd_topk_kl", opd_topk_kl, Hparams, needs=("teacher_topk", "student_topk"))
