"""AsyncOPD multi-sample Monte-Carlo reverse-KL estimator (N candidate tokens per position)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry


@dataclasses.dataclass(frozen=True)
class Hparams:
  # True: A_i = sg(log p(v_i) − log π_θ(v_i)) with π_θ from this learner forward (`mc_logp_BNJ`),
  # AsyncOPD's "recompute under the current student"; False: the baseline is μ (`mc_behavior_logp_BNJ`).
  online_advantage: bool = True  # async-opd MC example config (pg_online_advantage=true).
  eps_low: float = 1e6  # the MC example sets pg_clip_eps=1e6: effectively unclipped (clipping biases it).
  eps_high: float = 1e6


def _valid_BNJ(inputs):
  ok = inputs.mask_BN[..., None] > 0
  for x in (inputs.mc_logp_BNJ, inputs.mc_behavior_logp_BNJ, inputs.mc_teacher_logp_BNJ):
    ok = ok & jnp.isfinite(x)
  return ok & (inputs.mc_ids_BNJ >= 0)


def opd_reverse_kl_mc(inputs, hp: Hparams):
  """ℓ_t = (1/N_t) Σ_i PPO(ρ_i, A_i), ρ_i = π_θ(v_i)/μ(v_i), A_i = sg(log p(v_i) − log q_base(v_i)).

  AsyncOPD (arXiv 2606.24143), async-opd `multi_sample_policy_gradient_kl`: at rollout time each
  position stores N candidates `mc_ids_BNJ` (column 0 = the generated token, columns 1..N−1 drawn
  i.i.d. with replacement from μ; duplicates intended, never deduplicated), μ's log-probs at them and
  the teacher's. PPO(ρ, A) = max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high)); the default ε = 1e6 is unclipped.
  Inputs read: `mc_logp_BNJ` (log π_θ at the candidates, differentiable; with `online_advantage` it is
  also the advantage baseline, under stop-gradient), `mc_behavior_logp_BNJ` (log μ), `mc_teacher_logp_BNJ`.
  N_t counts valid candidates (finite log-probs, id ≥ 0). Unbiasedness (derivation, [GUESS]):
  E_{v~μ}[ρ(v)(log π_θ(v) − log p(v))∇log π_θ(v)] = ∇KL(π_θ‖p) at the *current* student despite a
  stale μ, when the advantage is online. Importance log-ratios are clamped to ±20 (monitor `ratio_ess`); the
  advantage is not (a clamp biased the estimator: experiments/opd_claims.py).
  `logp_BN` is not read (its column-0 twin lives in `mc_logp_BNJ`). If `tokens_BN` is present, the
  metric `mc_col0_match` checks that column 0 is the generated token.
  On-policy (μ = π_θ): ρ = 1 and the estimator is (1/N)Σ_i −(log p(v_i) − log π_θ(v_i))∇log π_θ(v_i),
  the N-sample score-function reverse-KL gradient.
  """
  mask = inputs.mask_BN
  ok = _valid_BNJ(inputs)
  zero = lambda x: jnp.where(ok, x.astype(jnp.float32), 0.0)  # double where: no -inf reaches arithmetic
  lq, lmu, lp = zero(inputs.mc_logp_BNJ), zero(inputs.mc_behavior_logp_BNJ), zero(inputs.mc_teacher_logp_BNJ)
  bound = core.LOG_RATIO_BOUND
  base = core.sg(lq) if hp.online_advantage else lmu
  adv = core.sg(jnp.where(ok, lp - base, 0.0))  # not clamped, as async-opd's (see `opd_reverse_kl`)
  lr = jnp.where(ok, jnp.clip(lq - lmu, -bound, bound), 0.0)
  surr, clipped = core.clipped_surrogate(jnp.exp(lr), adv, hp.eps_low, hp.eps_high)
  n = jnp.maximum(ok.sum(-1), 1).astype(jnp.float32)
  loss = jnp.where(ok, surr, 0.0).sum(-1) / n
  okf = ok.astype(jnp.float32)
  aux = {
      "mc_adv": ((okf * adv).sum(), okf.sum()),
      "mc_clip_frac": ((okf * clipped).sum(), okf.sum()),
      "mc_valid": core.metric(ok.mean(-1), mask),
      **core.ratio_diagnostics(lr.reshape(lr.shape[0], -1), ok.reshape(ok.shape[0], -1), "ratio"),
  }
  if inputs.tokens_BN is not None:
    aux["mc_col0_match"] = core.metric(inputs.mc_ids_BNJ[..., 0] == inputs.tokens_BN, mask)
  return core.apply_mask(loss, mask), aux


registry.register("opd_reverse_kl_mc", opd_reverse_kl_mc, Hparams, needs=("mc",))
