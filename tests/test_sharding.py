"""Sharding: rules, mesh checks, reshard copies; on 8 forced CPU devices (a subprocess), sharded learner
steps equal the single-device step for several mesh shapes, the tensor-parallel sampler equals the
unsharded one, sharded init never materialises the parameters on one device, publish reshards.

The 8-device checks run this file as a script in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 set before jax is imported (the rest of the suite
runs on one device). The script prints one JSON object of measured differences; the tests assert on it.
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from devices import with_devices

# Stated tolerances (float32, CPU): a different partitioning changes only the summation order.
TOL_PARAMS = 1e-6  # max |Δ| of parameters after two SGD-momentum steps at lr 0.1 (= 0.1 · |Δ grad| scale)
TOL_METRIC = 1e-5  # relative, loss / grad norm
TOL_LOGP = 1e-4  # sampler behaviour log-probs (weights scaled 10×: logits are O(10-100))

MESHES = {  # name -> (data, fsdp, tensor, expert)
    "fsdp8": (1, 8, 1, 1),
    "data2_fsdp4": (2, 4, 1, 1),
    "fsdp4_tensor2": (1, 4, 2, 1),
}
MOE_MESHES = {"fsdp2_tensor2_expert2": (1, 2, 2, 2)}
SAMPLER_MESHES = {"tensor2_data4": (4, 1, 2, 1)}


# ----------------------------------------------------------------------------------- 8-device worker

def _model_cfgs():
  from jaxrl_llm.models import ModelConfig
  dense = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                      max_seq_len=16)
  return dense, dataclasses.replace(dense, num_experts=4, experts_per_token=2)


def _batch(cfg, B=8, P=4, N=4, seed=0):
  """A deterministic learner batch whose behaviour/prox log-probs come from the params themselves."""
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  seq = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, P + N)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(P + N, dtype=jnp.int32), (B, P + N))
  seg = jnp.ones((B, P + N), jnp.int32)
  mask = jnp.asarray(rng.random((B, N)) < 0.85, jnp.float32).at[:, 0].set(1.0)
  adv = jnp.asarray(rng.normal(size=(B, 1)), jnp.float32) * mask
  return seq, pos, seg, mask, adv


def _run_steps(cfg, mesh=None, steps=2):
  """Two SGD-momentum ppo_clip steps (+ router aux for MoE); returns (init params, final params, metrics list)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jaxrl_llm import learner, sharding
  # SGD with momentum: optimiser state that mirrors the params (sharded through tree_map_params), and
  # parameter differences that are 0.1 × gradient differences (Adam would amplify tiny gradients).
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
  key = jax.random.key(0)
  seq, pos, seg, mask, adv = _batch(cfg)
  score = learner.make_score_fn(cfg, 1.0)
  aux_coef = 0.01 if cfg.num_experts else 0.0
  if mesh is None:  # the reference: one device, no shardings anywhere
    one = sharding.make_mesh(devices=jax.devices()[:1])
    params = sharding.init_params_sharded(cfg, key, sharding.param_shardings(cfg, one, sharding.LEARNER))
    state = learner.init_state(params, tx)
    step = learner.make_train_step(cfg, tx, "ppo_clip", router_aux_coef=aux_coef)
    put = lambda x: x
  else:
    psh = sharding.param_shardings(cfg, mesh, sharding.LEARNER)
    params = sharding.init_params_sharded(cfg, key, psh)
    shapes = jax.eval_shape(lambda p: learner.init_state(p, tx), params)
    ssh = sharding.state_shardings(shapes, psh, tx, mesh)
    state = sharding.init_state_sharded(params, tx, ssh)
    ins, outs = sharding.train_step_shardings(ssh, mesh, sharding.LEARNER, seq.shape[0])
    step = learner.make_train_step(cfg, tx, "ppo_clip", router_aux_coef=aux_coef, in_shardings=ins,
                                   out_shardings=outs)
    put = lambda x: jax.device_put(x, ins[1])
  init = jax.tree.map(np.asarray, params)
  metrics = []
  for t in range(steps):
    logp = score(state.params, put(seq), put(pos), put(seg), put(mask))
    batch = learner.Batch(sequence_BT=put(seq), positions_BT=put(pos), segment_ids_BT=put(seg), mask_BN=put(mask),
                          adv_BN=put(adv), behavior_logp_BN=logp, versions_BN=put(jnp.zeros(mask.shape, jnp.int32)),
                          lag_B=put(jnp.zeros(mask.shape[:1], jnp.int32)), prox_logp_BN=logp)
    state, m = step(state, batch, jax.random.key(t))
    metrics.append({k: float(v) for k, v in m.items()})
  layout_ok = True
  if mesh is not None:
    psh = sharding.param_shardings(cfg, mesh, sharding.LEARNER)
    layout_ok = all(a.sharding.is_equivalent_to(s, a.ndim)
                    for a, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(psh)))
  return init, jax.tree.map(np.asarray, state.params), metrics, layout_ok


