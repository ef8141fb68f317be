"""GKD generalised Jensen–Shannon divergence between teacher and student, full vocabulary."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry
from jaxrl_llm.losses.opd_reverse_kl_full import dense_pair, kl_dense


@dataclasses.dataclass(frozen=True)
class Hparams:
  # β, named for what it weights: M = β·p + (1−β)·q_θ (TRL's `beta`; EasyDeL uses the opposite convention).
  teacher_weight: float = 0.5  # TRL GKDConfig default.
  temperature: float = 1.0  # TRL scales both logits by its sampling temperature (0.9); we expect tempered logits.


def gkd_jsd(inputs, hp: Hparams):
  """Generalised JSD: ℓ_t = β·KL(p ‖ M) + (1−β)·KL(q_θ ‖ M), M = β·p + (1−β)·q_θ, β = teacher_weight.

  Paper: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
  Mistakes" (GKD, ICLR'24); convention of huggingface/trl `GKDTrainer.generalized_jsd_loss`.
  The mixture is formed in probability space, log M = logaddexp(log β + log p, log(1−β) + log q)
  (an old TRL mixed log-probs, a bug). Limits: JSD_β/β → KL(p‖q_θ) (forward) as β→0 and
  JSD_β/(1−β) → KL(q_θ‖p) (reverse) as β→1. Like TRL, β = 0 exactly returns the forward KL and β = 1
  the reverse KL (un-normalised; JSD itself would vanish there). The GKD data mix λ (fraction of
  student-generated sequences) is a data-pipeline choice, not part of this loss.
  Reads `student_logits_BTV` (differentiable) and `teacher_logits_BTV`, not `logp_BT`.
  On-policy: no importance ratio; the divergence is the same function of the current student at any
  staleness (only the visited states differ).
  """
  beta = hp.teacher_weight
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"loss.hparams.teacher_weight={beta} must be in [0, 1]")
  lq, lp = dense_pair(inputs, hp.temperature)
  if beta == 0.0:
    jsd = kl_dense(lp, lq)
  elif beta == 1.0:
    jsd = kl_dense(lq, lp)
  else:
    lm = jnp.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
    jsd = beta * kl_dense(lp, lm) + (1.0 - beta) * kl_dense(lq, lm)
  jsd = core.apply_mask(jsd, inputs.mask_BT)
  return jsd, {"jsd": core.metric(jsd, inputs.mask_BT)}


registry.register("gkd_jsd", gkd_jsd, Hparams, needs=("student_logits", "teacher_logits"))
