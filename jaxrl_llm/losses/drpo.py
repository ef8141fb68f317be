"""DRPO: DPPO's binary-TV geometry as a smooth, advantage-weighted quadratic penalty on r = π_θ/μ."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = core.sg


@dataclasses.dataclass(frozen=True)
class Hparams:
  # Quoted from the UniRL code ("For SPO and DRPO, we set the regularization threshold to 12.5").
  # Unit puzzle: with ε = 12.5 and |π−μ| ≤ 1 the weight stays in [0.92, 1.08], so the regulariser is
  # almost inert; values around 0.15–0.2 (DPPO's δ_TV) make the boundary reachable. Unverified.
  eps: float = 12.5
  mu_weighted: bool = True  # False drops the μ factor: SPO's penalty (r−1)²/(2ε)
  variant: str = "smooth"  # "smooth": surrogate form; "eff": detached coefficients on an effective ratio
  eff_clip_low: float = 0.1  # "eff": r_e = clip(r, eff_clip_low, eff_clip_high)
  eff_clip_high: float = 2.0


_VARIANTS = ("smooth", "eff")


def drpo_weight(adv_BN, ratio_BN, coef_BN, eps):
  """w = 1 − sign(Â)·c·(r−1)/ε; with c = μ this is 1 − sign(Â(r−1))·|π−μ|/ε. ∇ℓ = −r·Â·w·∇log π."""
  return 1.0 - jnp.sign(adv_BN) * coef_BN * (ratio_BN - 1.0) / eps


def drpo(inputs, hp: Hparams):
  """DRPO: ℓ_t = −Â·r + |Â|·c·(r−1)²/(2ε), r = π_θ/μ (clamped log-ratio), c = μ (or 1: SPO).

  Gradient −r·Â·w·∇log π with w_t = 1 − sign(Â(r−1))·|π−μ|/ε ∈ [1−1/ε, 1+1/ε]: the penalty only
  damps updates that move π away from μ in the advantage's direction; w reaches 0 at |π−μ| = ε and
  turns corrective beyond. `variant="eff"`: ℓ = sg(−Â·r_e + |Â|·c·r_e·(r_e−1)/ε)·log π_θ with
  r_e = clip(r, 0.1, 2.0), i.e. the same weight on a bounded effective ratio, in REINFORCE form.
  Anchor μ = `behavior_logp` (no recompute), like DPPO. Advantages mean-only in the paper; the UniRL
  recipe aggregates seq-mean-token-sum-norm. Paper: arXiv 2606.09821; code Tencent-Hunyuan/UniRL.
  On-policy (π_θ = μ): r = 1, w = 1: the vanilla PG gradient.
  """
  if hp.variant not in _VARIANTS:
    raise ValueError(f"loss.hparams.variant={hp.variant!r}: must be one of {_VARIANTS}")
  mask = inputs.mask_BN
  adv = inputs.adv_BN
  lr = core.safe_log_ratio(inputs.logp_BN, inputs.behavior_logp_BN, mask)
  ratio = jnp.exp(lr)
  ok = core.valid(mask, inputs.behavior_logp_BN)
  mu = jnp.exp(jnp.minimum(jnp.where(ok, inputs.behavior_logp_BN, 0.0), 0.0).astype(jnp.float32))
  coef = mu if hp.mu_weighted else jnp.ones_like(mu)
  if hp.variant == "smooth":
    loss = -adv * ratio + jnp.abs(adv) * coef * jnp.square(ratio - 1.0) / (2.0 * hp.eps)
    w = drpo_weight(adv, sg(ratio), coef, hp.eps)
  else:
    r_e = jnp.clip(sg(ratio), hp.eff_clip_low, hp.eff_clip_high)
    w = drpo_weight(adv, r_e, coef, hp.eps)
    loss = core.reinforce(r_e * adv * w, inputs.logp_BN, mask)
  aux = {
      "drpo_weight": core.metric(w, mask),
      "drpo_corrective_frac": core.metric(w < 0, mask),
      **core.ratio_diagnostics(lr, mask, "ratio"),
  }
  return core.apply_mask(loss, mask), aux


registry.register("drpo", drpo, Hparams, needs=("behavior_logp",))
