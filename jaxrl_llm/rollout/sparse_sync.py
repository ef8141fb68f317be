"""SparseRL-Sync (addendum §8.3): lossless sparse weight sync to a low-precision sampler copy.

Only a small fraction of the sampler-dtype (e.g. bf16) weights change bitwise per optimiser step.
The trainer tracks, per step, which elements of the cast parameters changed (bitwise compare after
the cast, so -0.0 vs 0.0 or a rounding flip counts, an fp32 change that rounds away does not),
unions those index sets until the next sync, and sends `(flat int32 indices, current values)` per
tensor. Values, not deltas, are sent, so the union may be a superset (an element that changed and
changed back is resent) and the sampler copy is still bit-exact. A tensor whose changed fraction
exceeds `max_density` goes dense; by default the break-even of a 4-byte index + value against the
value alone, itemsize / (4 + itemsize): 1/3 for bf16, 1/2 for fp32.

Trainer:  union = init_union(params); low = cast(params, dtype)
          after every optimiser step: union, low = track_step(union, low, params, dtype)
          at a sync: payload = pack(low, union); union = init_union(params)
Sampler:  sampler_params = apply(sampler_params, payload)

`SyncLink` runs both ends in one process, one sync per ParamStore publish (`weight_sync="sparse"`). The sender
tracks changes in the learner's layout; the receiver's copy may live in another (the sampler's layout on the same
mesh, or its own devices, `rollout.sampler_devices`): the payload is packed on the host and scattered into the
receiver's shards, which is where the saving is real (only indices + values cross to the sampler's devices).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def cast(params, dtype):
  """The sampler copy: floating leaves cast to `dtype` (None: kept), as new arrays (never aliases `params`,
  whose buffers a learner step may donate)."""
  return jax.tree.map(lambda x: x.astype(dtype) if dtype is not None and _is_float(x) else jnp.array(x, copy=True),
                      params)


def bits(x: Array) -> Array:
  """The bit pattern of `x` as unsigned ints of the same width (floats), or `x` itself (ints)."""
  if not _is_float(x):
    return x
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def changed(prev_low, new_low):
  """Bool pytree: which elements differ bitwise between two sampler-dtype copies."""
  return jax.tree.map(lambda a, b: bits(a) != bits(b), prev_low, new_low)


def init_union(params):
  """An empty changed-index set (all False) shaped like `params`."""
  return jax.tree.map(lambda x: jnp.zeros(x.shape, bool), params)


@functools.partial(jax.jit, static_argnames=("dtype",))
def track_step(union, prev_low, params, dtype):
  """One optimiser step of Alg. 1: cast the new master params and add the changed elements to `union`.

  Returns (union, new_low); `new_low` is the previous-step snapshot of the next call.
  """
  new_low = cast(params, dtype)
  return jax.tree.map(jnp.logical_or, union, changed(prev_low, new_low)), new_low


class Leaf(NamedTuple):
  """Payload of one tensor: `indices` None means dense (`values` is the whole tensor)."""
  indices: np.ndarray | None  # int32 flat indices, increasing
  values: np.ndarray  # sampler dtype
  shape: tuple[int, ...]


class Payload(NamedTuple):
  treedef: Any
  leaves: list[Leaf]


def break_even(dtype) -> float:
  """Changed fraction at which index + value bytes equal the dense bytes: itemsize / (4 + itemsize)."""
  n = np.dtype(dtype).itemsize
  return n / (4 + n)


def pack(low, union, max_density: float | None = None) -> Payload:
  """Host-side packing (Alg. 2): per tensor, changed flat indices + current values, or dense.

  `max_density` None: each tensor's `break_even` (the smaller payload of the two).
  """
  lows, treedef = jax.tree.flatten(low)
  leaves = []
  for w, u in zip(lows, jax.tree.leaves(union)):
    w_flat, u_flat = np.asarray(w).reshape(-1), np.asarray(u).reshape(-1)
    idx = np.flatnonzero(u_flat).astype(np.int32)
    if idx.size > (break_even(w_flat.dtype) if max_density is None else max_density) * w_flat.size:
      leaves.append(Leaf(None, np.asarray(w), tuple(w.shape)))
    else:
      leaves.append(Leaf(idx, w_flat[idx], tuple(w.shape)))
  return Payload(treedef, leaves)


@jax.jit
def _scatter(w: Array, idx: Array, vals: Array) -> Array:
  # Padding indices equal w.size and are dropped, so padded payloads stay exact.
  return w.reshape(-1).at[idx].set(vals, mode="drop").reshape(w.shape)


def _pad(n: int) -> int:
  """Index-array length bucket (powers of two, at least 8) so the scatter compiles O(log n) times."""
  return max(8, 1 << (max(n, 1) - 1).bit_length())


def apply(sampler_params, payload: Payload):
  """Receiver side (Alg. 3): scatters the payload into a copy of the sampler's parameters.

  Returns new arrays (no donation: the old copy may still be pinned by a ParamStore snapshot).
  """
  ws, treedef = jax.tree.flatten(sampler_params)
  if treedef != payload.treedef:
    raise ValueError(f"payload structure {payload.treedef} does not match the sampler params {treedef}")
  out = []
  for w, leaf in zip(ws, payload.leaves):
    if tuple(w.shape) != leaf.shape:
      raise ValueError(f"payload shape {leaf.shape} does not match the sampler tensor {w.shape}")
    if leaf.indices is None:
      new = jnp.asarray(leaf.values, dtype=w.dtype)
    else:
      n = _pad(leaf.indices.size)
      idx = np.full((n,), w.size, np.int32)
      idx[:leaf.indices.size] = leaf.indices
      vals = np.zeros((n,), leaf.values.dtype)
      vals[:leaf.values.size] = leaf.values
      new = _scatter(w, jnp.asarray(idx), jnp.asarray(vals, dtype=w.dtype))
    if isinstance(w, jax.Array) and new.sharding != w.sharding:  # the receiver keeps its own layout
      new = jax.device_put(new, w.sharding)
    out.append(new)
  return jax.tree.unflatten(treedef, out)


def payload_bytes(payload: Payload) -> int:
  """Bytes on the wire: indices + values of sparse tensors, values of dense ones (unpadded)."""
  return sum(leaf.values.nbytes + (0 if leaf.indices is None else leaf.indices.nbytes) for leaf in payload.leaves)


def dense_bytes(payload: Payload) -> int:
  """The cost of sending every tensor whole in the sampler dtype."""
  return sum(int(np.prod(leaf.shape)) * leaf.values.dtype.itemsize for leaf in payload.leaves)


def payload_ratio(payload: Payload) -> float:
  """Sparse bytes / dense bytes."""
  return payload_bytes(payload) / max(dense_bytes(payload), 1)


def density(union) -> float:
  """Fraction of elements in the changed-index set."""
  leaves = jax.tree.leaves(union)
  return float(sum(int(jnp.sum(u)) for u in leaves)) / max(sum(u.size for u in leaves), 1)


class SyncStats(NamedTuple):
  """One sync: bytes sent, bytes of a dense copy, fraction of elements that changed (1 for a dense sync)."""
  payload_bytes: int
  dense_bytes: int
  changed_frac: float

  @property
  def ratio(self) -> float:
    return self.payload_bytes / max(self.dense_bytes, 1)


class SyncLink:
  """Both ends of one trainer -> sampler link in one process; holds references and counters only.

  Trainer end: `low`, the cast copy of the last synced parameters. Receiver end: `receiver`, the
  sampler's copy, rebuilt only by `apply` from payloads, so it equals `cast(params)` bit for bit
  exactly when the algorithm is right. Syncing once per publish makes the union of Alg. 1 the
  elements that differ bitwise from the previous publish (a subset of the per-step union: the
  optimiser steps in between are not observed).
  """

  def __init__(self, dtype=None, max_density: float | None = None):
    self.dtype = dtype  # None: the wire keeps each leaf's dtype
    self.max_density = max_density
    self.low = None
    self.receiver = None
    self.last: SyncStats | None = None
    self.total_payload_bytes = 0
    self.total_dense_bytes = 0
    self.syncs = 0

  def reset(self, shared=None) -> None:
    """Next sync dense (`shared` None), or a delta from `shared`: a cast copy both ends hold (a restored snapshot)."""
    self.low = self.receiver = shared

  def sync(self, params, shardings=None):
    """Sends `params` (dense the first time, else the bitwise-changed elements); returns the receiver's new copy,
    laid out as `shardings` (the receiver's layout: another mesh, other devices; None: the sender's)."""
    if self.receiver is None:
      low = receiver = cast(params, self.dtype)
      if shardings is not None:
        from jaxrl_llm.sharding import reshard  # local: the sync module stays importable without the layouts
        receiver = reshard(low, shardings)
      n = sum(x.nbytes for x in jax.tree.leaves(low))
      stats = SyncStats(n, n, 1.0)
    else:
      # a restored base (`reset`) comes in the receiver's layout: the sender tracks changes in its own
      same = lambda l, p: not isinstance(l, jax.Array) or not isinstance(p, jax.Array) or l.sharding == p.sharding
      prev = jax.tree.map(lambda l, p: l if same(l, p) else jax.device_put(l, p.sharding), self.low, params)
      union, low = track_step(init_union(params), prev, params, self.dtype)
      payload = pack(low, union, self.max_density)
      receiver = apply(self.receiver, payload)
      stats = SyncStats(payload_bytes(payload), dense_bytes(payload), density(union))
    self.low, self.receiver, self.last = low, receiver, stats
    self.total_payload_bytes += stats.payload_bytes
    self.total_dense_bytes += stats.dense_bytes
    self.syncs += 1
    return receiver
