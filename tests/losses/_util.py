"""Shared helpers of the per-loss golden tests."""

import jax.numpy as jnp

from jaxrl_llm.types import LossInputs


def mismatch_inputs(logp, prox, behav, adv, mask):
  """LossInputs of a loss that reads π_θ, π_old and μ (numpy arrays in, jax arrays out)."""
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    prox_logp_BN=jnp.asarray(prox), behavior_logp_BN=jnp.asarray(behav))
