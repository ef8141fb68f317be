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


def worker(port: int, process_id: int, out_path: str):
  from jaxrl_llm import distributed, sharding
  assert distributed.maybe_initialize(f"localhost:{port}", 2, process_id, cpu_collectives="gloo")
  import jax
  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  params, losses = _train(sharding.make_mesh(*MESH))
  if process_id == 0:
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    np.savez(out_path, **flat)
    with open(out_path + ".json", "w") as f:
      json.dump({"losses": losses, "process_count": jax.process_count()}, f)
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_localhost_match_single_process(tmp_path):
  import jax
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
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
  def __init__(self, process_index):
    self.process_index = process_index


class _Sharding:
  """`devices_indices_map` of a batch of 8 rows: process 0 holds rows 0-3, process 1 rows 4-7, and
  process 2 holds a replica of rows 4-7 (a replicated axis that spans processes)."""

  def devices_indices_map(self, shape):
    assert shape == (8,)
    return {_Dev(0): (slice(0, 2),), _Dev(0): (slice(2, 4),), _Dev(1): (slice(4, 8),), _Dev(2): (slice(4, 8),)}


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