def _max_diff(a, b):
  import jax
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _rel(a, b):
  return abs(a - b) / max(abs(b), 1e-12)


def _learner_checks(out):
  dense, moe = _model_cfgs()
  from jaxrl_llm import sharding
  for cfg, meshes in ((dense, MESHES), (moe, MOE_MESHES)):
    init0, final0, m0, _ = _run_steps(cfg)
    for name, shape in meshes.items():
      init, final, m, layout_ok = _run_steps(cfg, sharding.make_mesh(*shape))
      out[f"learner/{name}"] = {
          "init_diff": _max_diff(init, init0), "param_diff": _max_diff(final, final0), "layout_ok": layout_ok,
          "loss_rel": max(_rel(a["loss"], b["loss"]) for a, b in zip(m, m0)),
          "grad_norm_rel": max(_rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(m, m0)),
          "grad_norm": m0[0]["grad_norm"]}


def _sampler_checks(out):
  import jax
  import jax.numpy as jnp
  from jaxrl_llm import sharding
  from jaxrl_llm.models import init_params
  from jaxrl_llm.sampling import SamplerConfig, generate
  sc = SamplerConfig(max_new_tokens=5, stop_ids=(3,), temperature=0.8)
  B, P = 8, 4
  prompts = jnp.asarray(np.random.default_rng(1).integers(4, 32, (B, P)), jnp.int32)
  plen = jnp.asarray([4, 2, 3, 4, 1, 4, 2, 3], jnp.int32)
  for cfg, meshes in zip(_model_cfgs(), (SAMPLER_MESHES, {"expert4_data2": (2, 1, 1, 4)})):
    params = jax.tree.map(lambda x: 10.0 * x, init_params(cfg, jax.random.key(0)))  # peaked distributions
    ref = generate(params, prompts, plen, jax.random.key(5), cfg, sc)
    for name, shape in meshes.items():
      mesh = sharding.make_mesh(*shape)
      sp = sharding.reshard(params, sharding.param_shardings(cfg, mesh, sharding.SAMPLER))
      bsh = sharding.batch_sharding(mesh, sharding.SAMPLER, B)
      got = generate(sp, jax.device_put(prompts, bsh), jax.device_put(plen, bsh), jax.random.key(5), cfg, sc)
      res = {"tokens_equal": bool(np.array_equal(got["tokens_BN"], ref["tokens_BN"])),
             "logp_diff": float(np.max(np.abs(np.asarray(got["behavior_logp_BN"]) - np.asarray(ref["behavior_logp_BN"])))),
             "wq_spec": str(sp["layers"]["wq"].sharding.spec)}
      if cfg.num_experts:
        res["routes_equal"] = bool(np.array_equal(got["routes_BTLk"], ref["routes_BTLk"]))
        res["w_up_spec"] = str(sp["layers"]["w_up"].sharding.spec)
      out[f"sampler/{cfg.num_experts and 'moe' or 'dense'}/{name}"] = res


