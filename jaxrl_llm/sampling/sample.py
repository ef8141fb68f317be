"""One sampling step: draw a token from logits and report its behaviour log-probability."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.sampling.config import SamplerConfig

Array = jax.Array

# Most Gumbel noise elements `generate` draws for the whole decode before its loop (16 MiB of
# float32); larger (N, B, V) draw step by step inside the loop. Both give the same bits.
PREDRAW_MAX_ELEMENTS = 1 << 22


def first_argmax(x_BV: Array) -> Array:
  """`jnp.argmax` over the last axis (first index among ties) as two plain reductions.

  Why: XLA:CPU runs argmax's variadic (value, index) reduce element by element, and it was the
  costliest single op of a small model's decode step in a profile; a max, a compare and a min
  vectorise. A row of NaNs returns the last index instead of the first.
  """
  V = x_BV.shape[-1]
  max_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
  idx_B = jnp.min(jnp.where(x_BV == max_B1, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
  return jnp.minimum(idx_B, V - 1)


def noise_shape(batch: int, vocab: int, cfg: SamplerConfig) -> tuple[int, int] | None:
  """Shape of one step's Gumbel noise: [B, top_k or V] (candidates under truncation); None if greedy."""
  if cfg.temperature == 0:
    return None
  return (batch, cfg.top_k or vocab) if cfg.truncated else (batch, vocab)


def step_noise(key: Array, step: Array, shape: tuple[int, int]) -> Array:
  """Gumbel noise of decode step `step`: `jax.random.categorical(fold_in(key, step), ...)`'s own draw."""
  return jax.random.gumbel(jax.random.fold_in(key, step), shape, jnp.float32)


def predraw_noise(key: Array, steps: int, shape: tuple[int, int]) -> Array:
  """[steps, *shape] noise: row n equals `step_noise(key, n, shape)` bit for bit, drawn in one call.

  Why: on CPU the threefry hash is a rolled loop of small ops, a large share of a tiny model's decode
  step when drawn inside the loop. One vectorised draw before the loop costs a fraction of that.
  """
  return jax.vmap(lambda n: step_noise(key, n, shape))(jnp.arange(steps))


def is_row_keys(key: Array) -> bool:
  """Whether `key` holds one key per row (raw uint32 [B, 2] or typed [B]) rather than one key for the batch."""
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  return key.ndim == (1 if typed else 2)


def row_noise(keys_B: Array, steps_B: Array, width: int) -> Array:
  """[B, width] Gumbel noise: row b is `gumbel(fold_in(keys_B[b], steps_B[b]), (width,))`.

  Why: with one key per request, token t of a request depends only on (its key, t), not on the batch it
  shares or the row it sits in; continuous batching (`sampling.continuous`) relies on it to refill rows.
  """
  return jax.vmap(lambda k, t: jax.random.gumbel(jax.random.fold_in(k, t), (width,), jnp.float32))(keys_B, steps_B)


def _logp_at(logits_BV: Array, ids_B: Array) -> Array:
  return jnp.take_along_axis(jax.nn.log_softmax(logits_BV, axis=-1), ids_B[:, None], axis=-1)[:, 0]


def truncate(scaled_BV: Array, cfg: SamplerConfig) -> tuple[Array, Array]:
  """(vals_BK, ids_BK): the candidates of a truncated draw sorted by decreasing probability (K = top_k,
  or V when top_k = 0: a full sort), their tempered logits set to -inf where top-p drops them."""
  vals_BK, ids_BK = jax.lax.top_k(scaled_BV, cfg.top_k or scaled_BV.shape[-1])
  if cfg.top_p < 1:
    probs_BK = jax.nn.softmax(vals_BK, axis=-1)
    mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
    vals_BK = jnp.where(mass_before_BK < cfg.top_p, vals_BK, -jnp.inf)
  return vals_BK, ids_BK


def sample_token(logits_BV: Array, key: Array, cfg: SamplerConfig, gumbel_BK: Array | None = None) -> tuple[Array, Array]:
  """Draws one token per row and returns `(token_B, behavior_logp_B)`.

  The draw is `jax.random.categorical(key, ...)` (Gumbel-max): `argmax(gumbel(key) + logits)`.
  `gumbel_BK` passes that noise in (shape `noise_shape(B, V, cfg)`, e.g. a row of `predraw_noise`);
  None draws it from `key`.

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
    token_B = first_argmax(logits_BV)
    return token_B, _logp_at(logits_BV, token_B)
  scaled_BV = logits_BV / cfg.temperature
  if gumbel_BK is None:
    gumbel_BK = jax.random.gumbel(key, noise_shape(*scaled_BV.shape, cfg), jnp.float32)
  if not cfg.truncated:
    token_B = first_argmax(gumbel_BK + scaled_BV)
    return token_B, _logp_at(scaled_BV, token_B)
  vals_BK, ids_BK = truncate(scaled_BV, cfg)
  choice_B = first_argmax(gumbel_BK + vals_BK)
  token_B = jnp.take_along_axis(ids_BK, choice_B[:, None], axis=-1)[:, 0]
  return token_B, _logp_at(vals_BK, choice_B)
