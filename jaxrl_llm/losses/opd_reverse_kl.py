"""OPD reverse KL on the sampled token: policy-gradient (advantage) form or a direct k-estimator loss."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

FORMS = ("advantage", "direct")


@dataclasses.dataclass(frozen=True)
class Hparams:
  form: str = "advantage"  # "advantage" (PG surrogate, the async-opd default) | "direct" (k-estimator loss).
  # Advantage baseline: False -> log μ (rollout-time student, async-opd `pg_online_advantage=False`);
  # True -> sg(log π_θ) recomputed by this learner forward (AsyncOPD's fix for stale reverse KL).
  online_advantage: bool = False
  importance_sampling: bool = True  # False: plain −A·log π_θ (no ratio, no clip).
  eps_low: float = 0.2  # async-opd pg_clip_eps; its MC example uses 1e6 (effectively unclipped).
  eps_high: float = 0.2
  # Decoupled variant: multiply by w = π_prox/μ, zeroed when w > cap (async-opd behave_imp_weight_cap).
  decoupled: bool = False
  behave_weight_cap: float = 5.0
  estimator: str = "k2"  # direct form only: "k1" | "k2" | "k3" (see the docstring for their gradients).


def opd_reverse_kl(inputs, hp: Hparams):
  """Sampled-token reverse KL(π_θ ‖ p), spec A1.2, in one of two forms.

  Advantage form (default): A_t = sg(log p(y_t) − log q_base(y_t)) with q_base = μ (`behavior_logp`)
  or, with `online_advantage`, sg(log π_θ(y_t)) from the current forward (AsyncOPD, arXiv 2606.24143);
  then the PPO surrogate ℓ_t = max(−A_t·r_t, −A_t·clip(r_t, 1−ε_low, 1+ε_high)), r = π_θ/π_prox
  (prox = μ when the run's old-logp strategy is "behavior", giving async-opd's ρ = π_θ/μ). With
  `decoupled`, ℓ_t is multiplied by sg(w_t), w = π_prox/μ, and tokens with w > cap are dropped
  (aux["keep_BN"]). Without `importance_sampling`: ℓ_t = −A_t·log π_θ(y_t).
  Direct form: ℓ_t = k(log π_θ(y_t), log p(y_t)), differentiated directly, no ratio. On tokens drawn
  from π_θ: k1 = log q − log p has an unbiased value but zero-mean gradient (diagnostic only);
  k2 = ½(log q − log p)² has gradient (log q − log p)∇log q = the reverse-KL gradient (same as the
  advantage form); k3 = p/q − 1 − log(p/q) has gradient (1 − p/q)∇log q whose mean is the *forward*
  KL gradient. Off-policy the direct form is uncorrected; prefer the advantage form.
  The reward log p/q is unbounded: importance ratios are clamped to ±20 in log space, the advantage is not.
  On-policy (μ = π_prox = π_θ): r = 1, nothing clipped, w = 1, gradient −(log p − log π_θ)·∇log π_θ,
  i.e. vanilla PG with advantage log p − log π_θ (k2 direct form: the same gradient).
  """
  if hp.form not in FORMS:
    raise ValueError(f"loss.hparams.form={hp.form!r}: must be one of {FORMS}")
  mask = inputs.mask_BN
  k1 = core.safe_log_ratio(inputs.logp_BN, inputs.teacher_logp_BN, mask)
  aux = {"opd_k1": core.metric(k1, mask),
         "opd_k3": core.metric(core.kl_estimate(inputs.logp_BN, inputs.teacher_logp_BN, mask, "k3"), mask)}
  if hp.form == "direct":
    loss = core.kl_estimate(inputs.logp_BN, inputs.teacher_logp_BN, mask, hp.estimator)
    return core.apply_mask(loss, mask), aux
  base = core.sg(inputs.logp_BN) if hp.online_advantage else inputs.behavior_logp_BN
  # The advantage is not clamped (async-opd's neither): a ±20 clamp biases the gradient wherever the teacher gives a
  # sampled token under e⁻²⁰ of the student's probability (experiments/opd_claims.py measured it: 2-9 % of the
  # tiny student's mass). It multiplies no exponential, so only non-finite values are zeroed.
  adv = core.sg(core.safe_log_ratio(inputs.teacher_logp_BN, base, mask, bound=jnp.inf))
  if hp.importance_sampling:
    lr = core.safe_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, mask)
    loss, clipped = core.clipped_surrogate(jnp.exp(lr), adv, hp.eps_low, hp.eps_high)
    aux.update(clip_frac=core.metric(clipped, mask), **core.ratio_diagnostics(lr, mask, "ratio"))
  else:
    loss = core.reinforce(adv, inputs.logp_BN, mask)
  aux["opd_adv"] = core.metric(adv, mask)
  if hp.decoupled:
    w = jnp.exp(core.safe_log_ratio(inputs.prox_logp_BN, inputs.behavior_logp_BN, mask))
    keep = (w <= hp.behave_weight_cap) & (mask > 0)
    loss = jnp.where(keep, core.sg(w) * loss, 0.0)
    aux["keep_BN"] = keep.astype(jnp.float32)
    aux["behave_drop_frac"] = core.metric(1.0 - keep, mask)
  return core.apply_mask(loss, mask), aux


registry.register("opd_reverse_kl", opd_reverse_kl, Hparams, needs=("teacher_logp", "prox_logp", "behavior_logp"))
