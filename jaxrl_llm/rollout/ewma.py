"""EWMA parameter copy (Hilton et al. 2021) for the `ewma` old-log-prob strategy (PPO-EWMA).

The proximal policy is an exponentially weighted moving average of past *weights*:
θ_EWMA ← β·θ_EWMA + (1 − β)·θ after every optimiser step. Its log-probs of the sampled tokens (one
extra forward pass of the EWMA copy) are the `prox_logp` that `losses.ppo_ewma` anchors to.

LoRA: the copy averages the *effective* weights (base + scale·(BA)ᵀ, `lora.effective`), a plain parameter
pytree. Averaging A and B separately would not be an average of weights (the update is bilinear in them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models import lora


def ewma_init(params):
  """The EWMA copy starts as a real copy of the current (effective) parameters (no bias correction needed)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), lora.effective(params))


@jax.jit
def ewma_update(ewma_params, params, beta):
  """One EWMA step, `β·ewma + (1 − β)·params` per leaf, in the EWMA copy's dtype.

  `beta` is traced (changing it does not recompile); β = 0 tracks `params`, β = 1 freezes the copy.
  Non-floating leaves are taken from `params`; a policy with adapters enters with them merged.
  """
  def mix(e, p):
    if not jnp.issubdtype(e.dtype, jnp.floating):
      return p
    b = jnp.asarray(beta, jnp.float32)
    return (b * e.astype(jnp.float32) + (1.0 - b) * p.astype(jnp.float32)).astype(e.dtype)

  return jax.tree.map(mix, ewma_params, lora.effective(params))
