"""OPD reverse KL over the full vocabulary: KL(π_θ ‖ p) per state (student-weighted, mode-seeking)."""

from __future__ import annotations

import dataclasses

from jaxrl_llm.losses import core, registry
from jaxrl_llm.losses.dense import divergence, kl_dense


@dataclasses.dataclass(frozen=True)
class Hparams:
  temperature: float = 1.0  # applied to both logits; logits usually arrive already at the sampler's T.


def opd_reverse_kl_full(inputs, hp: Hparams):
  """Full-vocabulary reverse KL: ℓ_t = Σ_v q_θ(v|s_t)[log q_θ(v|s_t) − log p(v|s_t)].

  Spec A1.1 (Thinking Machines / G-OPD per-token OPD, discount 0). Autodiff gives the exact gradient
  Σ_v q_θ(v)(log q_θ(v) − log p(v))∇log q_θ(v) (the "+1" term vanishes since Σ q∇log q = 0).
  Reads the student's (differentiable) and teacher's distributions, dense (`student_logits_BNV`,
  `teacher_logits_BNV`) or chunked from hidden states and lm-heads (`student_head`, `teacher_head`,
  see `losses.dense`: no [B, N, V] array); NOT `logp_BN`, so its gradient w.r.t. `logp_BN` is zero.
  Element log-ratios are clamped to ±20, so a teacher zero where the student has mass costs q·20.
  On-policy: the per-state target does not depend on the behaviour policy at all; staleness only
  changes which states are visited (AsyncOPD: the weights q_θ(v) are the *current* student's).
  """
  kl = core.apply_mask(divergence(inputs, lambda lq, lp: kl_dense(lq, lp), hp.temperature), inputs.mask_BN)
  return kl, {"kl_rev": core.metric(kl, inputs.mask_BN)}


registry.register("opd_reverse_kl_full", opd_reverse_kl_full, Hparams, needs=("student_logits", "teacher_logits"))
