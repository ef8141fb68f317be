"""Weight-only int8 quantisation of the sampler's parameters (a real training–inference mismatch).

Every matmul weight is quantised symmetrically per output channel to int8 and dequantised back to the
sampler's compute dtype when published, so the sampler computes with exactly the values an int8
weight-only kernel (dequantise, then matmul) would use. Embeddings and norms stay in full precision,
as in common weight-only schemes. The memory saving of storing int8 is not realised here: the point
is the numerics the learner must correct for, measured, never simulated with noise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Matmul weights of the layout in models/transformer.py and the axis that indexes their input features
# (the scale is per output channel: reduce |w| over the input axis only).
_INPUT_AXIS = {"wq": 1, "wk": 1, "wv": 1, "wo": (1, 2), "w_gate": -2, "w_up": -2, "w_down": -2, "lm_head": 0}


def quantize_dequantize_int8(w, input_axis) -> jax.Array:
  """Symmetric per-output-channel int8 round trip: round(w / s)·s with s = max|w| / 127 over inputs."""
  w32 = w.astype(jnp.float32)
  s = jnp.max(jnp.abs(w32), axis=input_axis, keepdims=True) / 127.0
  s = jnp.where(s > 0, s, 1.0)
  return (jnp.clip(jnp.round(w32 / s), -127, 127) * s).astype(w.dtype)


@jax.jit
def int8_weight_only(params: dict) -> dict:
  """The parameters with every matmul weight passed through the int8 round trip (others unchanged)."""
  def walk(tree):
    return {k: (walk(v) if isinstance(v, dict) else
                quantize_dequantize_int8(v, _INPUT_AXIS[k]) if k in _INPUT_AXIS else v) for k, v in tree.items()}
  return walk(params)
