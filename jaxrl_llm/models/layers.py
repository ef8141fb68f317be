"""Pure building blocks of the decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Conventions follow Hugging Face Llama/Qwen so imported weights need no permutation:
RMSNorm multiplies by `w` directly; RoPE is the non-interleaved "rotate_half" form.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

Array = jax.Array

# Finite stand-in for -inf in masked attention scores: exp underflows to exactly 0 and no
# inf - inf can appear in the softmax.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def rms_norm(x_BTD: Array, w_D: Array, eps: float) -> Array:
  """RMSNorm over the last axis, statistics in float32, scale applied in x's dtype (HF order)."""
  x32 = x_BTD.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  w = jnp.expand_dims(w_D.astype(x_BTD.dtype), tuple(range(x_BTD.ndim - 1)))  # [1, ..., 1, D]: explicit broadcast
  return w * normed.astype(x_BTD.dtype)


def rope(x_BTHd: Array, positions_BT: Array, theta: float) -> Array:
  """Rotary position embedding, HF "rotate_half" layout (first half pairs with second half).

  Angles are computed in float32 from integer positions, then cast to x's dtype.
  """
  hd = x_BTHd.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  angles_BTh = positions_BT.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  angles_BTd = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles_BTd).astype(x_BTHd.dtype), jnp.sin(angles_BTd).astype(x_BTHd.dtype)
  x1, x2 = jnp.split(x_BTHd, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BTHd * cos + rotated * sin


def attention(q_BTHd: Array, k_BSKd: Array, v_BSKd: Array, mask_BTS: Array) -> Array:
  """Grouped-query softmax attention with scale 1/sqrt(head_dim).

  Each of the K key/value heads serves Q = H // K consecutive query heads (HF layout). Keys and values are
  [B, S, K, hd] (the decode loop's cache layout has its own, `decode_attention`). Scores and softmax are float32;
  every query row must allow at least one key.
  """
  B, T, H, hd = q_BTHd.shape
  K = k_BSKd.shape[2]
  q_BTKQd = q_BTHd.reshape(B, T, K, H // K, hd)
  scores_BKQTS = jnp.einsum("btkqd,bskd->bkqts", q_BTKQd, k_BSKd, preferred_element_type=jnp.float32) * (hd ** -0.5)
  scores_BKQTS = jnp.where(mask_BTS[:, None, None], scores_BKQTS, MASK_VALUE)
  probs_BKQTS = jax.nn.softmax(scores_BKQTS, axis=-1).astype(v_BSKd.dtype)
  out_BTKQd = jnp.einsum("bkqts,bskd->btkqd", probs_BKQTS, v_BSKd)
  return out_BTKQd.reshape(B, T, H, hd)


def decode_attention(q_BTHd: Array, k_BKdS: Array, v_BKSd: Array, mask_BTS: Array,
                     k_scale_BKS: Array | None = None, v_scale_BKS: Array | None = None, dtype=None) -> Array:
  """`attention` of a few new tokens (a decode step, a speculative verify) against the decode-loop cache, as
  broadcast products summed in float32 rather than dots.

  Why: per (row, kv head) the dots are [Q·T, hd] × [hd, S], and XLA:CPU ran these B·K tiny matmuls at a few
  GFLOP/s. As one fused multiply-and-sum it streams the cache (keys summed over hd, their outer axis; values over
  S, theirs), several times faster at batch 64 (bench/decode_attention.py; docs/performance.md).
  An int8 cache (`cache.quantize_kv`) passes its per-slot scales and `dtype`, the compute dtype: a key's scale
  multiplies its score after the sum over hd and a value's its probability, so the sums read the int8 slots
  themselves and no dequantised copy of the cache is formed.
  """
  B, T, H, hd = q_BTHd.shape
  K = k_BKdS.shape[1]
  f32 = jnp.float32
  dtype = v_BKSd.dtype if v_scale_BKS is None else dtype
  q_BKQTd = jnp.transpose(q_BTHd.reshape(B, T, K, H // K, hd), (0, 2, 3, 1, 4)).astype(f32)
  scores_BKQTS = jnp.sum(q_BKQTd[..., None] * k_BKdS[:, :, None, None].astype(f32), axis=4) * (hd ** -0.5)
  if k_scale_BKS is not None:
    scores_BKQTS = scores_BKQTS * k_scale_BKS[:, :, None, None, :]
  scores_BKQTS = jnp.where(mask_BTS[:, None, None], scores_BKQTS, MASK_VALUE)
  probs_BKQTS = jax.nn.softmax(scores_BKQTS, axis=-1).astype(dtype).astype(f32)
  if v_scale_BKS is not None:
    probs_BKQTS = probs_BKQTS * v_scale_BKS[:, :, None, None, :]
  out_BKQTd = jnp.sum(probs_BKQTS[..., None] * v_BKSd[:, :, None, None].astype(f32), axis=4)
  return jnp.transpose(out_BKQTd, (0, 3, 1, 2, 4)).reshape(B, T, H, hd).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutIn:
  """A projection weight stored output-major, [R, D] (R: its output axes `out_shape` flattened; D: its input):
  the decode loop's view of a weight (`transformer.unstack_layers`), which `project` multiplies as w_RD @ x_DM.

  Why: with the few rows of a decode step (M = batch), XLA:CPU's x_MD @ w_DR ran at half its speed with M = 16
  (bench/decode_matmul.py); the same product as a tall w_RD @ x_DM does not. Optimization barriers keep XLA from
  folding the transposes of x back into the original dot.
  """
  w_RD: Array
  out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

  @classmethod
  def of(cls, w_I_: Array, in_axes: int = 1) -> "OutIn":
    """The output-major copy of a weight whose first `in_axes` axes are its input."""
    return cls(w_I_.reshape(math.prod(w_I_.shape[:in_axes]), -1).T, tuple(w_I_.shape[in_axes:]))


def project(x_BTD: Array, w_D_: Array | OutIn, preferred_element_type=None) -> Array:
  """`x @ w` contracting the last axis of x with the first of w, leading axes flattened to one; `w` may be an
  `OutIn` (the decode loop's output-major weights: the same product, computed as w_RD @ x_DM).

  Why flatten: the weight gradient then contracts a single token axis. With separate (b, t) axes
  XLA:CPU lays the [B·T, F] cotangent out transposed before the dot, a strided copy that cost about
  as much as the matmuls themselves in the tiny-model learner step (bench/README.md).
  """
  lead, D = x_BTD.shape[:-1], x_BTD.shape[-1]
  if isinstance(w_D_, OutIn):
    barrier = jax.lax.optimization_barrier
    y_RM = jnp.matmul(w_D_.w_RD, barrier(x_BTD.reshape(-1, D).T), preferred_element_type=preferred_element_type)
    return barrier(y_RM).T.reshape(*lead, *w_D_.out_shape)
  y = jnp.tensordot(x_BTD.reshape(-1, D), w_D_, axes=1, preferred_element_type=preferred_element_type)
  return y.reshape(*lead, *w_D_.shape[1:])


def swiglu(x_BTD: Array, w_gate_DF: Array, w_up_DF: Array, w_down_FD: Array) -> Array:
  """SwiGLU MLP: down(silu(gate(x)) * up(x))."""
  return project(jax.nn.silu(project(x_BTD, w_gate_DF)) * project(x_BTD, w_up_DF), w_down_FD)