def _slot_engine_checks(out):
  """The slot engine on data 2 x fsdp 4 (12 requests through 8 slots: refills): the same tokens as on one device,
  its state's slots split over the batch axes at every step, each device holding one slot's cache."""
  import jax
  import jax.numpy as jnp
  from jaxrl_llm import sharding
  from jaxrl_llm.models import init_params
  from jaxrl_llm.rollout.generation import slot_layout
  from jaxrl_llm.sampling import SamplerConfig, continuous
  cfg = _model_cfgs()[0]
  R, P, S = 12, 4, 8
  rng = np.random.default_rng(3)
  prompts, plen = rng.integers(4, 32, (R, P)).astype(np.int32), rng.integers(1, P + 1, R).astype(np.int32)
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(7), r))(jnp.arange(R))
  params = jax.tree.map(lambda x: 10.0 * x, init_params(cfg, jax.random.key(0)))  # peaked distributions
  mesh = sharding.make_mesh(2, 4, 1, 1)
  sp = sharding.reshard(params, sharding.param_shardings(cfg, mesh, sharding.SAMPLER))
  for name, extra in (("plain", {}), ("speculative", {"spec_gamma": 2, "spec_draft_layers": 1})):
    # half the vocabulary stops: requests end after 1 to 6 tokens, so slots free at different chunks
    sc = SamplerConfig(max_new_tokens=6, stop_ids=tuple(range(3, 19)), temperature=0.8, **extra)
    ref = continuous.generate_slots(params, prompts, plen, keys, cfg, sc, slots=S, chunk=2)
    layout = slot_layout(mesh, S)
    engine = continuous.SlotEngine(cfg, sc, slots=S, chunk=2, width=P, layout=layout)
    for r in range(R):
      engine.submit(r, prompts[r], plen[r], keys[r])
    cols, layout_ok, specs, shard_rows = {}, [], set(), set()
    while not engine.idle:
      cols.update(engine.step(sp, 0))
      st = engine.state
      want = jax.tree.leaves(continuous.slot_shardings(st, layout))
      layout_ok.append(all(x.sharding.is_equivalent_to(w, x.ndim) for x, w in zip(jax.tree.leaves(st), want)))
      specs.add(str(st["cache"]["k"].sharding.spec))
      shard_rows.add(st["cache"]["k"].addressable_shards[0].data.shape[1])
    tokens = np.stack([cols[r]["tokens_N"] for r in range(R)])
    logp = np.stack([cols[r]["behavior_logp_N"] for r in range(R)])
    out[f"slots/{name}"] = {"tokens_equal": bool(np.array_equal(tokens, ref["tokens_BN"])),
                            "logp_diff": float(np.max(np.abs(logp - ref["behavior_logp_BN"]))),
                            "lengths": ref["lengths_B"].tolist(), "layout_ok": layout_ok, "specs": sorted(specs),
                            "shard_rows": sorted(shard_rows), "slot_steps": engine.slot_steps}


def _init_memory_check(out):
  """Per-device bytes of the sharded init program vs the full parameter bytes."""
  import jax
  from jaxrl_llm import sharding
  from jaxrl_llm.models import ModelConfig, init_params_per_leaf, param_shapes
  cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=32, d_ff=512)
  mesh = sharding.make_mesh(1, 8, 1, 1)
  psh = sharding.param_shardings(cfg, mesh, sharding.LEARNER)
  compiled = jax.jit(lambda k: init_params_per_leaf(cfg, k), out_shardings=psh).lower(jax.random.key(0)).compile()
  ma = compiled.memory_analysis()
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(param_shapes(cfg)))
  out["init_memory"] = {"total_param_bytes": total, "per_device_output_bytes": int(ma.output_size_in_bytes),
                        "per_device_temp_bytes": int(ma.temp_size_in_bytes)}


