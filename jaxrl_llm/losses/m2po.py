"""M2PO: bound the batch second moment of log-ratios by masking (paper) or adaptive clipping (code)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = core.sg


@dataclasses.dataclass(frozen=True)
class Hparams:
  variant: str = "paper"  # "paper": mask the largest-M2 tokens; "code": released code's adaptive PPO clip.
  m2_budget: float = 0.04  # τ_M2 (M2PO train scripts; AReaL gsm8k_m2po.yaml).
  # Ratio denominator: "prox" = learner-side π_old (the training-engine logp at rollout version, which is
  # what M2PO's "old" is), "behavior" = μ from the sampler.
  anchor: str = "prox"
  # "code" variant only: floors on the adaptive clip radii, the reference's `miniclip_low` / `miniclip_high`
  # (`if clip_high < miniclip_high: clip_high = miniclip_high`, likewise low): each radius is widened to
  # at least this value. The released training scripts leave both unset, so None (no floor) is the default.
  min_eps_low: Optional[float] = None
  min_eps_high: Optional[float] = None


_VARIANTS = ("paper", "code")
_ANCHORS = ("prox", "behavior")


def m2_keep_mask(m2_BN, active_BN, budget):
  """Keeps all but the k largest-M2 active tokens, k minimal such that the kept mean M2 < budget.

  If no k qualifies, keeps only the single smallest-M2 token. Jittable: sort (masked entries last),
  then suffix means from a reversed cumsum. Ties are broken by position (stable sort).
  """
  active = active_BN.reshape(-1) > 0
  x = jnp.where(active, m2_BN.reshape(-1).astype(jnp.float32), -jnp.inf)
  order = jnp.argsort(-x, stable=True)  # descending; masked (-inf) sort last
  xs = x[order]
  n = active.sum()
  idx = jnp.arange(x.shape[0])
  in_set = idx < n
  suffix = jnp.cumsum(jnp.where(in_set, xs, 0.0)[::-1])[::-1]
  mean_rest = suffix / jnp.maximum(n - idx, 1)
  ok = in_set & (mean_rest < budget)
  k = jnp.where(ok.any(), jnp.argmax(ok), jnp.maximum(n - 1, 0))
  rank = jnp.zeros_like(idx).at[order].set(idx)
  return (active & (rank >= k)).reshape(m2_BN.shape).astype(jnp.float32)


def m2_clip_tau(delta_sq_BN, harmful_BN, budget):
  """The released code's threshold: τ with τ² the largest breakpoint v_(k−1) such that capping the
  harmful tokens' Δ² at v_(k−1) keeps their total < budget·n; τ = 0 if even the smallest breakpoint
  is too large, and τ = +inf when the harmful mean is already ≤ budget (no constraint)."""
  harm = harmful_BN.reshape(-1) > 0
  v = jnp.where(harm, delta_sq_BN.reshape(-1).astype(jnp.float32), jnp.inf)
  vs = jnp.sort(v)
  n = harm.sum()
  idx = jnp.arange(v.shape[0])
  in_set = idx < n
  vs0 = jnp.where(in_set, vs, 0.0)
  total = vs0.sum()
  target = budget * n
  capped = jnp.cumsum(vs0) + vs0 * (n - idx - 1)  # Σ_j min(v_j, v_k)
  k = jnp.argmax(in_set & (capped >= target))
  tau2 = jnp.where(k > 0, vs0[jnp.maximum(k - 1, 0)], 0.0)
  need = (n > 0) & (total > target)
  return jnp.where(need, jnp.sqrt(tau2), jnp.inf)


def m2po(inputs, hp: Hparams):
  """M2PO (Second-Moment Trust Policy Optimization), two variants.

  "paper" (paper / AReaL form): M2_t = sg(log r_t)², r = π_θ/π_anchor. Sort the active tokens by M2 and
  mask the top k, k minimal such that the mean M2 of the rest is < τ (keep ≥ 1 token); then
  ℓ_t = −M_t·r_t·Â_t with no clipping (the AReaL docs write a sequence ratio; we read it as token-level).
  `aux["keep_BN"]` = M. AReaL instead computes M2 from (log μ − log π_prox)² and keeps its PPO loss.
  "code" (Infini-AI-Lab/M2PO compute_m2po_policy_loss): over harmful tokens only ((Â>0 & r>1) or
  (Â<0 & r<1)), find τ such that capping Δ² = (log r)² at τ² meets the budget; then PPO-clip every
  token with radii ε_low = max(1−e^{−τ}, min_eps_low) and ε_high = max(e^{τ}−1, min_eps_high); the floors
  are the reference's `miniclip_low` / `miniclip_high` (unset, i.e. None, in its training scripts).
  Both statistics are per call, i.e. per micro-batch, as in the official code.
  Paper: Zheng et al., "Prosperity before Collapse" (arXiv 2510.01161). Stale by ≥256 updates, stable.
  Advantage sign for the harmful test: masked sequence mean (the code reads adv[:, 0]).
  On-policy (r = 1): M2 = 0, nothing masked ("paper") / τ = inf, no clip binds ("code"); the gradient is
  the vanilla PG gradient −Â·∇log π.
  """
  if hp.variant not in _VARIANTS:
    raise ValueError(f"loss.hparams.variant={hp.variant!r}: must be one of {_VARIANTS}")
  if hp.anchor not in _ANCHORS:
    raise ValueError(f"loss.hparams.anchor={hp.anchor!r}: must be one of {_ANCHORS}")
  mask = inputs.mask_BN
  den = inputs.prox_logp_BN if hp.anchor == "prox" else inputs.behavior_logp_BN
  lr = core.safe_log_ratio(inputs.logp_BN, den, mask)
  ratio = jnp.exp(lr)
  m2 = jnp.square(sg(lr))
  adv = inputs.adv_BN
  aux = {"m2": core.metric(m2, mask), **core.ratio_diagnostics(lr, mask, "ratio")}
  if hp.variant == "paper":
    keep = m2_keep_mask(m2, mask, hp.m2_budget)
    loss = core.apply_mask(-adv * ratio, keep)
    aux.update(keep_BN=keep, mask_frac=core.metric(1.0 - keep, mask), m2_kept=core.metric(m2, keep))
    return loss, aux
  seq_adv = core.broadcast_seq(core.seq_advantage(adv, mask), adv)
  harmful = (mask > 0) & (((seq_adv > 0) & (lr > 0)) | ((seq_adv < 0) & (lr < 0)))
  tau = m2_clip_tau(m2, harmful, hp.m2_budget)
  eps_low = 1.0 - jnp.exp(-tau)
  eps_high = jnp.exp(tau) - 1.0
  if hp.min_eps_low is not None:
    eps_low = jnp.maximum(eps_low, hp.min_eps_low)
  if hp.min_eps_high is not None:
    eps_high = jnp.maximum(eps_high, hp.min_eps_high)
  loss, clipped = core.clipped_surrogate(ratio, adv, eps_low, eps_high)
  one = jnp.ones(())
  aux.update(clip_frac=core.metric(clipped, mask), m2_harmful=core.metric(m2, harmful),
             eps_low=(eps_low, one), eps_high=(eps_high, one))
  return core.apply_mask(loss, mask), aux


registry.register("m2po", m2po, Hparams, needs=("prox_logp", "behavior_logp"))
