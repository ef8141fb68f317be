"""ParamStore: versioned, immutable, refcounted parameter snapshots.

`publish(params)` copies the learner's parameters into the sampler's dtype, and into the sampler's
layout when `sampler_shardings` is given (`jaxrl_llm.sharding.reshard`: e.g. FSDP-sharded learner ->
tensor-parallel sampler), and assigns the next version. The learner step donates its buffers, so a
snapshot must never alias them: publish always copies. `acquire(version)`
pins a snapshot (refcount + 1); `release` unpins it. A snapshot is freed once it is unpinned and
older than the retention window `keep_last` (what lagged generation / old-log-prob recompute need).

`weight_sync="sparse"` builds each sampler copy the way a remote sampler would receive it
(SparseRL-Sync, `rollout/sparse_sync.py`): the previous copy plus the elements that changed bitwise
since the previous publish, so the copy is bit-identical to the dense one and every publish records
its payload (`sync_metrics`). The first publish is dense; after `restore` the newest restored
snapshot is the common base (or, under a `sampler_transform`, the next publish is dense). A
transform (int8) runs after the reconstruction, on the receiver: the payload carries the cast
weights, since one changed weight moves a whole channel's int8 scale. Needs the learner's layout
(`sampler_shardings` None).

`view` (async over several processes: `multiprocess.local_view`) is applied to every sampler copy on the
publishing (or restoring) thread, before the snapshot is visible, and kept as `Snapshot.worker_params`:
a rollout worker thread then runs the arrays it is handed and never builds arrays from the global
snapshot itself, concurrently with the learner's publishes, reshards and collectives.

LoRA (a policy pytree with adapters, `models.lora`): the store holds adapter versions. The first publish
copies the frozen base once; every publish copies the adapters (`Snapshot.adapters`, learner dtype) and sends
them to the sampler (dense, or as a sparse delta of the adapters under `weight_sync="sparse"`), which merges
them into its base copy: `Snapshot.params` are merged weights, so generation never merges per token. The
learner copy (`keep_learner_copy`) is the base + that version's adapters (merged in the scoring forward).
`sync_payload_ratio` is then the adapter payload over the full model's bytes in the sampler dtype.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.config import WEIGHT_SYNC
from jaxrl_llm.models import lora
from jaxrl_llm.rollout import sparse_sync


class Snapshot(NamedTuple):
  version: int
  params: Any  # sampler layout/dtype copy; never aliased with learner buffers
  learner_params: Any  # learner-dtype copy for exact old-log-prob recompute (None when not kept)
  worker_params: Any = None  # `params` as a rollout worker runs them (the store's view of them; `params` without one)
  adapters: Any = None  # LoRA: this version's adapters (learner dtype); `params` are the merged weights


def copy_tree(params, dtype=None):
  """A real device copy (optionally cast). `jnp.array(x, copy=True)` never aliases a donated buffer."""
  if dtype is None:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), params)
  return jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True) if jnp.issubdtype(x.dtype, jnp.floating)
                      else jnp.array(x, copy=True), params)


class ParamStore:
  """Holds snapshots by version. Thread-safe; holds only references and counters."""

  def __init__(self, keep_last: int = 1, sampler_dtype=None, keep_learner_copy: bool = False, sampler_shardings=None,
               sampler_transform=None, weight_sync: str = "full", view=None):
    if keep_last < 1:
      raise ValueError("keep_last must be >= 1")
    if weight_sync not in WEIGHT_SYNC:
      raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC}, got {weight_sync!r}")
    self._keep_last = keep_last
    self._sampler_dtype = sampler_dtype
    self._sampler_shardings = sampler_shardings  # None: keep the learner's layout
    self._sampler_transform = sampler_transform  # e.g. int8 weight-only quantisation (sampling/quantize.py)
    self._keep_learner = keep_learner_copy
    self._snaps: dict[int, Snapshot] = {}
    self._refs: dict[int, int] = {}
    self._next_version = 0
    self._lock = threading.Lock()  # snapshots and refcounts (workers acquire while the learner publishes)
    self._publish_lock = threading.Lock()  # one publish / restore at a time (the sync link's state); outer lock
    self._link = sparse_sync.SyncLink(sampler_dtype) if weight_sync == "sparse" else None
    self._view = view  # sampler copy -> the arrays a worker thread runs (made on the publishing thread)
    self._lora_base = None  # LoRA: the frozen base, copied at the first publish (learner dtype)
    self._lora_sync = None  # LoRA: (payload bytes, full model bytes) of the newest publish

  def _worker_copy(self, params):
    return params if self._view is None else self._view(params)

  @property
  def keeps_learner_copy(self) -> bool:
    return self._keep_learner

  def sampler_copy(self, params):
    """`params` as a snapshot holds them (the sampler's dtype and transform)."""
    if self._sampler_shardings is None:
      out = copy_tree(params, self._sampler_dtype)
    else:
      from jaxrl_llm.sharding import reshard
      out = reshard(params, self._sampler_shardings, self._sampler_dtype)
    return self._transform(out)

  def _transform(self, params):
    return self._sampler_transform(params) if self._sampler_transform is not None else params

  def restore(self, version: int, params, learner_params=None) -> None:
    """Puts back a checkpointed snapshot as is (no cast), e.g. on resume; versions must increase. A LoRA
    policy pytree (`params` with adapters, `learner_params` ignored) is merged again as by `publish`."""
    if lora.has_adapters(params):
      self.publish(params, version)
      return
    with self._publish_lock:
      worker = self._worker_copy(params)
      with self._lock:
        if version < self._next_version:
          raise ValueError(f"version {version} already held (next is {self._next_version})")
        self._snaps[version] = Snapshot(version, params, learner_params if self._keep_learner else None, worker)
        self._refs.setdefault(version, 0)
        self._next_version = version + 1
        self._gc()
      if self._link is not None:  # restored in increasing order: the newest is the base of the next delta
        self._link.reset(params if self._sampler_transform is None else None)

  @property
  def latest_version(self) -> int:
    return self._next_version - 1

  def held_versions(self) -> list[int]:
    with self._lock:
      return sorted(self._snaps)

  def publish(self, params, version: int | None = None, sampler_params=None) -> int:
    """Stores a copy of `params` as the next version (or `version`, e.g. on resume) and returns it.
    `sampler_params`: what the sampler runs instead, when it differs from the learner's (PR2's predicted routers;
    the learner copy, for π_old, is still `params`)."""
    with self._publish_lock:  # the copies are made outside `_lock`: workers keep acquiring meanwhile
      adapters = None
      if lora.has_adapters(params):
        sampler, learner, adapters = self._lora_copies(params)
      else:
        sent = params if sampler_params is None else sampler_params
        sampler = self.sampler_copy(sent) if self._link is None else \
            self._transform(self._link.sync(sent, self._sampler_shardings))
        learner = copy_tree(params) if self._keep_learner else None
      worker = self._worker_copy(sampler)
      with self._lock:
        v = self._next_version if version is None else version
        if v < self._next_version:
          raise ValueError(f"version {v} already published (next is {self._next_version})")
        self._snaps[v] = Snapshot(v, sampler, learner, worker, adapters)
        self._refs.setdefault(v, 0)
        self._next_version = v + 1
        self._gc()
    return v

  def _lora_copies(self, params):
    """(sampler copy, learner copy, adapters) of a LoRA policy: the base is copied once (its buffers are the
    learner's, which its step donates), the adapters every time; the sampler merges what it received."""
    base, adapters = lora.split(params)
    if self._lora_base is None:
      self._lora_base = copy_tree(base)
    adapters = copy_tree(adapters)
    sent = sparse_sync.cast(adapters, self._sampler_dtype) if self._link is None else self._link.sync(adapters)
    merged = lora.merge(self._lora_base, sent)
    self._lora_sync = (lora.nbytes(sent) if self._link is None else self._link.last.payload_bytes,
                       sum(x.size for x in jax.tree.leaves(merged)) * jnp.dtype(self._sampler_dtype or
                                                                             jnp.float32).itemsize)
    learner = lora.attach(self._lora_base, adapters) if self._keep_learner else None
    return self.sampler_copy(merged), learner, adapters

  def sync_metrics(self) -> dict:
    """Sparse sync: `sync_payload_ratio` (payload / dense bytes) and `sync_changed_frac` of the newest
    publish; {} under full sync."""
    last = None if self._link is None else self._link.last
    if self._lora_sync is not None:  # LoRA: the adapters sent over the full model's bytes
      payload, full = self._lora_sync
      return {"sync_payload_ratio": payload / max(full, 1),
              **({} if last is None else {"sync_changed_frac": last.changed_frac})}
    return {} if last is None else {"sync_payload_ratio": last.ratio, "sync_changed_frac": last.changed_frac}

  def sync_totals(self) -> dict:
    """Sparse sync: bytes sent and dense bytes over this store's publishes; {} under full sync."""
    link = self._link
    return {} if link is None else {"sync_publishes": link.syncs, "sync_payload_bytes_total": link.total_payload_bytes,
                                    "sync_dense_bytes_total": link.total_dense_bytes}

  def acquire(self, version: int | None = None) -> Snapshot:
    """Pins and returns the snapshot of `version` (default: the newest)."""
    with self._lock:
      v = self.latest_version if version is None else version
      if v not in self._snaps:
        raise KeyError(f"version {v} is not held (held: {sorted(self._snaps)})")
      self._refs[v] += 1
      return self._snaps[v]

  def release(self, snapshot: Snapshot) -> None:
    with self._lock:
      v = snapshot.version
      if self._refs.get(v, 0) <= 0:
        raise ValueError(f"release of version {v} that is not acquired")
      self._refs[v] -= 1
      self._gc()

  def _gc(self) -> None:
    oldest_kept = self._next_version - self._keep_last
    for v in [v for v in self._snaps if v < oldest_kept and self._refs[v] == 0]:
      del self._snaps[v], self._refs[v]
