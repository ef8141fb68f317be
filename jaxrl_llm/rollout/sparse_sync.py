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

Payloads are per block: a tensor's blocks are its device shards in the sender's layout (the whole tensor on one
device), each packed by the process holding its first replica, so over several processes no host ever reads a
shard it does not hold; the blocks then reach every process (the host wire between them), and each receiver shard
takes what the blocks change in its own region, whatever its layout.

`SyncLink` runs both ends, one sync per ParamStore publish (`weight_sync="sparse"`). The sender tracks changes in the
learner's layout; the receiver's copy may live in another (the sampler's layout on the same mesh, or its own
devices, `rollout.sampler_devices`), which is where the saving is real (only indices + values cross to the
sampler's devices).
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


class Block(NamedTuple):
  """One block of a tensor (a device shard; the whole tensor on one device): where it starts, its shape, and its
  changed elements: `indices` None means dense (`values` is the whole block)."""
  start: tuple[int, ...]  # global coordinates of the block's first element
  shape: tuple[int, ...]
  indices: np.ndarray | None  # int32 flat indices within the block, increasing
  values: np.ndarray  # flat, sampler dtype


class Leaf(NamedTuple):
  """Payload of one tensor: its blocks, each sent by the process that holds its first replica."""
  shape: tuple[int, ...]
  blocks: list[Block]

  def _one(self) -> Block:
    if len(self.blocks) != 1:
      raise ValueError(f"a tensor sent as {len(self.blocks)} blocks has no single indices / values")
    return self.blocks[0]

  @property
  def indices(self) -> np.ndarray | None:
    return self._one().indices

  @property
  def values(self) -> np.ndarray:
    return self._one().values


class Payload(NamedTuple):
  treedef: Any
  leaves: list[Leaf]


def break_even(dtype) -> float:
  """Changed fraction at which index + value bytes equal the dense bytes: itemsize / (4 + itemsize)."""
  n = np.dtype(dtype).itemsize
  return n / (4 + n)


def _start(index, shape) -> tuple[int, ...]:
  return tuple(0 if s.start is None else int(s.start) for s in index) + (0,) * (len(shape) - len(index))


def _own_blocks(w, u) -> list[tuple[tuple[int, ...], np.ndarray, np.ndarray]]:
  """(start, values, changed) of the blocks this process sends: the shards of `w` whose first replica it holds
  (every block exactly once over the processes); a host array or a one-device array is one block."""
  if not isinstance(w, jax.Array) or len(w.sharding.device_set) == 1:
    w_np = np.asarray(w)
    return [((0,) * w_np.ndim, w_np, np.asarray(u))]
  if u.sharding != w.sharding:
    u = jax.device_put(u, w.sharding)
  u_by_device = {s.device: s.data for s in u.addressable_shards}
  return [(_start(s.index, w.shape), np.asarray(s.data), np.asarray(u_by_device[s.device]))
          for s in w.addressable_shards if s.replica_id == 0]


def _pack_block(start, w_np: np.ndarray, u_np: np.ndarray, max_density: float | None) -> Block:
  w_flat, u_flat = w_np.reshape(-1), u_np.reshape(-1)
  idx = np.flatnonzero(u_flat).astype(np.int32)
  if idx.size > (break_even(w_flat.dtype) if max_density is None else max_density) * w_flat.size:
    return Block(start, tuple(w_np.shape), None, w_flat.copy())
  return Block(start, tuple(w_np.shape), idx, w_flat[idx])


def _gather_blocks(per_leaf: list[list[Block]]) -> list[list[Block]]:
  """Every process's blocks of every tensor, ordered by start (one process: its own). Values travel as their bits
  (bfloat16 has no plain-data dtype); nothing is pickled."""
  from jaxrl_llm import multiprocess  # local: one process never needs it
  if not multiprocess.multi():
    return per_leaf
  wire = [[{"start": list(b.start), "shape": list(b.shape), "indices": b.indices, "dtype": b.values.dtype.name,
            "bits": b.values.view(f"uint{8 * b.values.dtype.itemsize}")} for b in blocks] for blocks in per_leaf]
  out = [[] for _ in per_leaf]
  for theirs in multiprocess.allgather_host(wire):
    for i, blocks in enumerate(theirs):
      out[i] += [Block(tuple(b["start"]), tuple(b["shape"]), None if b["indices"] is None else
                       np.asarray(b["indices"], np.int32), np.asarray(b["bits"]).view(jnp.dtype(b["dtype"])))
                 for b in blocks]
  return [sorted(blocks, key=lambda b: b.start) for blocks in out]


def pack(low, union, max_density: float | None = None) -> Payload:
  """Host-side packing (Alg. 2), per block (`Block`: a device shard, or the whole tensor on one device): the changed
  flat indices + current values, or the block dense when its changed fraction exceeds `max_density` (None: the
  dtype's `break_even`, the smaller payload of the two). Over several processes each process packs the blocks whose
  first replica it holds and every process gets all of them (`multiprocess.allgather_host`): the payload is the same
  on every process, and equals the one-process payload of the same layout.
  """
  lows, treedef = jax.tree.flatten(low)
  unions = jax.tree.leaves(union)
  per_leaf = [[_pack_block(start, w_np, u_np, max_density) for start, w_np, u_np in _own_blocks(w, u)]
              for w, u in zip(lows, unions)]
  return Payload(treedef, [Leaf(tuple(w.shape), blocks) for w, blocks in zip(lows, _gather_blocks(per_leaf))])


@jax.jit
def _scatter(w: Array, idx: Array, vals: Array) -> Array:
  # Padding indices equal w.size and are dropped, so padded payloads stay exact.
  return w.reshape(-1).at[idx].set(vals, mode="drop").reshape(w.shape)


def _pad(n: int) -> int:
  """Index-array length bucket (powers of two, at least 8) so the scatter compiles O(log n) times."""
  return max(8, 1 << (max(n, 1) - 1).bit_length())


def _updates(blocks: list[Block], start, shape) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
  """What the blocks change in the region [start, start + shape): (flat indices in the region, values), or the
  region's values whole when one dense block is exactly the region (the common case: the same layout)."""
  idx, vals = [], []
  for b in blocks:
    if b.start == start and b.shape == shape:
      if b.indices is None:
        return b.values.reshape(shape)
      idx.append(b.indices)
      vals.append(b.values)
      continue
    lo, hi = np.array(b.start), np.array(b.start) + np.array(b.shape)
    r_lo, r_hi = np.array(start), np.array(start) + np.array(shape)
    if np.any(np.maximum(lo, r_lo) >= np.minimum(hi, r_hi)):
      continue  # no overlap
    flat = np.arange(int(np.prod(b.shape))) if b.indices is None else b.indices
    coords = np.stack(np.unravel_index(flat, b.shape), -1) + lo if len(b.shape) else np.zeros((flat.size, 0), int)
    inside = np.all((coords >= r_lo) & (coords < r_hi), axis=-1)
    idx.append(np.ravel_multi_index(tuple((coords[inside] - r_lo).T), shape).astype(np.int32) if len(shape)
               else np.zeros(int(inside.sum()), np.int32))
    vals.append(b.values[inside])
  if not idx:
    return np.zeros((0,), np.int32), np.zeros((0,), blocks[0].values.dtype if blocks else np.float32)
  return np.concatenate(idx), np.concatenate(vals)


def _scatter_block(w: Array, upd, dtype) -> Array:
  """A new array: `w` (one device's block) with the updates `_updates` found for it."""
  if isinstance(upd, np.ndarray):  # dense
    return jax.device_put(np.asarray(upd, dtype), next(iter(w.devices())) if isinstance(w, jax.Array) else None)
  indices, values = upd
  n = _pad(indices.size)
  idx = np.full((n,), w.size, np.int32)
  idx[:indices.size] = indices
  vals = np.zeros((n,), dtype)
  vals[:values.size] = values
  return _scatter(w, jnp.asarray(idx), jnp.asarray(vals))


def apply(sampler_params, payload: Payload):
  """Receiver side (Alg. 3): scatters the payload into a copy of the sampler's parameters, block by block of the
  receiver's own layout (each device's shard takes what the payload's blocks change in its region, whatever the
  sender's layout was). Returns new arrays in the receiver's layout (no donation: the old copy may still be pinned
  by a ParamStore snapshot).
  """
  ws, treedef = jax.tree.flatten(sampler_params)
  if treedef != payload.treedef:
    raise ValueError(f"payload structure {payload.treedef} does not match the sampler params {treedef}")
  out = []
  for w, leaf in zip(ws, payload.leaves):
    if tuple(w.shape) != leaf.shape:
      raise ValueError(f"payload shape {leaf.shape} does not match the sampler tensor {w.shape}")
    dtype = np.dtype(w.dtype)
    if not isinstance(w, jax.Array) or len(w.sharding.device_set) == 1:
      out.append(_scatter_block(w, _updates(leaf.blocks, (0,) * w.ndim, tuple(w.shape)), dtype))
      continue
    shards = [_scatter_block(s.data, _updates(leaf.blocks, _start(s.index, w.shape), tuple(s.data.shape)), dtype)
              for s in w.addressable_shards]
    out.append(jax.make_array_from_single_device_arrays(w.shape, w.sharding, shards))
  return jax.tree.unflatten(treedef, out)


def payload_bytes(payload: Payload) -> int:
  """Bytes on the wire: indices + values of sparse blocks, values of dense ones (unpadded)."""
  return sum(b.values.nbytes + (0 if b.indices is None else b.indices.nbytes)
             for leaf in payload.leaves for b in leaf.blocks)


def dense_bytes(payload: Payload) -> int:
  """The cost of sending every tensor whole in the sampler dtype."""
  return sum(int(np.prod(leaf.shape)) * leaf.blocks[0].values.dtype.itemsize for leaf in payload.leaves if leaf.blocks)


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


def _into_layout_of(x, like):
  """`x` laid out as `like`. Multi-controller JAX moves arrays across processes only within one device set: a copy
  replicated over other devices (the async sampler's replicas of a restored base) goes through this process's
  replica on the host; every process holds the same values."""
  if not isinstance(x, jax.Array) or not isinstance(like, jax.Array) or x.sharding == like.sharding:
    return x
  if not x.is_fully_addressable and x.sharding.device_set != like.sharding.device_set:
    from jaxrl_llm import multiprocess  # local: one process never needs it
    return jax.device_put(np.asarray(multiprocess.local_view(x)), like.sharding)
  return jax.device_put(x, like.sharding)


class SyncLink:
  """Both ends of one trainer -> sampler link (every process runs both, each on its own shards); holds references
  and counters only.

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
      prev = jax.tree.map(_into_layout_of, self.low, params)
      union, low = track_step(init_union(params), prev, params, self.dtype)
      payload = pack(low, union, self.max_density)
      receiver = apply(self.receiver, payload)
      stats = SyncStats(payload_bytes(payload), dense_bytes(payload), density(union))
    self.low, self.receiver, self.last = low, receiver, stats
    self.total_payload_bytes += stats.payload_bytes
    self.total_dense_bytes += stats.dense_bytes
    self.syncs += 1
    return receiver
