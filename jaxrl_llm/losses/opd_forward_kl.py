"""OPD forward KL over the full vocabulary: KL(p ‖ π_θ) per state (teacher-weighted, mode-covering)."""

from __future__ import annotations

import dataclasses

from jaxrl_llm.losses import core, registry
from jaxrl_llm.losses.dense import divergence, kl_dense


@dataclasses.dataclass(frozen=True)
class Hparams:
  temperature: float = 1.0  # applied to both logits; logits usually arrive already at the sampler's T.


def opd_forward_kl(inputs, hp: Hparams):
  """Full-vocabulary forward KL: ℓ_t = Σ_v p(v|s_t)[log p(v|s_t) − log q_θ(v|s_t)].

  Spec A1.3; gradient −Σ_v p(v)∇log q_θ(v) (logits gradient q − p). Teacher entries with p = 0
  contribute exactly 0. Reads the student's (differentiable) and teacher's distributions, dense
  (`student_logits_BNV`, `teacher_logits_BNV`) or chunked (`student_head`, `teacher_head`: hidden
  states + lm-head, no [B, N, V] array; `losses.dense`), not `logp_BN` (its gradient w.r.t. `logp_BN`
  is zero). For a finite teacher cache use `opd_topk_kl`.
  AsyncOPD (A2): the weights p(v) do not depend on the student, so with stale rollouts only the state
  distribution is stale and the per-state target stays exact; this is why forward KL is robust.
  On-policy: identical to its off-policy form (no importance ratio, nothing depends on μ).
  """
  kl = core.apply_mask(divergence(inputs, lambda lq, lp: kl_dense(lp, lq), hp.temperature), inputs.mask_BN)
  return kl, {"kl_fwd": core.metric(kl, inputs.mask_BN)}


registry.register("opd_forward_kl", opd_forward_kl, Hparams, needs=("student_logits", "teacher_logits"))
