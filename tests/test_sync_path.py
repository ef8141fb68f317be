"""Sparse weight sync on the publish path: bit-identical to the dense copy over real learner steps (fp32,
bf16, int8 samplers), resume keeps the delta base, metrics and run_info record the payload, config checks."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import loop, wiring
from jaxrl_llm.config import load_file
from jaxrl_llm.rollout import sparse_sync as ss
from jaxrl_llm.rollout.param_store import ParamStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny():
  c = load_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.log.tensorboard = False
  return c


def same_bits(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  same = lambda x, y: x.dtype == y.dtype and np.array_equal(np.asarray(ss.bits(x)), np.asarray(ss.bits(y)))
  return len(la) == len(lb) and all(same(x, y) for x, y in zip(la, lb))


class TeeStore(ParamStore):
  """The loop's store, built sparse; every publish is also published densely into a reference store and the
  two snapshots are compared bit for bit before the next learner step donates the parameters."""

  def __init__(self, **kw):
    super().__init__(**{**kw, "weight_sync": "sparse"})
    self.dense = ParamStore(**{**kw, "weight_sync": "full"})
    self.checked = []

  def publish(self, params, version=None):
    v = super().publish(params, version)
    self.dense.publish(params, v)
    a, b = self.acquire(v), self.dense.acquire(v)
    try:
      assert same_bits(a.params, b.params), f"version {v}: sparse sampler copy differs from the dense one"
      assert (a.learner_params is None) == (b.learner_params is None)
    finally:
      self.release(a)
      self.dense.release(b)
    self.checked.append((v, self.sync_metrics()))
    return v


@pytest.mark.parametrize("dtype, quantize", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8")])
def test_sparse_publish_is_bit_identical_over_learner_steps(tmp_path, monkeypatch, dtype, quantize):
  stores = []
  monkeypatch.setattr(wiring, "ParamStore", lambda **kw: stores.append(TeeStore(**kw)) or stores[-1])
  c = tiny()
  c.sampler.dtype, c.sampler.quantize = dtype, quantize
  c.rollout.weight_sync = "sparse"
  c.loss.entropy_coef = 0.01  # a gradient even though every reward of the untrained policy is 0
  c.optim.lr, c.optim.warmup_steps = 1e-5, 0  # at 1e-4 Adam flips ~75% of this tiny model's small bf16 weights
  c.num_steps, c.eval.every = 4, 0
  rows = loop.run(c, str(tmp_path))
  store = stores[0]
  assert [v for v, _ in store.checked] == [0, 1, 2, 3, 4]  # initial publish + one per learner step, all checked
  assert store.checked[0][1] == {"sync_payload_ratio": 1.0, "sync_changed_frac": 1.0}  # the first publish is dense
  assert all(r["update_skipped"] == 0 and r["grad_norm"] > 0 for r in rows)
  for r, (_, m) in zip(rows, store.checked[1:]):
    assert r["sync_payload_ratio"] == m["sync_payload_ratio"] and r["sync_changed_frac"] == m["sync_changed_frac"]
    assert 0.0 < r["sync_changed_frac"] <= 1.0 and 0.0 < r["sync_payload_ratio"] <= 1.0
  if dtype == "bfloat16":
    # Small Adam steps flip a minority of the bf16 elements: the payload is well below the dense copy.
    assert max(r["sync_changed_frac"] for r in rows) < 0.3 and max(r["sync_payload_ratio"] for r in rows) < 0.7
  else:
    assert min(r["sync_changed_frac"] for r in rows) > 0.5  # Adam moves nearly every fp32 element
  info = json.load(open(tmp_path / "run_info.json"))
  assert info["sync_publishes"] == 5 and 0 < info["sync_payload_bytes_total"] <= info["sync_dense_bytes_total"]


def test_full_sync_rows_have_no_sync_fields(tmp_path):
  c = tiny()
  c.num_steps, c.eval.every = 1, 0
  rows = loop.run(c, str(tmp_path))
  assert not any(k.startswith("sync_") for k in rows[0])
  assert not any(k.startswith("sync_") for k in json.load(open(tmp_path / "run_info.json")))


def _params(seed: int):
  k = jax.random.key(seed)
  return {"a": jax.random.normal(k, (8, 16)), "b": {"w": jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)}}


def _nudge(params, t: int):
  """A small step: some bf16 elements flip, most do not."""
  return jax.tree.map(lambda x: x + 1e-3 * jax.random.normal(jax.random.key(100 + t), x.shape), params)


@pytest.mark.parametrize("transform", [None, "int8"])
def test_restore_is_the_base_of_the_next_delta(transform):
  from jaxrl_llm.sampling.quantize import quantize_dequantize_int8
  tf = None if transform is None else jax.jit(lambda p: jax.tree.map(lambda w: quantize_dequantize_int8(w, 1), p))
  kw = dict(keep_last=2, sampler_dtype=jnp.dtype(jnp.bfloat16), sampler_transform=tf)
  ps = [_params(0)]
  for t in range(3):
    ps.append(_nudge(ps[-1], t))
  a = ParamStore(**kw, weight_sync="sparse")
  for p in ps[:3]:
    a.publish(p)
  uninterrupted = a.sync_metrics()
  # Resume: a fresh store gets the checkpointed snapshots (as the loop's _restore does), then publishes on.
  b = ParamStore(**kw, weight_sync="sparse")
  for v in a.held_versions():
    snap = a.acquire(v)
    b.restore(v, snap.params)
    a.release(snap)
  assert b.sync_metrics() == {}  # nothing published by this store yet
  a.publish(ps[3])
  b.publish(ps[3])
  sa, sb = a.acquire(3), b.acquire(3)
  assert same_bits(sa.params, sb.params)
  a.release(sa)
  b.release(sb)
  assert same_bits(sb.params, ParamStore(**kw).sampler_copy(ps[3]))
  if transform is None:  # the restored newest snapshot is the cast copy both ends hold: still a delta
    assert b.sync_metrics() == a.sync_metrics() and b.sync_metrics()["sync_payload_ratio"] < 1.0
    assert uninterrupted["sync_changed_frac"] < 0.5
  else:  # a transformed snapshot is not the cast copy: the first publish after a restore is dense
    assert b.sync_metrics() == {"sync_payload_ratio": 1.0, "sync_changed_frac": 1.0}


def test_sparse_store_survives_donated_learner_buffers():
  # fp32 sampler at the learner dtype: the tracked copy must not alias the learner's (donated) buffers.
  s = ParamStore(keep_last=1, weight_sync="sparse")
  step = jax.jit(lambda p: jax.tree.map(lambda x: x + 1.0, p), donate_argnums=0)
  params = _params(0)
  s.publish(params)
  for _ in range(3):
    ref = jax.tree.map(lambda x: np.asarray(x) + 1.0, params)
    params = step(params)
    s.publish(params)
    snap = s.acquire()
    assert same_bits(snap.params, ref) and s.sync_metrics()["sync_changed_frac"] == 1.0
    s.release(snap)
  assert s.sync_totals()["sync_publishes"] == 4


def test_sparse_validates_on_a_mesh_and_rejects_bad_values(monkeypatch):
  """Sparse sync on a mesh (the receiver in the sampler's layout: tests/test_sharding.py's 8-device check)."""
  with pytest.raises(ValueError, match="weight_sync"):
    ParamStore(weight_sync="delta")
  c = tiny()
  c.rollout.weight_sync = "delta"
  with pytest.raises(config_lib.ConfigError, match=r"config\.rollout\.weight_sync='delta'"):
    config_lib.validate(c)
  c = tiny()
  c.rollout.weight_sync = "sparse"
  c.mesh.fsdp = 2
  monkeypatch.setattr(jax, "device_count", lambda: 2)  # validate only counts devices
  config_lib.validate(c)
