"""DPPO: trust region by a direct divergence estimate between π_θ and the rollout policy μ."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = core.sg
_EPS = 1e-8  # inside the logs of the binary / top-k KL, as in Stable-RL


@dataclasses.dataclass(frozen=True)
class Hparams:
  divergence: str = "binary_tv"  # "binary_tv" | "binary_kl"
  delta_tv: float = 0.15  # verl DPPO script / paper LoRA runs (0.2 in the paper's scaling runs)
  delta_kl: float = 0.05
  ratio_cap: float = 5.0  # C in sg(min(π_θ/μ, C)): the paper's scaling default (verl uses 20 / 10000)
  # Anchor of the ratio and the divergence mask: "behavior" = μ (paper, released code, verl bypass mode);
  # "prox" = the recomputed π_old (verl's dppo_tv/kl "recompute" form).
  anchor: str = "behavior"


_ANCHORS = ("behavior", "prox")


@dataclasses.dataclass(frozen=True)
class TopkHparams:
  divergence: str = "topk_tv"  # "topk_tv" | "topk_kl"
  delta_tv: float = 0.15
  delta_kl: float = 0.05
  ratio_cap: float = 5.0
  # LossInputs carries no sampled-token ids, so "sampled token ∈ μ's top-k" is detected by matching
  # both its μ and π log-probs against the top-k entries (exact when computed from the same logits).
  member_atol: float = 1e-5


def _probs(logp_BN, behav_BN, mask_BN):
  """Detached (π, μ, valid) of the sampled token from sanitised, ≤ 0 log-probs."""
  lp, lb, ok = _logps(logp_BN, behav_BN, mask_BN)
  return jnp.exp(lp), jnp.exp(lb), ok


def _logps(logp_BN, behav_BN, mask_BN):
  ok = core.valid(mask_BN, logp_BN, behav_BN)
  lp = jnp.minimum(jnp.where(ok, sg(logp_BN), 0.0).astype(jnp.float32), 0.0)
  lb = jnp.minimum(jnp.where(ok, behav_BN, 0.0).astype(jnp.float32), 0.0)
  return lp, lb, ok


def binary_tv(p_BN, mu_BN):
  """TV between the two-bucket distributions {y_t, rest}: |π − μ|."""
  return jnp.abs(p_BN - mu_BN)


def binary_kl(p_BN, mu_BN):
  """KL(μ‖π) between the two-bucket distributions {y_t, rest}, +1e-8 inside the logs."""
  return (mu_BN * (jnp.log(mu_BN + _EPS) - jnp.log(p_BN + _EPS))
          + (1.0 - mu_BN) * (jnp.log(1.0 - mu_BN + _EPS) - jnp.log(1.0 - p_BN + _EPS)))


def topk_buckets(inputs, atol):
  """(π, μ) over K+2 buckets: μ's top-K ids, the sampled token if outside them, and "other" [B, N, k+2]."""
  fin = lambda x: jnp.where(jnp.isfinite(x), x.astype(jnp.float32), -jnp.inf)
  mu_k = jnp.exp(jnp.minimum(fin(inputs.behavior_topk_logp_BNk), 0.0))
  p_k = jnp.exp(jnp.minimum(fin(sg(inputs.topk_logp_BNk)), 0.0))
  lp_s, lb_s, _ = _logps(inputs.logp_BN, inputs.behavior_logp_BN, inputs.mask_BN)
  p_s, mu_s = jnp.exp(lp_s), jnp.exp(lb_s)
  member = ((jnp.abs(fin(inputs.behavior_topk_logp_BNk) - lb_s[..., None]) <= atol)
            & (jnp.abs(fin(sg(inputs.topk_logp_BNk)) - lp_s[..., None]) <= atol)).any(-1)
  p_s = jnp.where(member, 0.0, p_s)
  mu_s = jnp.where(member, 0.0, mu_s)
  p_o = jnp.maximum(1.0 - p_k.sum(-1) - p_s, 0.0)
  mu_o = jnp.maximum(1.0 - mu_k.sum(-1) - mu_s, 0.0)
  p = jnp.concatenate([p_k, p_s[..., None], p_o[..., None]], -1)
  mu = jnp.concatenate([mu_k, mu_s[..., None], mu_o[..., None]], -1)
  return p, mu


def topk_tv(p_BNk, mu_BNk):
  return 0.5 * jnp.abs(p_BNk - mu_BNk).sum(-1)


def topk_kl(p_BNk, mu_BNk):
  return (mu_BNk * (jnp.log(mu_BNk + _EPS) - jnp.log(p_BNk + _EPS))).sum(-1)


def dppo_keep_mask(adv_BN, p_BN, mu_BN, div_BN, delta, mask_BN):
  """M_t = 0 iff (Â>0 & π>μ & D>δ) or (Â<0 & π<μ & D>δ): only updates moving further out are masked."""
  far = div_BN > delta
  drop = ((adv_BN > 0) & (p_BN > mu_BN) & far) | ((adv_BN < 0) & (p_BN < mu_BN) & far)
  return jnp.where(drop, 0.0, core.fmask(mask_BN))


