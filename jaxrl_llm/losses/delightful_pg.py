"""Delightful Policy Gradient (DG): policy gradient gated by σ(advantage × surprisal)."""

from __future__ import annotations

import dataclasses

import jax

from jaxrl_llm.losses import core, registry

sg = core.sg


@dataclasses.dataclass(frozen=True)
class Hparams:
  eta: float = 1.0  # gate temperature η (Osband; open-instruct `--use_delight` default).


def delight_gate(logp_BN, adv_BN, mask_BN, eta: float):
  """w_t = σ(χ_t/η), χ_t = Â_t·(−log π_θ(y_t)): the delight of a token, detached. 0 outside the mask."""
  surprisal = -sg(core.safe_logp(logp_BN, mask_BN))
  w = jax.nn.sigmoid(adv_BN * surprisal / eta)
  return core.apply_mask(w, mask_BN), adv_BN * surprisal


def delightful_pg(inputs, hp: Hparams):
  """Delightful PG: ℓ_t = −sg(w_t·Â_t)·log π_θ(y_t), w_t = σ(Â_t·(−sg(log π_θ(y_t)))/η).

  Update direction Σ_t w_t·Â_t·∇log π_θ: rare successes (Â>0, high surprisal) keep gate ≈ 1 and
  dominate, rare failures (Â<0, high surprisal) are suppressed (gate ≈ 0). The gate is a weight on
  the standard term, not differentiated; surprisal is taken under the *current* learner.
  No importance ratios and no behaviour probabilities, even for stale data (the distributed-DG paper
  reports it beats importance-weighted PG with exact μ under simulated staleness); so this loss
  needs nothing beyond logp, advantages and mask.
  Paper: Osband 2026, arXiv 2603.14608 (and 2603.20521 for stale/mismatched actors); methods-addendum §6.
  Granularity: per token, χ_{i,t} = Â_i·(−log π_θ(y_{i,t})) with the sequence advantage broadcast.
  Metric `gate_mean` (≈1 on confident successes, ≈0 on surprising failures) is the one to monitor.
  On-policy: identical to off-policy (there is no ratio); the gradient is the vanilla PG gradient
  with each token scaled by its gate, −σ(Â·(−log π)/η)·Â·∇log π, not −Â·∇log π. As η → ∞ the gate
  tends to ½ everywhere, i.e. ½·PG.
  """
  gate, delight = delight_gate(inputs.logp_BN, inputs.adv_BN, inputs.mask_BN, hp.eta)
  loss = core.reinforce(gate * inputs.adv_BN, inputs.logp_BN, inputs.mask_BN)
  aux = {"gate_mean": core.metric(gate, inputs.mask_BN), "delight_mean": core.metric(delight, inputs.mask_BN)}
  return loss, aux


registry.register("delightful_pg", delightful_pg, Hparams, needs=())
