"""Shadow Mask Distillation (SMD): RL with a KV-compressed sampler against a dense learner."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry
from jaxrl_llm.losses.dense import divergence, kl_dense

sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class Hparams:
  kl_coef: float = 0.1  # λ of Track 2 (reference `shadow_distill_lambda` = 0.1; spec B10). 0 = Track 1 alone.
  eps_low: float = 0.2  # PPO clip of Track 1 (reference: slime's eps_clip, 0.2, symmetric).
  eps_high: float = 0.2
  dual_clip: Optional[float] = None


def smd(inputs, hp: Hparams):
  """SMD (arXiv 2605.06850, spec B10; that it is the KV-compression paper of the seeds is the spec's [GUESS]):
  ℓ_t = PPO-clip(π_shadow / μ) + λ·KL(π_dense(·|s_t) ‖ sg π_shadow(·|s_t)).

  π_shadow is the learner's forward under the sampler's KV visibility mask (`shadow_logp_BN`, `shadow_head`:
  `learner.completion_logprobs(kv_window_B2=...)`, built from the recorded sinks + window), π_dense the usual
  full-context forward (`student_head`). Track 1 trains π_shadow with the PPO-clip surrogate whose anchor is μ,
  the sampler's own log-probs: μ *is* π_shadow at the behaviour version (same keys seen, tested), so the ratio is
  on-policy up to staleness, which the clip bounds (the reference's `use_rollout_logprobs`). Track 2 is the full-
  vocabulary KL from the dense forward to the stopped shadow forward on every response token: its gradient
  reaches only the dense forward, which learns to act like the compressed policy. Both forwards share θ.
  The dense `logp_BN` and `prox_logp_BN` are not read (metrics only).
  Differences from the released code [code: huthvincent/RL-Post-Training-with-KV-Cache-Compression
  `SMD/src/shadow_distillation_loss.py`]: it has one (dense) forward, so it restricts Track 1 to tokens its
  mask marks as compressed and replaces Track 2 by |log π_dense − log μ| on the sampled token; here both
  forwards run (the spec's "faithful" version), Track 1 covers every response token (the shadow forward is
  exact for all of them) and Track 2 is the full KL. The spec's retention 0.5 / SnapKV selection is not
  implemented: the compressed cache is sinks + a sliding window (`sampler.kv_sinks`, `sampler.kv_window`).
  int8 caches have no shadow mask (the mismatch is numerical, not a visibility pattern): refused by config.
  On-policy (π_shadow = μ): ratio 1, no clipping, and ∂ℓ/∂log π_shadow = −Â (vanilla PG); with λ = 0 the
  loss ignores the dense forward; ∂ KL/∂z_dense = q ⊙ (log q − log p − KL) per position (q dense, p shadow).
  """
  mask = inputs.mask_BN
  lr = core.safe_log_ratio(inputs.shadow_logp_BN, sg(inputs.behavior_logp_BN), mask)
  surr, clipped = core.clipped_surrogate(jnp.exp(lr), inputs.adv_BN, hp.eps_low, hp.eps_high, hp.dual_clip)
  kl = divergence(inputs.replace(teacher_head=inputs.shadow_head, teacher_logits_BNV=None), kl_dense, 1.0)
  kl = core.apply_mask(kl, mask)
  # How far the dense learner is from μ on the sampled token (the bias SMD removes from the PG track).
  dense_mu = jnp.abs(core.safe_log_ratio(sg(inputs.logp_BN), sg(inputs.behavior_logp_BN), mask))
  aux = {"clip_frac": core.metric(clipped, mask), "smd_kl": core.metric(kl, mask),
         "smd_dense_mu_abs": core.metric(dense_mu, mask), **core.ratio_diagnostics(lr, mask, "shadow_ratio")}
  return core.apply_mask(surr + hp.kl_coef * kl, mask), aux


registry.register("smd", smd, Hparams, needs=("behavior_logp", "shadow"))