def _dppo_loss(inputs, div_BN, delta, ratio_cap, p_BN, mu_BN, anchor_BN):
  mask = inputs.mask_BN
  keep = dppo_keep_mask(inputs.adv_BN, p_BN, mu_BN, div_BN, delta, mask)
  lr = core.safe_log_ratio(inputs.logp_BN, anchor_BN, mask)
  w = core.truncate(jnp.exp(lr), ratio_cap)
  loss = core.reinforce(w * inputs.adv_BN, inputs.logp_BN, keep)
  aux = {
      "keep_BN": keep,
      "mask_frac": core.metric(1.0 - keep, mask),
      "divergence": core.metric(div_BN, mask),
      "divergence_max": core.max_metric(div_BN, mask),
      "ratio_capped_frac": core.metric(jnp.exp(lr) > ratio_cap, mask),
      **core.ratio_diagnostics(lr, mask, "ratio"),
  }
  return core.apply_mask(loss, keep), aux


_BINARY = {"binary_tv": binary_tv, "binary_kl": binary_kl}
_TOPK = {"topk_tv": topk_tv, "topk_kl": topk_kl}


def _delta(hp):
  return hp.delta_tv if hp.divergence.endswith("_tv") else hp.delta_kl


def dppo(inputs, hp: Hparams):
  """DPPO (binary divergences): ℓ_t = −Â·sg(min(π_θ/μ, C))·M_t·log π_θ (the released code's form).

  M_t masks a token only when its update would move π_θ further from μ than δ in divergence D:
  (Â>0 & π>μ & D>δ) or (Â<0 & π<μ & D>δ). Binary-TV: D = |π−μ| on sampled-token probabilities;
  Binary-KL: D = μ log(μ/π) + (1−μ) log((1−μ)/(1−π)). Ratio clipping over-penalises rare tokens and
  under-penalises high-probability ones; a divergence mask does not.
  Anchor: μ = `behavior_logp` (the rollout log-probs), NOT a recomputed π_old. This is the paper's key
  finding (a recomputed anchor lets the train/infer mismatch grow) and saves the recompute. verl's
  dppo_tv/kl use the recomputed old_log_prob unless in bypass mode: `anchor="prox"` gives that form
  (π_old = `prox_logp` replaces μ in both the ratio and the mask; default "behavior").
  Paper: "Rethinking the Trust Region in LLM RL" (arXiv 2602.04879); code sail-sg/Stable-RL.
  Advantages are mean-only (no std) in the paper; verl's script aggregates seq-mean-token-sum-norm.
  On-policy (π_θ = μ): D = 0, nothing masked, weight 1: the vanilla PG gradient.
  """
  if hp.divergence not in _BINARY:
    raise ValueError(f"loss.hparams.divergence={hp.divergence!r}: must be one of {sorted(_BINARY)}")
  if hp.anchor not in _ANCHORS:
    raise ValueError(f"loss.hparams.anchor={hp.anchor!r}: must be one of {_ANCHORS}")
  anchor = inputs.behavior_logp_BN if hp.anchor == "behavior" else inputs.prox_logp_BN
  if anchor is None:
    raise ValueError("loss.hparams.anchor='prox' needs LossInputs.prox_logp_BN (the recomputed π_old)")
  p, mu, ok = _probs(inputs.logp_BN, anchor, inputs.mask_BN)
  div = jnp.where(ok, _BINARY[hp.divergence](p, mu), 0.0)
  return _dppo_loss(inputs, div, _delta(hp), hp.ratio_cap, p, mu, anchor)


def dppo_topk(inputs, hp: TopkHparams):
  """DPPO with a top-K divergence: D over μ's top-K tokens + the sampled token + an "other" bucket.

  Same loss and mask rule as `dppo` (anchor μ); D is TV = ½Σ_b|π_b − μ_b| or KL(μ‖π) = Σ_b μ_b log(μ_b/π_b)
  over the K+2 buckets (the sampled-token bucket is empty when it is already among the top K).
  Needs μ's top-K ids/log-probs from the sampler (K = 20 is the vLLM limit) and π_θ at those ids.
  On-policy: D = 0, the vanilla PG gradient.
  """
  if hp.divergence not in _TOPK:
    raise ValueError(f"loss.hparams.divergence={hp.divergence!r}: must be one of {sorted(_TOPK)}")
  p, mu, ok = _probs(inputs.logp_BN, inputs.behavior_logp_BN, inputs.mask_BN)
  pb, mub = topk_buckets(inputs, hp.member_atol)
  div = jnp.where(ok, _TOPK[hp.divergence](pb, mub), 0.0)
  return _dppo_loss(inputs, div, _delta(hp), hp.ratio_cap, p, mu, inputs.behavior_logp_BN)


registry.register("dppo", dppo, Hparams, needs=("behavior_logp",))
registry.register("dppo_topk", dppo_topk, TopkHparams, needs=("behavior_logp", "behavior_topk"))
