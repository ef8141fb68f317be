"""SDCC (MemoryWalker): task loss + self-distillation KL at eviction points of a compressed context."""

from __future__ import annotations

import dataclasses

from jaxrl_llm.losses import core, ppo_clip, registry
from jaxrl_llm.losses.dense import divergence, kl_dense


@dataclasses.dataclass(frozen=True)
class Hparams:
  kl_coef: float = 0.1  # λ: not reported by the paper [GUESS, spec range 0.1–1]; 0 = naive-compressed.
  task_weight: float = 1.0  # weight of the GRPO/PPO task term; 0 trains the consistency KL alone.
  eps_low: float = 0.2
  eps_high: float = 0.2
  temperature: float = 1.0


def sdcc(inputs, hp: Hparams):
  """SDCC (MemoryWalker, arXiv 2609.00865): ℓ_t = w_task·ℓ^PPO_t + λ·e_t·KL(sg π(·|live_t) ‖ π_θ(·|comp_t)).

  The student is the single forward over the compressed walk H_comp: `logp_BN` (for the task term,
  PPO-clip against `prox_logp_BN`, GRPO in the paper) and `student_logits_BNV` (differentiable) come
  from it. The teacher is the *same* policy under stop-gradient evaluated on the reconstructed live
  prefix H_comp[:ι] ⊕ E_k ⊕ H_comp[ι:p]: its logits are `teacher_logits_BNV`. e_t = `eviction_mask_BN`
  marks the diverging leaves C (see `jaxrl_llm.distill.memory_walker.eviction_points`). The KL is a
  forward KL, teacher first. The paper sums λ·KL over C; under `reduce` the sum is divided like every
  other token term (token-mean: by the number of loss tokens). λ = 0 is the naive-compressed baseline.
  Full vocabulary, dense logits or chunked `student_head` / `teacher_head` (`losses.dense`).
  On-policy (π_θ = π_prox): the task term is vanilla PG (ratio 1); the KL term does not read `logp_BN`,
  so the gradient w.r.t. `logp_BN` equals PG scaled by `task_weight`.
  """
  mask = inputs.mask_BN
  task_BN, aux = ppo_clip.ppo_clip(inputs, ppo_clip.Hparams(eps_low=hp.eps_low, eps_high=hp.eps_high))
  evict = (inputs.eviction_mask_BN > 0) & (mask > 0)
  kl = core.apply_mask(divergence(inputs, lambda lq, lp: kl_dense(lp, lq), hp.temperature), evict)
  aux.update(sdcc_kl=core.metric(kl, evict), eviction_frac=core.metric(evict, mask))
  return core.apply_mask(hp.task_weight * task_BN + hp.kl_coef * kl, mask), aux


registry.register("sdcc", sdcc, Hparams, needs=("prox_logp", "student_logits", "teacher_logits", "eviction"))
