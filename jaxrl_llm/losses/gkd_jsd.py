"""GKD generalised Jensen–Shannon divergence between teacher and student, full vocabulary."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry
from jaxrl_llm.losses.dense import divergence, kl_dense


@dataclasses.dataclass(frozen=True)
class Hparams:
  # β, named for what it weights: M = β·p + (1−β)·q_θ (TRL's `beta`; EasyDeL uses the opposite convention).
  teacher_weight: float = 0.5  # TRL GKDConfig default.
  temperature: float = 1.0  # TRL scales both logits by its sampling temperature (0.9); we expect tempered logits.


def generalized_jsd(lq_BNV, lp_BNV, beta: float):
  """β·KL(p ‖ M) + (1−β)·KL(q ‖ M) per position from log q, log p; β = 0 / 1: forward / reverse KL."""
  if beta == 0.0:
    return kl_dense(lp_BNV, lq_BNV)
  if beta == 1.0:
    return kl_dense(lq_BNV, lp_BNV)
  lm = jnp.logaddexp(lp_BNV + math.log(beta), lq_BNV + math.log1p(-beta))
  return beta * kl_dense(lp_BNV, lm) + (1.0 - beta) * kl_dense(lq_BNV, lm)


def gkd_jsd(inputs, hp: Hparams):
  """Generalised JSD: ℓ_t = β·KL(p ‖ M) + (1−β)·KL(q_θ ‖ M), M = β·p + (1−β)·q_θ, β = teacher_weight.

  Paper: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
  Mistakes" (GKD, ICLR'24); convention of huggingface/trl `GKDTrainer.generalized_jsd_loss`.
  The mixture is formed in probability space, log M = logaddexp(log β + log p, log(1−β) + log q)
  (an old TRL mixed log-probs, a bug). Limits: JSD_β/β → KL(p‖q_θ) (forward) as β→0 and
  JSD_β/(1−β) → KL(q_θ‖p) (reverse) as β→1. Like TRL, β = 0 exactly returns the forward KL and β = 1
  the reverse KL (un-normalised; JSD itself would vanish there). The GKD data mix λ (fraction of
  student-generated sequences) is a data-pipeline choice, not part of this loss.
  Reads the student's (differentiable) and teacher's distributions, dense (`student_logits_BNV`,
  `teacher_logits_BNV`) or chunked (`student_head`, `teacher_head`; `losses.dense`), not `logp_BN`.
  On-policy: no importance ratio; the divergence is the same function of the current student at any
  staleness (only the visited states differ).
  """
  beta = hp.teacher_weight
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"loss.hparams.teacher_weight={beta} must be in [0, 1]")
  jsd = core.apply_mask(divergence(inputs, lambda lq, lp: generalized_jsd(lq, lp, beta), hp.temperature),
                        inputs.mask_BN)
  return jsd, {"jsd": core.metric(jsd, inputs.mask_BN)}


registry.register("gkd_jsd", gkd_jsd, Hparams, needs=("student_logits", "teacher_logits"))