def _reshard_checks(out):
  import jax
  import jax.numpy as jnp
  from jaxrl_llm import sharding
  from jaxrl_llm.rollout.param_store import ParamStore
  cfg = _model_cfgs()[0]
  mesh = sharding.make_mesh(1, 4, 2, 1)
  lsh = sharding.param_shardings(cfg, mesh, sharding.LEARNER)
  ssh = sharding.param_shardings(cfg, mesh, sharding.SAMPLER)
  params = sharding.init_params_sharded(cfg, jax.random.key(0), lsh)
  store = ParamStore(keep_last=1, sampler_dtype=jnp.bfloat16, keep_learner_copy=True, sampler_shardings=ssh)
  snap = store.acquire(store.publish(params))
  leaves, sl, ll = jax.tree.leaves(params), jax.tree.leaves(snap.params), jax.tree.leaves(snap.learner_params)
  ptrs = lambda a: {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
  same = sharding.reshard(params, lsh)  # same layout: must still copy
  out["reshard"] = {
      "sampler_layout_ok": all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(sl, jax.tree.leaves(ssh))),
      "learner_copy_layout_ok": all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(ll, leaves)),
      "sampler_dtype": str(sl[0].dtype),
      "value_diff": max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b.astype(jnp.bfloat16), np.float32))))
                        for a, b in zip(sl, leaves)),
      "shares_buffers": any(ptrs(a) & ptrs(b) for a, b in zip(sl + ll + jax.tree.leaves(same), leaves * 3)),
      "embed_learner_spec": str(params["embed"].sharding.spec), "embed_sampler_spec": str(snap.params["embed"].sharding.spec)}


def _sparse_sync_checks(out):
  """Sparse sync from the learner's layout (6 devices, fsdp 3 x tensor 2) to a sampler of its own (2 devices): every
  publish is bit-identical to the dense cast + reshard, in the sampler's layout, with a payload below dense."""
  import jax
  import jax.numpy as jnp
  from jaxrl_llm import sharding
  from jaxrl_llm.rollout import sparse_sync as ss
  from jaxrl_llm.rollout.param_store import ParamStore
  cfg = _model_cfgs()[0]
  devs = jax.devices()
  lmesh, smesh = sharding.make_mesh(1, 3, 2, 1, devices=devs[:6]), sharding.make_mesh(2, devices=devs[6:])
  lsh = sharding.param_shardings(cfg, lmesh, sharding.LEARNER)
  ssh = sharding.param_shardings(cfg, smesh, sharding.SAMPLER)
  params = sharding.init_params_sharded(cfg, jax.random.key(0), lsh)
  sparse = ParamStore(keep_last=1, sampler_dtype=jnp.bfloat16, sampler_shardings=ssh, weight_sync="sparse")
  dense = ParamStore(keep_last=1, sampler_dtype=jnp.bfloat16, sampler_shardings=ssh)
  # the sampler in the learner's own layout: blocks are the learner's shards, each scattered into its own shard
  sparse_here = ParamStore(keep_last=1, sampler_dtype=jnp.bfloat16, weight_sync="sparse")
  same, layout, ratios, same_here, ratios_here = [], [], [], [], []
  for step in range(3):
    if step:  # a small update: few bf16 elements flip
      noise = jax.tree.map(lambda x: 1e-3 * jnp.ones_like(x) * (jnp.arange(x.size).reshape(x.shape) % 7 == 0), params)
      params = jax.tree.map(lambda x, n: x + n * jnp.abs(x), params, noise)
    a, b = sparse.acquire(sparse.publish(params)), dense.acquire(dense.publish(params))
    same.append(all(np.array_equal(np.asarray(ss.bits(x)), np.asarray(ss.bits(y)))
                    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params))))
    layout.append(all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(a.params),
                                                                              jax.tree.leaves(ssh))))
    ratios.append(sparse.sync_metrics()["sync_payload_ratio"])
    h = sparse_here.acquire(sparse_here.publish(params))
    same_here.append(all(np.array_equal(np.asarray(ss.bits(x)), np.asarray(ss.bits(y.astype(jnp.bfloat16))))
                         and x.sharding == y.sharding
                         for x, y in zip(jax.tree.leaves(h.params), jax.tree.leaves(params))))
    ratios_here.append(sparse_here.sync_metrics()["sync_payload_ratio"])
    sparse.release(a)
    dense.release(b)
    sparse_here.release(h)
  out["sparse_sync"] = {"bit_identical": same, "sampler_layout": layout, "payload_ratio": ratios,
                        "same_layout_bit_identical": same_here, "same_layout_payload_ratio": ratios_here}


