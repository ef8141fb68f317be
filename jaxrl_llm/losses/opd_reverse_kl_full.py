"""OPD reverse KL over the full vocabulary: KL(π_θ ‖ p) per state (student-weighted, mode-seeking)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

# Finite stand-in for a -inf logit: exp underflows to exactly 0 and no inf - inf (NaN) can appear.
NEG_LOGIT = -1e30


@dataclasses.dataclass(frozen=True)
class Hparams:
  temperature: float = 1.0  # applied to both logits; logits usually arrive already at the sampler's T.


def dense_logp(logits_BTV, mask_BT, temperature: float = 1.0):
  """float32 log_softmax(logits / T); non-finite logits -> NEG_LOGIT, masked rows -> uniform (double-where)."""
  z = logits_BTV.astype(jnp.float32)
  z = jnp.where(jnp.isfinite(z), z / temperature, NEG_LOGIT)
  z = jnp.where(mask_BT[..., None] > 0, z, 0.0)
  return jax.nn.log_softmax(z, axis=-1)


def kl_dense(la_BTV, lb_BTV, bound: float = core.LOG_RATIO_BOUND):
  """KL(a ‖ b) = Σ_v a_v (log a_v − log b_v) per position, each log-ratio clamped to ±bound.

  Entries with a_v = 0 contribute exactly 0; b_v = 0 where a_v > 0 contributes a_v·bound instead of ∞.
  """
  d = jnp.clip(la_BTV - lb_BTV, -bound, bound)
  return jnp.sum(jnp.exp(la_BTV) * d, axis=-1)


def dense_pair(inputs, temperature: float):
  """(log q_θ, sg log p) over the vocabulary, sanitised; the teacher never carries gradient."""
  lq = dense_logp(inputs.student_logits_BTV, inputs.mask_BT, temperature)
  lp = jax.lax.stop_gradient(dense_logp(inputs.teacher_logits_BTV, inputs.mask_BT, temperature))
  return lq, lp


def opd_reverse_kl_full(inputs, hp: Hparams):
  """Full-vocabulary reverse KL: ℓ_t = Σ_v q_θ(v|s_t)[log q_θ(v|s_t) − log p(v|s_t)].

  Spec A1.1 (Thinking Machines / G-OPD per-token OPD, discount 0). Autodiff gives the exact gradient
  Σ_v q_θ(v)(log q_θ(v) − log p(v))∇log q_θ(v) (the "+1" term vanishes since Σ q∇log q = 0).
  Reads `student_logits_BTV` (differentiable) and `teacher_logits_BTV`; NOT `logp_BT`, so its
  gradient w.r.t. `logp_BT` is zero. Tiny vocabularies only: for real models the learner should use
  a chunked lm-head (hidden states × W_V, T-chunks under `jax.checkpoint`; a later optimisation).
  Element log-ratios are clamped to ±20, so a teacher zero where the student has mass costs q·20.
  On-policy: the per-state target does not depend on the behaviour policy at all; staleness only
  changes which states are visited (AsyncOPD: the weights q_θ(v) are the *current* student's).
  """
  lq, lp = dense_pair(inputs, hp.temperature)
  kl = core.apply_mask(kl_dense(lq, lp), inputs.mask_BT)
  return kl, {"kl_rev": core.metric(kl, inputs.mask_BT)}


registry.register("opd_reverse_kl_full", opd_reverse_kl_full, Hparams, needs=("student_logits", "teacher_logits"))
