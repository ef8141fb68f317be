"""One sampling step: draw a token from logits and report its behaviour log-probability."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.sampling.config import SamplerConfig

Array = jax.Array


def _logp_at(logits_BV: Array, ids_B: Array) -> Array:
  return jnp.take_along_axis(jax.nn.log_softmax(logits_BV, axis=-1), ids_B[:, None], axis=-1)[:, 0]


def sample_token(logits_BV: Array, key: Array, cfg: SamplerConfig) -> tuple[Array, Array]:
  """Draws one token per row and returns `(token_B, behavior_logp_B)`.

  `behavior_logp` is the log-probability under the distribution actually sampled:
  - no truncation: log_softmax(logits / temperature)[token];
  - top-k and/or top-p: the log-prob under the *renormalised truncated* distribution. Top-k is
    applied first, then top-p on the renormalised top-k distribution (the HF/vLLM order); top-p keeps
    a token when the mass of strictly more likely tokens is < top_p, so the most likely token is
    always kept. Truncated logp >= untruncated logp for the same token;
  - greedy (temperature 0): the argmax, scored by log_softmax(logits) at temperature 1 (the
    evaluation convention; there is no sampled distribution to score against).
  """
  logits_BV = logits_BV.astype(jnp.float32)
  if cfg.temperature == 0:
    token_B = jnp.argmax(logits_BV, axis=-1)
    return token_B, _logp_at(logits_BV, token_B)
  scaled_BV = logits_BV / cfg.temperature
  if not cfg.truncated:
    token_B = jax.random.categorical(key, scaled_BV, axis=-1)
    return token_B, _logp_at(scaled_BV, token_B)
  # Candidates sorted by decreasing probability; top_k = 0 means all V (a full sort).
  vals_BK, ids_BK = jax.lax.top_k(scaled_BV, cfg.top_k or scaled_BV.shape[-1])
  if cfg.top_p < 1:
    probs_BK = jax.nn.softmax(vals_BK, axis=-1)
    mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
    vals_BK = jnp.where(mass_before_BK < cfg.top_p, vals_BK, -jnp.inf)
  choice_B = jax.random.categorical(key, vals_BK, axis=-1)
  token_B = jnp.take_along_axis(ids_BK, choice_B[:, None], axis=-1)[:, 0]
  return token_B, _logp_at(vals_BK, choice_B)
