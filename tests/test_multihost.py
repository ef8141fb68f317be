"""Multi-host: 2 processes on localhost (2 forced CPU devices each, gloo collectives) run sharded learner
steps of a tiny model over a 4-device global mesh; the result equals the single-process run.
Also: `distributed.settings` precedence and `maybe_initialize` as a no-op for one process."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from devices import with_devices

STEPS = 3
MESH = (2, 2, 1, 1)  # data=2 (across the two processes) x fsdp=2
TOL = 1e-6  # max |Δ| of parameters after 3 SGD-momentum steps (summation order only)


def _setup():
  """Model, optimiser and a deterministic global batch (numpy; identical on every process)."""
  import optax
  from jaxrl_llm.models import ModelConfig
  cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=16)
  rng = np.random.default_rng(0)
  B, P, N = 8, 4, 4
  data = {
      "seq": rng.integers(3, 32, (B, P + N)).astype(np.int32),
      "pos": np.broadcast_to(np.arange(P + N, dtype=np.int32), (B, P + N)).copy(),
      "seg": np.ones((B, P + N), np.int32),
      "mask": (np.arange(N)[None] < np.array([4, 1, 2, 4, 3, 4, 2, 1])[:, None]).astype(np.float32),
  }
  data["adv"] = np.linspace(-1, 1, B, dtype=np.float32)[:, None] * data["mask"]
  return cfg, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)), data


def _train(mesh=None):
  """STEPS ppo_clip steps; on a mesh everything is sharded (the batch split across processes)."""
  import jax
  from jaxrl_llm import learner, sharding
  cfg, tx, d = _setup()
  if mesh is None:
    mesh = sharding.make_mesh(devices=jax.local_devices()[:1])
  psh = sharding.param_shardings(cfg, mesh, sharding.LEARNER)
  params = sharding.init_params_sharded(cfg, jax.random.key(0), psh)
  ssh = sharding.state_shardings(jax.eval_shape(lambda p: learner.init_state(p, tx), params), psh, tx, mesh)
  state = sharding.init_state_sharded(params, tx, ssh)
  B = d["mask"].shape[0]
  ins, outs = sharding.train_step_shardings(ssh, mesh, sharding.LEARNER, B)
  step = learner.make_train_step(cfg, tx, "ppo_clip", in_shardings=ins, out_shardings=outs)
  score = learner.make_score_fn(cfg, 1.0)
  g = sharding.put_global(d, ins[1])
  zeros_i = sharding.put_global({"v": np.zeros(d["mask"].shape, np.int32), "l": np.zeros((B,), np.int32)}, ins[1])
  losses = []
  logp = score(state.params, g["seq"], g["pos"], g["seg"], g["mask"])  # one behaviour policy: later steps are off-policy
  for t in range(STEPS):
    batch = learner.Batch(sequence_BT=g["seq"], positions_BT=g["pos"], segment_ids_BT=g["seg"], mask_BN=g["mask"],
                          adv_BN=g["adv"], behavior_logp_BN=logp, versions_BN=zeros_i["v"], lag_B=zeros_i["l"],
                          prox_logp_BN=logp)
    state, m = step(state, batch, jax.random.key(t))
    losses.append(float(m["loss"]))  # metrics are replicated: readable on every process
  from jax.experimental import multihost_utils
  full = multihost_utils.process_allgather(state.params, tiled=True)
  return jax.tree.map(np.asarray, full), losses


def _async_helpers(full_params) -> dict:
  """What async over several processes rests on, checked on this process: a snapshot resharded from the
  4-device learner mesh onto one device of each process (`sharding.reshard` across device sets), viewed
  as this process's own array (`multiprocess.local_view`), equals the learner's parameters; and
  `multiprocess.allgather_host` returns every process's plain data (arrays of several dtypes, lists,
  strings) in process order."""
  import jax
  from jaxrl_llm import multiprocess, sharding
  cfg, _, _ = _setup()
  mesh = sharding.make_mesh(*MESH)
  params = sharding.init_params_sharded(cfg, jax.random.key(0), sharding.param_shardings(cfg, mesh, sharding.LEARNER))
  last = multiprocess.split_devices(jax.devices(), 1)[1]
  sampler = sharding.param_shardings(cfg, sharding.make_mesh(data=len(last), devices=last), sharding.SAMPLER)
  view = multiprocess.local_view(sharding.reshard(params, sampler, jax.numpy.bfloat16))
  from jax.experimental import multihost_utils
  want = jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))
  mine = {d.id for d in last if d.process_index == jax.process_index()}
  same = all(v.is_fully_addressable and {d.id for d in v.devices()} == mine
             and np.array_equal(np.asarray(v, np.float32), w.astype(jax.numpy.bfloat16).astype(np.float32))
             for v, w in zip(jax.tree.leaves(view), jax.tree.leaves(want)))
  me = jax.process_index()
  got = multiprocess.allgather_host({"me": me, "name": f"p{me}", "ids": list(range(me + 1)),
                                     "x": np.arange(3 * (me + 1), dtype=np.float32).reshape(me + 1, 3),
                                     "m": np.array([me == 0, True]), "none": None})
  gathered = [{"me": g["me"], "name": g["name"], "ids": g["ids"], "x": g["x"].tolist(), "x_dtype": str(g["x"].dtype),
               "m": g["m"].tolist(), "none": g["none"]} for g in got]
  return {"snapshot_view_equal": bool(same), "gathered": gathered}


def worker(port: int, process_id: int, out_path: str):
  from jaxrl_llm import distributed, sharding
  assert distributed.maybe_initialize(f"localhost:{port}", 2, process_id, cpu_collectives="gloo")
  import jax
  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  params, losses = _train(sharding.make_mesh(*MESH))
  extra = _async_helpers(params)
  if process_id == 0:
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    np.savez(out_path, **flat)
    with open(out_path + ".json", "w") as f:
      json.dump({"losses": losses, "process_count": jax.process_count(), **extra}, f)
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_localhost_match_single_process(tmp_path):
  import jax
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**with_devices(2), "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  port, out = _free_port(), str(tmp_path / "params.npz")
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(port), str(i), out], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=900)[0])
    except subprocess.TimeoutExpired:
      p.kill()
      logs.append(p.communicate()[0])
  assert all(p.returncode == 0 for p in procs), "\n----\n".join(l[-4000:] for l in logs)

  ref_params, ref_losses = _train()  # this process: one device
  got = np.load(out)
  info = json.load(open(out + ".json"))
  assert info["process_count"] == 2
  assert info["snapshot_view_equal"] is True
  assert info["gathered"] == [
      {"me": 0, "name": "p0", "ids": [0], "x": [[0.0, 1.0, 2.0]], "x_dtype": "float32", "m": [True, True], "none": None},
      {"me": 1, "name": "p1", "ids": [0, 1], "x": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "x_dtype": "float32",
       "m": [False, True], "none": None}]
  np.testing.assert_allclose(info["losses"], ref_losses, rtol=1e-5)
  assert ref_losses[0] != ref_losses[-1]  # the steps really trained
  for k, v in jax.tree_util.tree_leaves_with_path(ref_params):
    np.testing.assert_allclose(got[jax.tree_util.keystr(k)], v, atol=TOL, err_msg=jax.tree_util.keystr(k))


def test_settings_precedence_and_validation():
  from jaxrl_llm import distributed
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
  assert distributed.settings(environ=env) == {"coordinator": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}
  assert distributed.settings("h:1", 2, 0, environ=env) == {"coordinator": "h:1", "num_processes": 2, "process_id": 0}
  assert distributed.settings(environ={}) == {"coordinator": None, "num_processes": None, "process_id": None}
  with pytest.raises(ValueError, match="process_id"):
    distributed.settings("h:1", environ={})
  with pytest.raises(ValueError, match="must be in"):
    distributed.settings("h:1", 2, 2, environ={})


def test_maybe_initialize_is_a_no_op_for_one_process(monkeypatch):
  import jax
  from jaxrl_llm import distributed
  for k in distributed.ENV_VARS.values():
    monkeypatch.delenv(k, raising=False)
  assert distributed.maybe_initialize() is False
  assert distributed.maybe_initialize("localhost:1", 1, 0) is False
  assert not jax.distributed.is_initialized() and distributed.is_coordinator()


def test_dist_config_errors_name_the_field(monkeypatch):
  from jaxrl_llm import config as config_lib, distributed
  from test_loop import tiny
  for k in distributed.ENV_VARS.values():
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setattr(distributed, "detected_cluster", lambda: None)  # not inside a SLURM job / TPU slice
  cases = [({"coordinator_address": "node0"}, r"config\.dist\.coordinator_address='node0': must be 'host:port'"),
           ({"num_processes": 0}, r"config\.dist\.num_processes=0: must be an int >= 1"),
           ({"num_processes": 2, "process_id": 2}, r"config\.dist\.process_id=2: must be < config\.dist\.num_processes=2"),
           ({"heartbeat_timeout_seconds": 0}, r"config\.dist\.heartbeat_timeout_seconds=0"),
           ({"num_processes": 2, "process_id": 0}, r"config\.dist\.coordinator_address=None: .*2 processes need"),
           ({"coordinator_address": "h:1", "num_processes": 2}, r"config\.dist\.process_id=None: .*set both")]
  for fields, msg in cases:
    c = tiny()
    c.dist.update(fields)
    with pytest.raises(config_lib.ConfigError, match=msg):
      distributed.initialize_from_config(c)
  c = tiny()
  assert distributed.initialize_from_config(c) is False  # nothing set, no cluster: one plain process
  c.dist.num_processes, c.dist.process_id = 1, 0
  assert distributed.initialize_from_config(c) is False
  import jax
  assert not jax.distributed.is_initialized()
  assert any(f.startswith("dist.") for f in config_lib.RESUMABLE)  # a run may resume on another process count


class _Dev:
  def __init__(self, process_index, id=0):
    self.process_index, self.id = process_index, id


class _Sharding:
  """`devices_indices_map` of a batch of 8 rows: process 0 holds rows 0-3, process 1 rows 4-7, and
  process 2 holds a replica of rows 4-7 (a replicated axis that spans processes)."""

  def devices_indices_map(self, shape):
    assert shape == (8,)
    return {_Dev(0): (slice(0, 2),), _Dev(0): (slice(2, 4),), _Dev(1): (slice(4, 8),), _Dev(2): (slice(4, 8),)}


def test_split_devices_takes_the_last_devices_of_every_process():
  from jaxrl_llm import multiprocess
  devs = [_Dev(p, i) for p in (0, 1) for i in (3, 2, 1, 0)]  # ids out of order within a process
  first, last = multiprocess.split_devices(devs, 1)
  assert [(d.process_index, d.id) for d in last] == [(0, 3), (1, 3)]
  assert first == [d for d in devs if d.id != 3]
  first, last = multiprocess.split_devices(devs, 0)
  assert first == devs and last == []
  one = [_Dev(0, i) for i in range(8)]  # one process: the plain `devices[:-n]`, `devices[-n:]`
  assert multiprocess.split_devices(one, 2) == (one[:-2], one[-2:])


def test_merge_processes_joins_rows_and_adds_counts():
  from jaxrl_llm.rollout.sources.asynchronous import merge_processes
  from jaxrl_llm.record import Rollout
  z = lambda n: np.zeros((2 * n, 3), np.int32)
  part = lambda p, n: Rollout(
      sequence_BT=z(n), positions_BT=z(n), segment_ids_BT=z(n), mask_BN=z(n), behavior_logp_BN=z(n), versions_BN=z(n),
      reward_B=np.full((2 * n,), p, np.float32), group_B=np.repeat(np.arange(n, dtype=np.int32), 2),
      stats={"reward_errors": p + 1, "async_lag_hist": [n, p], "request_ids": list(range(p, 2 * n, 2)),
             "time_learner_idle_s": 0.5 * (p + 1), "async_buffered": 1})
  got = merge_processes([part(0, 2), part(1, 1)])
  np.testing.assert_array_equal(got.reward_B, [0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(got.group_B, [0, 0, 1, 1, 2, 2])
  assert got.group_B.dtype == np.int32 and got.sequence_BT.shape == (6, 3)
  assert got.stats["reward_errors"] == 3 and got.stats["async_lag_hist"] == [3, 1] and got.stats["async_buffered"] == 2
  assert got.stats["request_ids"] == [0, 1, 2] and got.stats["time_learner_idle_s"] == 1.0
  # async episodes: counters added, the turn mean recomputed over both processes' episodes, the span the larger
  env = lambda p, n, turns, span: {**part(p, n).stats, "env_episodes": 2 * n, "env_turns": turns, "env_done": n,
                                   "env_turns_mean": turns / (2 * n), "env_version_span_max": span,
                                   "episode_status": {"done": n, "error": 0}}
  got = merge_processes([part(0, 2).replace(stats=env(0, 2, 12, 1)), part(1, 1).replace(stats=env(1, 1, 2, 0))])
  assert got.stats["env_episodes"] == 6 and got.stats["env_turns"] == 14 and got.stats["env_done"] == 3
  assert got.stats["env_turns_mean"] == 14 / 6 and got.stats["env_version_span_max"] == 1
  assert got.stats["episode_status"] == {"done": 3, "error": 0} and got.stats["reward_errors"] == 3
  # harness: episode timelines joined in process order, the batcher's largest call the larger, its mean the mean
  serve = lambda p, n: {**part(p, n).stats, "timeline": [{"request_id": p, "episode": f"e{p}"}],
                        "serve_batch_max": 4 + p, "serve_batch_mean": 2.0 + p, "serve_calls": 3}
  got = merge_processes([part(0, 2).replace(stats=serve(0, 2)), part(1, 1).replace(stats=serve(1, 1))])
  assert [e["episode"] for e in got.stats["timeline"]] == ["e0", "e1"]
  assert got.stats["serve_batch_max"] == 5 and got.stats["serve_batch_mean"] == 2.5 and got.stats["serve_calls"] == 6


def test_row_owners_are_the_lowest_process_holding_each_row():
  from jaxrl_llm import multiprocess
  np.testing.assert_array_equal(multiprocess.row_owners(_Sharding(), 8), [0, 0, 0, 0, 1, 1, 1, 1])


def test_one_process_helpers_are_the_plain_behaviour():
  from jaxrl_llm import multiprocess, preemption
  calls = []
  score = lambda ex, t: (calls.append(len(ex)) or np.arange(len(ex), dtype=np.float32), {"ok": len(ex)})
  reward_B, counts = multiprocess.score_rows(score, ["a", "b", "c"], np.zeros((3, 2), np.int32), np.zeros(3, np.int32))
  np.testing.assert_array_equal(reward_B, [0, 1, 2])
  assert counts == {"ok": 3} and calls == [3]
  flag = preemption.PreemptionFlag()
  assert multiprocess.agree_stop(flag) is False and multiprocess.agree_stop(None) is False
  flag.request(15)
  assert multiprocess.agree_stop(flag) is True
  row = {"step": 0, "time_step_s": 1.5}
  assert multiprocess.reduce_times(row) is row and multiprocess.is_writer()


def test_peer_verdict():
  from jaxrl_llm.distributed import peer_verdict
  seen = {1: (None, 0.0), 2: (None, 0.0)}
  alive = {"jaxrl_llm/alive/0": "5", "jaxrl_llm/alive/1": "3", "jaxrl_llm/alive/2": "done"}
  assert peer_verdict(0, 3, alive, {}, seen, 1.0, 10.0) is None
  assert seen[1] == ("3", 1.0)  # the counter moved at t=1
  assert peer_verdict(0, 3, alive, {}, seen, 11.0, 10.0) is None  # 10 s: not more than the timeout
  assert "process 1 stopped responding (11 s" in peer_verdict(0, 3, alive, {}, seen, 12.0, 10.0)
  assert peer_verdict(0, 3, {**alive, "jaxrl_llm/alive/1": "4"}, {}, seen, 12.0, 10.0) is None  # it beat again
  failed = {"jaxrl_llm/failed/0": "mine", "jaxrl_llm/failed/2": "config.x: bad"}
  assert peer_verdict(0, 3, alive, failed, seen, 12.0, 10.0) == \
      "process 0 of 3: process 2 stopped with an error: config.x: bad"
  assert peer_verdict(0, 3, alive, {"jaxrl_llm/failed/0": "mine"}, seen, 12.0, 10.0) is None  # its own report


if __name__ == "__main__":
  worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


def test_multiprocess_config_errors_name_the_field(monkeypatch):
  """What a 2-process run refuses, checked without starting one (the process count is patched)."""
  import jax
  from jaxrl_llm import config as config_lib
  from test_loop import tiny
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  mesh = dict(mesh__data=2, mesh__fsdp=4)
  cases = [(dict(rollout__mode="async", rollout__prompts_per_step=3), r"rollout\.prompts_per_step=3: async over 2"),
           (dict(rollout__mode="async", rollout__prox_in_worker=True), r"rollout\.prox_in_worker=True: async over 2"),
           (dict(rollout__sampler_devices=1, mesh__data=3, mesh__fsdp=2), r"rollout\.sampler_devices=1: devices of"),
           (dict(rollout__mode="async", rollout__sampler_devices=1), r"sampler_devices=1: .* needs 10 devices \(1 on each of 2"),
           (dict(mesh__data=1, mesh__fsdp=1), r"config\.mesh=.*2 processes run one model")]
  for kw, msg in cases:
    with pytest.raises(config_lib.ConfigError, match=msg):
      config_lib.validate(tiny(**{**mesh, **kw}))
  for kw in (dict(rollout__mode="async"), dict(rollout__mode="async", rollout__sampler_devices=1, mesh__data=3, mesh__fsdp=2),
             dict(rollout__mode="fixed_lag", rollout__lag=1)):
    config_lib.validate(tiny(**{**mesh, **kw}))  # accepted
  c = tiny(**mesh, rollout__mode="fixed_lag", rollout__lag=1)
  c.rollout.replay.capacity = 8
  config_lib.validate(c)  # replay too
