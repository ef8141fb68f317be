"""Vocabulary-sized work a chunk of positions at a time: no [B, T, V] array at a real vocabulary.

Shared by the models' chunked lm-head (`models.logprobs`) and the full-distribution distillation
losses (`losses.dense`), which may not import the models: a `VocabHead` carries final hidden states and
the lm-head weights instead of logits, and `map_time_chunks` runs a function over consecutive chunks of
C positions under `jax.checkpoint`, so the backward pass also recomputes one chunk's [B, C, V] logits at
a time. C is capped so that B * C * V <= `max_chunk_elements` (2^22 float32 = 16 MiB by default): at
V = 49,152 and B = 32 that is 2 positions per chunk; toy vocabularies keep whole-sequence chunks.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array

# Default cap on B * C * V, the logits of one lm-head chunk (2^22 float32 = 16 MiB).
MAX_CHUNK_ELEMENTS = 1 << 22


def chunk_positions(batch: int, length: int, vocab: int, chunk_size: int,
                    max_chunk_elements: int = MAX_CHUNK_ELEMENTS) -> int:
  """Positions per lm-head chunk: `chunk_size`, at most `length`, and B * C * V <= max_chunk_elements."""
  return max(1, min(chunk_size, length, max_chunk_elements // max(1, batch * vocab)))


@struct.dataclass
class VocabHead:
  """A distribution over the vocabulary held implicitly: softmax(hidden_BND @ w_DV / temperature).

  hidden_BND: final-normed hidden states at the scored (response) positions (compute dtype); w_DV: the
  lm-head (`models.lm_head_weights`). Its [B, N, V] logits are only ever formed chunk by chunk (`head_logits`),
  at most `max_chunk_elements` of them at a time (`chunk_positions`).
  """
  hidden_BND: Array
  w_DV: Array
  temperature: float = struct.field(pytree_node=False, default=1.0)
  max_chunk_elements: int = struct.field(pytree_node=False, default=MAX_CHUNK_ELEMENTS)


def head_logits(h_BCD: Array, w_DV: Array, temperature: float = 1.0) -> Array:
  """float32 logits / temperature of one chunk; leading axes flattened into one token axis, as
  `models.layers.project` does (the weight gradient then contracts a single axis)."""
  lead, D = h_BCD.shape[:-1], h_BCD.shape[-1]
  z = jnp.tensordot(h_BCD.reshape(-1, D), w_DV, axes=1, preferred_element_type=jnp.float32)
  z = z.reshape(*lead, w_DV.shape[-1])
  return z if isinstance(temperature, (int, float)) and temperature == 1.0 else z / temperature


def map_time_chunks(fn: Callable[..., Any], shared: Any, xs: tuple, C: int) -> Any:
  """`fn(shared, *chunk_xs)` over consecutive C-position chunks of `xs` (each [B, T, ...]), rematerialised.

  `fn` returns a pytree of [B, C, ...] arrays; the result is that pytree over all T positions. T need not
  be a multiple of C (the tail chunk is padded, its padded outputs dropped). `shared` (e.g. lm-head
  weights) is passed whole to every chunk; gradients flow into it and into `xs`.
  """
  B, T = xs[0].shape[:2]
  n = math.ceil(T / C)  # chunks
  pad = n * C - T
  to_chunks = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)).reshape(
      B, n, C, *x.shape[2:]).swapaxes(0, 1)
  chunk = jax.checkpoint(fn)
  outs = jax.lax.map(lambda c: chunk(shared, *c), tuple(to_chunks(x) for x in xs))
  # [n, B, C, ...] -> [B, n*C, ...] -> drop the padded tail.
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(B, n * C, *x.shape[3:])[:, :T], outs)