def worker():
  """Runs every 8-device check and prints one JSON object."""
  import jax
  assert jax.device_count() == 8, jax.devices()
  out = {}
  _learner_checks(out)
  _sampler_checks(out)
  _slot_engine_checks(out)
  _init_memory_check(out)
  _reshard_checks(out)
  _sparse_sync_checks(out)
  print("RESULT " + json.dumps(out))


@pytest.fixture(scope="module")
def eight(built_once):
  """This file as an 8-device script; built once per session (the `built_once` fixture)."""

  def build():
    env = with_devices(8)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=1200, cwd=root)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])

  return built_once("sharding_eight", build)


# ------------------------------------------------------------------------------------ 8-device tests

@pytest.mark.slow
@pytest.mark.parametrize("name", [*MESHES, *MOE_MESHES])
def test_sharded_learner_step_equals_single_device(eight, name):
  r = eight[f"learner/{name}"]
  assert r["grad_norm"] > 1e-3  # the step really moves the parameters
  assert r["init_diff"] == 0.0  # sharded init draws the same values on every mesh
  assert r["layout_ok"]  # out_shardings keep the learner layout across steps
  assert r["param_diff"] <= TOL_PARAMS, r
  assert r["loss_rel"] <= TOL_METRIC and r["grad_norm_rel"] <= TOL_METRIC, r


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"dense/{n}" for n in SAMPLER_MESHES] + ["moe/expert4_data2"])
def test_tensor_parallel_sampler_equals_unsharded(eight, name):
  r = eight[f"sampler/{name}"]
  assert r["tokens_equal"] and r["logp_diff"] <= TOL_LOGP, r
  assert "tensor" in r["wq_spec"] or "moe" in name
  if "moe" in name:
    assert r["routes_equal"] and "expert" in r["w_up_spec"], r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "speculative"])
def test_slot_engine_splits_its_slots_over_the_batch_axes(eight, name):
  r = eight[f"slots/{name}"]
  assert r["tokens_equal"] and r["logp_diff"] <= TOL_LOGP, r
  assert min(r["lengths"]) < 6 == max(r["lengths"]), r  # requests stop at different columns (12 for 8 slots: refills)
  # the slot layout at every step (every jitted piece keeps it): the 8 slots over data x fsdp, one per device
  assert len(r["layout_ok"]) > 2 and all(r["layout_ok"]), r
  assert len(r["specs"]) == 1 and "'data', 'fsdp'" in r["specs"][0] and r["shard_rows"] == [1], r


@pytest.mark.slow
def test_sharded_init_never_materialises_params_on_one_device(eight):
  r = eight["init_memory"]
  per_device = r["per_device_output_bytes"] + r["per_device_temp_bytes"]
  assert r["per_device_output_bytes"] <= r["total_param_bytes"] / 4
  assert per_device < r["total_param_bytes"] / 2, r


@pytest.mark.slow
def test_publish_reshards_learner_to_sampler_layout_as_a_copy(eight):
  r = eight["reshard"]
  assert r["sampler_layout_ok"] and r["learner_copy_layout_ok"], r
  assert r["sampler_dtype"] == "bfloat16" and r["value_diff"] == 0.0
  assert not r["shares_buffers"]
  assert "fsdp" in r["embed_learner_spec"] and "fsdp" not in r["embed_sampler_spec"], r


@pytest.mark.slow
def test_sparse_sync_to_a_sampler_of_its_own_devices_is_bit_identical(eight):
  r = eight["sparse_sync"]
  assert r["bit_identical"] == [True] * 3 and r["sampler_layout"] == [True] * 3, r
  assert r["payload_ratio"][0] == 1.0 and all(x < 0.9 for x in r["payload_ratio"][1:]), r  # first publish dense
  # and to a sampler in the learner's layout (each shard a block of its own): bit-identical, same layout, sparse
  assert r["same_layout_bit_identical"] == [True] * 3, r
  assert r["same_layout_payload_ratio"][0] == 1.0 and all(x < 0.9 for x in r["same_layout_payload_ratio"][1:]), r


