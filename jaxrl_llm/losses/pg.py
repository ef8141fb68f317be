"""Vanilla policy gradient (REINFORCE with a baseline-subtracted advantage)."""

from __future__ import annotations

import dataclasses

from jaxrl_llm.losses import core, registry


@dataclasses.dataclass(frozen=True)
class Hparams:
  pass


def pg(inputs, hp: Hparams):
  """Vanilla policy gradient: ℓ_t = -Â_t·log π_θ(y_t|s_t).

  Objective: J = E_{y~π_θ}[Σ_t Â_t log π_θ(y_t|s_t)], whose gradient is the REINFORCE estimator.
  Paper: Williams (1992), "Simple statistical gradient-following algorithms".
  On-policy: this *is* the reference every importance-corrected loss must reduce to. It ignores
  staleness entirely (no ratio), so off-policy it is biased.
  """
  del hp
  loss = core.reinforce(inputs.adv_BN, inputs.logp_BN, inputs.mask_BN)
  return loss, {}


registry.register("pg", pg, Hparams, needs=())
