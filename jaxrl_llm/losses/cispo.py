"""CISPO: REINFORCE with a clipped, detached importance weight (no token ever loses its gradient)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry


@dataclasses.dataclass(frozen=True)
class Hparams:
  # ε_low = 1 puts the lower bound at 0: no effective lower clip, as in the paper.
  eps_low: float = 1.0
  # Cap 1 + 0.2 = 1.2, the verl CISPO example (clip_ratio_high=0.2). The paper's value is not public;
  # DPPO's "PG-TIS (CISPO)" baselines use a cap C = 5 (eps_high = 4.0) at scale.
  eps_high: float = 0.2
  # The paper's general form: a PPO-style token mask M (A>0 & r>1+mask_eps_high or A<0 & r<1-mask_eps_low -> 0).
  token_mask: bool = False
  mask_eps_low: float = 0.2
  mask_eps_high: float = 0.2


def cispo(inputs, hp: Hparams):
  """CISPO: ℓ_t = −sg(clip(r, 1−ε_low, 1+ε_high))·Â·M_t·log π_θ, r = π_θ/π_old.

  Gradient: −clip(r)·Â·M·∇log π. Unlike PPO, a clipped token keeps its gradient, only its weight is
  capped. With `token_mask=True`, M_t = 0 for A>0 & r>1+mask_eps_high and for A<0 & r<1−mask_eps_low
  (the paper's general form, which recovers PPO's trust-region masking); `aux["keep_BN"]` is M.
  Paper: MiniMax-M1 (MiniMax 2025), token-mean aggregation over the batch.
  On-policy (r = 1): the coefficient is 1 and the gradient is exactly the vanilla PG gradient.
  """
  mask = inputs.mask_BN
  lr = core.safe_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, mask)
  ratio = jnp.exp(lr)
  weight = jnp.clip(ratio, 1.0 - hp.eps_low, 1.0 + hp.eps_high)
  adv = inputs.adv_BN
  keep = core.fmask(mask)
  if hp.token_mask:
    drop = ((adv > 0) & (ratio > 1.0 + hp.mask_eps_high)) | ((adv < 0) & (ratio < 1.0 - hp.mask_eps_low))
    keep = jnp.where(drop, 0.0, keep)
  loss = core.reinforce(weight * adv, inputs.logp_BN, keep)
  aux = {
      "clip_frac": core.metric((ratio > 1.0 + hp.eps_high) | (ratio < 1.0 - hp.eps_low), mask),
      **core.ratio_diagnostics(lr, mask, "ratio"),
  }
  if hp.token_mask:
    aux["keep_BN"] = keep
    aux["mask_frac"] = core.metric(1.0 - keep, mask)
  return core.apply_mask(loss, mask), aux


registry.register("cispo", cispo, Hparams, needs=("prox_logp",))
