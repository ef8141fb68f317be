"""Teacher top-k score cache: ids, log-probs and the residual log-mass, computed in T-chunks.

`build_topk_cache` is for callers that already hold [B, T, V] logits (tiny vocabularies, tests, offline
caches). Scoring a model never forms them: `models.token_logprobs(..., topk=k)` (what the teacher scorer
uses) builds the same cache from hidden states with the chunked lm-head.
`RowCache` keeps a run's teacher scores per rollout row on the host, so that a row served again (replay)
is not re-scored (`distill.topk_cache`, wired in `distill.extras`).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Array = jax.Array


@struct.dataclass
class TopKCache:
  """Per position: the teacher's k most likely ids, their log-probs, and log(1 − Σ_k p_k)."""

  ids_BTk: Array  # int32
  logp_BTk: Array  # float32 (or the requested storage dtype), sorted descending
  residual_logp_BT: Array  # float32 log of the tail mass (-inf when the top-k hold everything)


def _chunk_stats(logits_BCV: Array, k: int, temperature: float):
  z = logits_BCV.astype(jnp.float32) / temperature
  lse = jax.nn.logsumexp(z, axis=-1)
  vals, ids = jax.lax.top_k(z, k)
  # The tail's log-mass from the logits themselves (exact), not from 1 − Σ exp (cancellation).
  in_top = jnp.zeros(z.shape, bool).at[
      jnp.arange(z.shape[0])[:, None, None], jnp.arange(z.shape[1])[None, :, None], ids].set(True)
  tail = jax.nn.logsumexp(jnp.where(in_top, -jnp.inf, z), axis=-1)
  return ids.astype(jnp.int32), vals - lse[..., None], tail - lse


def build_topk_cache(logits_BTV: Array, k: int, *, temperature: float = 1.0, chunk_size: int = 256,
                     dtype=jnp.float32) -> TopKCache:
  """Top-k cache of softmax(logits / temperature), processing `chunk_size` positions at a time.

  Memory: besides the input, only one [B, chunk, V] float32 slab is live (lax.map over T-chunks), so
  the cache can be built from bf16 teacher logits without a float32 copy of [B, T, V]. Cache teacher
  log-probs at T = 1 unless the student's target is tempered (spec A1.4). `dtype` is the storage dtype
  of `logp_BTk` (e.g. bfloat16 to halve the cache); the residual stays float32.
  """
  B, T, V = logits_BTV.shape
  if not 0 < k <= V:
    raise ValueError(f"top-k width k={k} must be in [1, V={V}]")
  C = max(1, min(chunk_size, T))
  n = math.ceil(T / C)
  x = jnp.pad(logits_BTV, ((0, 0), (0, n * C - T), (0, 0))).reshape(B, n, C, V).swapaxes(0, 1)
  ids, logp, tail = jax.lax.map(lambda c: _chunk_stats(c, k, temperature), x)
  unchunk = lambda a: a.swapaxes(0, 1).reshape(B, n * C, *a.shape[3:])[:, :T]
  return TopKCache(unchunk(ids), unchunk(logp).astype(dtype), unchunk(tail))


def with_residual(cache: TopKCache) -> Array:
  """[B, T, K+1] log-probs: the k cached classes plus the residual class (they sum to 1 in probability)."""
  return jnp.concatenate([cache.logp_BTk.astype(jnp.float32), cache.residual_logp_BT[..., None]], axis=-1)


def gather_logp(logits_BTV: Array, ids_BTk: Array, temperature: float = 1.0) -> Array:
  """log softmax(logits / T) at `ids` (full-vocabulary normalised; e.g. the student at the teacher's ids).

  Invalid ids (< 0) give -inf, which the top-k losses treat as an invalid slot.
  """
  lp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32) / temperature, axis=-1)
  out = jnp.take_along_axis(lp, jnp.maximum(ids_BTk, 0), axis=-1)
  return jnp.where(ids_BTk >= 0, out, -jnp.inf)


class RowCache:
  """Host-side teacher scores of rollout rows (a dict of numpy arrays per row), least recently used out first.

  A row is keyed by its content and its teacher (`keys`): a frozen teacher scores the same row the same way
  whenever it comes back, so the key needs no step, version or buffer id. `counters`: hits, misses (rows
  looked up and not found) and evictions since the cache was made.
  """

  def __init__(self, capacity: int):
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1 row, got {capacity}")
    self.capacity = capacity
    self._rows: OrderedDict[bytes, dict] = OrderedDict()
    self.counters = {"hits": 0, "misses": 0, "evicted": 0}

  def __len__(self) -> int:
    return len(self._rows)

  @staticmethod
  def keys(tag: int, *arrays_B_) -> list[bytes]:
    """One key per row: a hash of `tag` (the teacher) and the row of every array (tokens, positions, segments,
    loss mask), each with its dtype and shape."""
    arrays = [np.ascontiguousarray(np.asarray(a)) for a in arrays_B_]
    out = []
    for b in range(arrays[0].shape[0]):
      h = hashlib.blake2b(str(int(tag)).encode(), digest_size=16)
      for a in arrays:
        h.update(f"{a.dtype.str}{a.shape[1:]}".encode())
        h.update(a[b].tobytes())
      out.append(h.digest())
    return out

  def get(self, key: bytes) -> dict | None:
    row = self._rows.get(key)
    if row is None:
      self.counters["misses"] += 1
      return None
    self._rows.move_to_end(key)
    self.counters["hits"] += 1
    return row

  def put(self, key: bytes, row: dict) -> None:
    self._rows[key] = {k: np.array(v, copy=True) for k, v in row.items()}
    self._rows.move_to_end(key)
    while len(self._rows) > self.capacity:
      self._rows.popitem(last=False)
      self.counters["evicted"] += 1
