"""GSPO: clipped surrogate on the length-normalised (geometric-mean) sequence ratio."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = core.sg


@dataclasses.dataclass(frozen=True)
class Hparams:
  eps_low: float = 3e-4  # GSPO paper (sequence ratios live very close to 1).
  eps_high: float = 4e-4
  max_log_ratio: float = 10.0  # verl clamps log s_{i,t} <= 10 before exp.
  seq_advantage: bool = False  # True: replace Â_t by its masked sequence mean (AReaL).


def gspo_log_ratio(logp_BN, prox_logp_BN, mask_BN, max_log_ratio: float = 10.0):
  """GSPO-token log-ratio log s_{i,t} = sg(log s_i) + log π_θ(y_t) − sg(log π_θ(y_t)), clamped above.

  log s_i = (1/L_i) Σ_t m·log(π_θ/π_old) (0 for an empty sequence). The value equals log s_i at
  every token, while ∇ log s_{i,t} = ∇ log π_θ(y_t), so a seq-mean-token-mean of −Â_i·s_{i,t}
  has exactly the gradient of the sequence-level objective −Â_i·s_i.
  Returns (log s_{i,t} [B, N] clamped to ≤ max_log_ratio, log s_i [B] unclamped, detached).
  """
  lr = core.safe_log_ratio(logp_BN, prox_logp_BN, mask_BN)
  seq_lr_B = sg(core.seq_mean(lr, mask_BN))
  ok = core.valid(mask_BN, logp_BN, prox_logp_BN)
  lp = jnp.where(ok, logp_BN, 0.0).astype(jnp.float32)
  log_s = jnp.where(ok, core.broadcast_seq(seq_lr_B, lp) + lp - sg(lp), 0.0)
  return core.truncate(log_s, max_log_ratio), seq_lr_B


def gspo(inputs, hp: Hparams):
  """GSPO (GSPO-token form): ℓ_{i,t} = max(−Â·s_{i,t}, −Â·clip(s_{i,t}, 1−ε_l, 1+ε_r)).

  s_i = exp((1/L_i) Σ_t m·log(π_θ/π_old)) is the geometric-mean sequence ratio and
  s_{i,t} = sg(s_i)·π_θ(y_t)/sg(π_θ(y_t)) carries it to tokens, so a whole response is clipped or
  kept together. Empty sequences have s = 1 and are excluded by `reduce`.
  Paper: Zheng et al. 2025, "Group Sequence Policy Optimization" (ε_l = 3e-4, ε_r = 4e-4).
  Aggregation: use `seq-mean-token-mean` (verl forces it): with sequence-constant Â it recovers the
  paper's sequence objective exactly; other modes re-weight sequences by length.
  Convention: verl (per-token Â, log s_{i,t} clamped ≤ 10); `seq_advantage=True` uses the masked
  sequence mean of Â (AReaL), identical for outcome rewards.
  On-policy (π_θ = π_old): s = 1, nothing is clipped, and under seq-mean-token-mean the gradient is
  the vanilla PG gradient −Â·∇log π.
  """
  log_s, seq_lr_B = gspo_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, inputs.mask_BN, hp.max_log_ratio)
  ratio = jnp.exp(log_s)
  adv = inputs.adv_BN
  if hp.seq_advantage:
    adv = core.broadcast_seq(core.seq_advantage(adv, inputs.mask_BN), adv)
  loss, clipped = core.clipped_surrogate(ratio, adv, hp.eps_low, hp.eps_high)
  has_B = core.seq_len(inputs.mask_BN) > 0
  aux = {
      "clip_frac": core.metric(clipped, inputs.mask_BN),
      "seq_ratio_mean": core.seq_metric(jnp.exp(seq_lr_B), has_B),
      "seq_log_ratio_abs_max": (jnp.max(jnp.where(has_B, jnp.abs(seq_lr_B), 0.0)), jnp.ones(())),
  }
  return core.apply_mask(loss, inputs.mask_BN), aux


registry.register("gspo", gspo, Hparams, needs=("prox_logp",))
