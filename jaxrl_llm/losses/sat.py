"""SAT: staleness-adaptive trust region (contract the outward PPO endpoint on high-mismatch tokens)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, gspo, registry

sg = core.sg


@dataclasses.dataclass(frozen=True)
class Hparams:
  eps_low: float = 0.2  # App. F, Table 9 (also for the GSPO base in their grid, not 3e-4/4e-4)
  eps_high: float = 0.2
  alpha: float = 0.90  # batch quantile level of |d|
  hill_p: float = 2.0  # Hill exponent of ψ(u; q) = 1 / (1 + (u/q)^p)
  denominator: str = "prox"  # "prox" (recomputed π_old, the reported runs) | "behavior" (μ, paper notation)
  enabled: bool = True  # False: the base recipe, bit for bit
  max_log_ratio: float = 10.0  # sat_gspo only: the GSPO clamp of the sequence log-ratio


_DENOMINATORS = ("prox", "behavior")


def sat_factors(d_BN, mask_BN, alpha, p):
  """Contraction factors (c₊, c₋), gate and q from the detached staleness proxy d.

  q = lower α-quantile of |d| over active tokens; a token is gated iff q > 0 and |d| > q (strict);
  gated tokens get c± = ψ(max(±d, 0); q), so only the endpoint on the side of sign(d) shrinks
  (c < ½ there); all other tokens keep c₊ = c₋ = 1.
  """
  d = sg(d_BN).astype(jnp.float32)
  q = sg(core.masked_quantile(jnp.abs(d), mask_BN, alpha))
  gate = (mask_BN > 0) & (q > 0) & (jnp.abs(d) > q)
  q_safe = jnp.where(q > 0, q, 1.0)
  psi = lambda u: 1.0 / (1.0 + (u / q_safe) ** p)
  c_plus = jnp.where(gate, psi(jnp.maximum(d, 0.0)), 1.0)
  c_minus = jnp.where(gate, psi(jnp.maximum(-d, 0.0)), 1.0)
  return c_plus, c_minus, gate, q


def _denominator(inputs, hp):
  if hp.denominator not in _DENOMINATORS:
    raise ValueError(f"loss.hparams.denominator={hp.denominator!r}: must be one of {_DENOMINATORS}")
  return inputs.prox_logp_BN if hp.denominator == "prox" else inputs.behavior_logp_BN


def _sat_surrogate(ratio_BN, d_BN, inputs, hp):
  mask = inputs.mask_BN
  c_plus, c_minus, gate, q = sat_factors(d_BN, mask, hp.alpha, hp.hill_p)
  if hp.enabled:
    eps_low, eps_high = hp.eps_low * c_minus, hp.eps_high * c_plus
  else:  # Python floats: exactly the base recipe's ops.
    eps_low, eps_high = hp.eps_low, hp.eps_high
  loss, clipped = core.clipped_surrogate(ratio_BN, inputs.adv_BN, eps_low, eps_high)
  one = jnp.ones(())
  aux = {
      "clip_frac": core.metric(clipped, mask),
      "sat_gate_rate": core.metric(gate, mask),
      "sat_eps_low": core.metric(hp.eps_low * c_minus, mask),
      "sat_eps_high": core.metric(hp.eps_high * c_plus, mask),
      "sat_contraction_max": core.max_metric(1.0 - jnp.minimum(c_plus, c_minus), mask),
      "sat_q": (q, one),
  }
  return core.apply_mask(loss, mask), aux


def sat(inputs, hp: Hparams):
  """SAT-GRPO: PPO-clip with per-token radii ε̃_low = ε_low·c₋, ε̃_high = ε_high·c₊.

  Staleness proxy d = sg(log π_θ − log π_den), r = e^d; q = lower 0.90-quantile of |d| over the active
  tokens of this call (the paper's "detached microbatch quantile"); gated tokens (q > 0, |d| > q) have
  the endpoint on the side of sign(d) contracted by the Hill kernel ψ(u; q) = 1/(1 + (u/q)²), the other
  endpoint unchanged. ℓ = −min(r·Â, clip(r, 1−ε̃_low, 1+ε̃_high)·Â); radii are constants (no gradient).
  Prop. 4.1: the interval is contained in PPO's, S_SAT ≤ S_PPO pointwise, gradients differ from PPO's
  only on {Â>0, 1+ε_high·c₊ < r < 1+ε_high} and {Â<0, 1−ε_low < r < 1−ε_low·c₋} (where SAT's is 0),
  and at most the top decile of tokens is gated.
  Paper: Yang et al., "Stale but Stable" (arXiv 2607.18722) §4.2, pinned in methods-addendum §1.
  Denominator: `prox` (slime's recomputed old log-probs, used in the reported runs) or `behavior` (μ).
  `enabled=False` is bit-identical to `ppo_clip` with the same ε. Paper aggregation: token-mean.
  On-policy: d = 0, q = 0, nothing gated: PPO, hence the vanilla PG gradient.
  """
  den = _denominator(inputs, hp)
  lr = core.safe_log_ratio(inputs.logp_BN, den, inputs.mask_BN)
  loss, aux = _sat_surrogate(jnp.exp(lr), lr, inputs, hp)
  return loss, {**aux, **core.ratio_diagnostics(lr, inputs.mask_BN, "ratio")}


def sat_gspo(inputs, hp: Hparams):
  """SAT-GSPO: SAT on the GSPO length-normalised ratio ρ_b = exp((1/T_b) Σ_t m·log r_t).

  ρ_b replaces the token ratio both in the surrogate (GSPO-token form, as in `gspo`) and in the
  staleness proxy d = sg(log ρ_b) broadcast to the active tokens of b; the quantile is over tokens, so
  sequences are length-weighted. `enabled=False` is bit-identical to `gspo` with the same ε (the paper's
  grid uses 0.2/0.2). Use seq-mean-token-mean as for GSPO. On-policy: the vanilla PG gradient.
  """
  den = _denominator(inputs, hp)
  log_s, _ = gspo.gspo_log_ratio(inputs.logp_BN, den, inputs.mask_BN, hp.max_log_ratio)
  return _sat_surrogate(jnp.exp(log_s), log_s, inputs, hp)


registry.register("sat", sat, Hparams, needs=("prox_logp", "behavior_logp"))
registry.register("sat_gspo", sat_gspo, Hparams, needs=("prox_logp", "behavior_logp"))