# ----------------------------------------------------------------------------------- in-process tests

def test_logical_to_spec_rules():
  from jax.sharding import AbstractMesh, PartitionSpec as P
  from jaxrl_llm import sharding
  mesh = AbstractMesh((2, 4, 2, 1), sharding.MESH_AXES)
  spec = lambda ax, shp, rules=sharding.LEARNER: sharding.logical_to_spec(ax, shp, mesh, rules)
  assert spec(("layers", "embed", "heads", "head_dim"), (2, 32, 4, 8)) == P(None, "fsdp", "tensor", None)
  assert spec(("layers", "embed", "kv_heads", "head_dim"), (2, 32, 1, 8)) == P(None, "fsdp", None, None)  # 1 % 2
  assert spec(("layers", "embed", "heads", "head_dim"), (2, 32, 4, 8), sharding.SAMPLER) == P(None, None, "tensor", None)
  assert spec(("batch",), (16,)) == P(("data", "fsdp"))  # expert (size 1) dropped
  assert spec(("batch",), (6,)) == P("data")  # longest dividing prefix of (data, fsdp, expert)
  assert spec(("vocab", "embed"), (31, 32)) == P(None, "fsdp")  # 31 % 2: vocab stays replicated
  # A mesh axis is used at most once per array.
  assert sharding.logical_to_spec(("embed", "mlp"), (8, 8), mesh, sharding.Rules(embed="fsdp", mlp="fsdp")) == P("fsdp", None)


def test_param_shardings_cover_every_param_incl_moe():
  import jax
  from jaxrl_llm import sharding
  from jaxrl_llm.models import init_params
  mesh = sharding.make_mesh()
  for cfg in _model_cfgs():
    sh = sharding.param_shardings(cfg, mesh, sharding.LEARNER)
    assert jax.tree.structure(sh) == jax.tree.structure(jax.eval_shape(init_params, cfg, jax.random.key(0)))


def test_make_mesh_checks_the_device_count():
  import jax
  from jaxrl_llm import sharding
  with pytest.raises(ValueError, match="config.mesh"):
    sharding.make_mesh(fsdp=2 * jax.device_count())
  with pytest.raises(ValueError, match="config.mesh"):
    sharding.make_mesh(data=0)
  assert sharding.make_mesh().shape == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}


def test_reshard_is_a_copy_and_casts_floats_only():
  import jax
  import jax.numpy as jnp
  from jaxrl_llm import sharding
  mesh = sharding.make_mesh()
  tree = {"w": jnp.arange(6.0).reshape(2, 3), "ids": jnp.arange(3, dtype=jnp.int32)}
  out = sharding.reshard(tree, sharding.replicated(mesh))
  assert out["w"].unsafe_buffer_pointer() != tree["w"].unsafe_buffer_pointer()
  assert out["ids"].unsafe_buffer_pointer() != tree["ids"].unsafe_buffer_pointer()
  cast = sharding.reshard(tree, sharding.replicated(mesh), dtype=jnp.bfloat16)
  assert cast["w"].dtype == jnp.bfloat16 and cast["ids"].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(cast["w"], np.float32), np.asarray(tree["w"]))
  # The source may be donated / deleted afterwards without touching the copy.
  tree["w"].delete()
  np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(6.0).reshape(2, 3))
  del jax


def test_param_store_publish_with_sampler_shardings_on_one_device():
  import jax
  import jax.numpy as jnp
  from jaxrl_llm import sharding
  from jaxrl_llm.models import init_params
  from jaxrl_llm.rollout.param_store import ParamStore
  cfg = _model_cfgs()[0]
  mesh = sharding.make_mesh()
  params = init_params(cfg, jax.random.key(0))
  store = ParamStore(sampler_shardings=sharding.param_shardings(cfg, mesh, sharding.SAMPLER))
  snap = store.acquire(store.publish(params))
  for a, b in zip(jax.tree.leaves(snap.params), jax.tree.leaves(params)):
    assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
    np.testing.assert_array_equal(a, b)
  del jnp


if __name__ == "__main__":
  worker()
