"""Full-vocabulary divergences between student and teacher, from dense logits or chunk by chunk.

A full-distribution distillation loss (opd_forward_kl, opd_reverse_kl_full, gkd_jsd, sdcc) is a
per-position function `div_fn(log q_θ, sg log p) -> [...]` of the two sanitised log-softmaxes over the
vocabulary. `divergence` evaluates it on either input form of `LossInputs`:
  - dense: `student_logits_BNV` / `teacher_logits_BNV` (tiny vocabularies, tests, notebooks);
  - chunked: `student_head` / `teacher_head` (`vocab_chunks.VocabHead`: hidden states + lm-head), what
    the learner and the teacher scorer provide. The [B, C, V] logits of both models are formed C
    positions at a time under `jax.checkpoint` (the backward pass recomputes them per chunk), so no
    [B, N, V] array exists at a real vocabulary. Values and gradients equal the dense form.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core
from jaxrl_llm.vocab_chunks import chunk_positions, head_logits, map_time_chunks

Array = jax.Array

# Finite stand-in for a -inf logit: exp underflows to exactly 0 and no inf - inf (NaN) can appear.
NEG_LOGIT = -1e30


def dense_logp(logits_BNV: Array, mask_BN: Array, temperature: float = 1.0) -> Array:
  """float32 log_softmax(logits / T); non-finite logits -> NEG_LOGIT, masked rows -> uniform (double-where)."""
  z = logits_BNV.astype(jnp.float32)
  z = jnp.where(jnp.isfinite(z), z / temperature, NEG_LOGIT)
  z = jnp.where(mask_BN[..., None] > 0, z, 0.0)
  return jax.nn.log_softmax(z, axis=-1)


def kl_dense(la_BNV: Array, lb_BNV: Array, bound: float = core.LOG_RATIO_BOUND) -> Array:
  """KL(a ‖ b) = Σ_v a_v (log a_v − log b_v) per position, each log-ratio clamped to ±bound.

  Entries with a_v = 0 contribute exactly 0; b_v = 0 where a_v > 0 contributes a_v·bound instead of ∞.
  """
  d = jnp.clip(la_BNV - lb_BNV, -bound, bound)
  return jnp.sum(jnp.exp(la_BNV) * d, axis=-1)


def logp_pair(student_logits_BNV: Array, teacher_logits_BNV: Array, mask_BN: Array, temperature: float):
  """(log q_θ, sg log p) over the vocabulary, sanitised; the teacher never carries gradient."""
  lq = dense_logp(student_logits_BNV, mask_BN, temperature)
  lp = jax.lax.stop_gradient(dense_logp(teacher_logits_BNV, mask_BN, temperature))
  return lq, lp


def divergence(inputs, div_fn: Callable[[Array, Array], Array], temperature: float, *,
               chunk_size: int = 256) -> Array:
  """Per-token `div_fn(log q_θ, sg log p)` [B, N] (unmasked: callers apply their mask).

  Dense logits when `inputs` carries them, else `student_head` and `teacher_head` chunk by chunk
  (at most `chunk_size` positions, and B·C·V no more than either head's `max_chunk_elements`; see
  `vocab_chunks.chunk_positions`). The student's hidden states and lm-head receive gradient; the
  teacher's none.
  """
  mask_BN = inputs.mask_BN
  if inputs.student_logits_BNV is not None and inputs.teacher_logits_BNV is not None:
    return div_fn(*logp_pair(inputs.student_logits_BNV, inputs.teacher_logits_BNV, mask_BN, temperature))
  sh, th = inputs.student_head, inputs.teacher_head
  if sh is None or th is None:
    raise ValueError("a full-distribution loss needs student_logits_BNV and teacher_logits_BNV, or student_head "
                     "and teacher_head (hidden states + lm-head)")
  if sh.w_DV.shape[-1] != th.w_DV.shape[-1]:
    raise ValueError(f"student_head vocabulary {sh.w_DV.shape[-1]} != teacher_head vocabulary {th.w_DV.shape[-1]}")
  B, N = mask_BN.shape
  C = chunk_positions(B, N, sh.w_DV.shape[-1], chunk_size, min(sh.max_chunk_elements, th.max_chunk_elements))
  t_h = jax.lax.stop_gradient(th.hidden_BND)

  def chunk(ws, hq_BCD, hp_BCD, mask_BC):
    wq_DV, wp_DV = ws
    # Masked rows: hidden states -> 0 before the matmul (double-where), so padding that holds
    # non-finite values cannot reach the lm-head's gradient.
    live_BC1 = mask_BC[..., None] > 0
    hq_BCD, hp_BCD = jnp.where(live_BC1, hq_BCD, 0), jnp.where(live_BC1, hp_BCD, 0)
    zq = head_logits(hq_BCD, wq_DV, sh.temperature)
    zp = head_logits(hp_BCD, wp_DV, th.temperature)
    return div_fn(*logp_pair(zq, zp, mask_BC, temperature))

  return map_time_chunks(chunk, (sh.w_DV, jax.lax.stop_gradient(th.w_DV)), (sh.hidden_BND, t_h, mask_BN), C)
