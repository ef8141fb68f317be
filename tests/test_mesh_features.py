"""Features on an 8-device mesh (data=2 x fsdp=4, forced CPU devices, the CLI in a subprocess) write the metrics of
the same config on this process's one device: the first steps' loss within 1e-3 relative, and each feature
visibly active on the mesh (its own counters in the rows).

All mesh runs are launched together once per session (`built_once`); each test runs its one-device twin here.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import load_file
from jaxrl_llm.metrics import read_jsonl
from devices import with_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = {"mesh.data": 2, "mesh.fsdp": 4}
COMMON = {"num_steps": 2, "eval.every": 0, "checkpoint.every": 0, "log.tensorboard": False}
# name -> (config file, overrides). An entropy bonus gives every step a gradient before any reward is earned.
CASES = {
    # multi-turn episodes with each episode's KV cache kept across turns, the cache's rows over the sampler mesh
    "agent_kv_cache": ("agent_tiny.py", {"env.kv_cache": True, "loss.entropy_coef": 0.01}),
    # continuous batching (8 slots for 48 rows: refills) of single completions, and of episode turns (each
    # episode's keys/values resident in its slot between turns: `env.kv_cache`)
    "slots": ("tiny.py", {"rollout.slots": 8}),
    "agent_slots": ("agent_tiny.py", {"rollout.slots": 4, "loss.entropy_coef": 0.01}),
    # ... speculating: the slot engine's draft-and-verify step (the policy's first layer drafting)
    "slots_speculative": ("tiny.py", {"rollout.slots": 8, "sampler.spec_gamma": 2, "sampler.spec_draft_layers": 1}),
    # the packed learner (two sequences of 11 tokens per row of 22; π_old recomputed on packed rows at lag 1), its
    # packed rows split over the batch axes
    "packing": ("tiny.py", {"optim.pack_width": 22, "rollout.mode": "fixed_lag", "rollout.lag": 1,
                            "loss.entropy_coef": 0.01}),
    # a synchronous source with sampler devices of its own (snapshots live there; the prompts must go there too)
    "sampler_devices": ("tiny.py", {"rollout.mode": "fixed_lag", "rollout.lag": 1, "loss.entropy_coef": 0.01}),
    # speculative decoding with the distilled drafter (replicated over the learner's and the sampler's devices)
    "drafter": ("tiny.py", {"model.n_layers": 2, "sampler.spec_gamma": 2, "sampler.spec_draft_layers": 1,
                            "sampler.spec_drafter": "distilled", "sampler.spec_distill_lr": 1e-3,
                            "loss.entropy_coef": 0.01}),
}
# the mesh of a case, if not MESH
CASE_MESH = {"sampler_devices": {"mesh.data": 3, "mesh.fsdp": 2, "rollout.sampler_devices": 2}}


def _config(name: str):
  path, over = CASES[name]
  c = load_file(os.path.join(ROOT, "configs", path))
  for k, v in {**COMMON, **over}.items():
    *sections, key = k.split(".")
    node = c
    for s in sections:
      node = node[s]
    node[key] = v
  return c


def _launch(workdir: str, name: str) -> subprocess.Popen:
  path, over = CASES[name]
  flags = [f"--config.{k}={v}" for k, v in {**COMMON, **over, **CASE_MESH.get(name, MESH)}.items()]
  env = {**with_devices(8), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  return subprocess.Popen([sys.executable, "-m", "jaxrl_llm", f"--config=configs/{path}", f"--workdir={workdir}",
                           *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def on_mesh(tmp_path_factory, built_once):
  """{case: metrics rows} of every case on 8 devices (all launched at once)."""

  def build():
    d = tmp_path_factory.mktemp("mesh")
    procs = {n: _launch(str(d / n), n) for n in CASES}
    out = {}
    for n, p in procs.items():
      log = p.communicate(timeout=900)[0]
      assert p.returncode == 0, f"{n}:\n{log[-4000:]}"
      out[n] = read_jsonl(str(d / n / "metrics.jsonl"))
    return out

  return built_once("mesh_features", build)


def assert_same_first_steps(got: list[dict], want: list[dict]) -> None:
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for a, b in zip(got, want):
    for k in ("loss", "grad_norm", "reward_mean", "entropy"):
      np.testing.assert_allclose(a[k], b[k], rtol=1e-3, atol=1e-6, err_msg=f"step {b['step']} {k}")


def twins(name: str, tmp_path, on_mesh) -> tuple[list[dict], list[dict]]:
  """(rows on the mesh, rows on one device) of case `name`, checked to agree and to have learned from step 0."""
  rows = loop.run(_config(name), str(tmp_path))
  mesh = on_mesh[name]
  assert_same_first_steps(mesh, rows)
  assert rows[0]["grad_norm"] > 0
  return mesh, rows


@pytest.mark.slow
def test_agent_with_kept_kv_cache_on_a_mesh(tmp_path, on_mesh):
  mesh, rows = twins("agent_kv_cache", tmp_path, on_mesh)
  # the kept cache ran on the mesh: one prefill for the first turn, every later turn appended to the cache (a
  # re-prefill per turn would count one per turn played)
  assert [r["env_prefills"] for r in mesh] == [r["env_prefills"] for r in rows] == [1, 1]
  assert all(r["env_turns_mean"] > 1 for r in mesh)


@pytest.mark.slow
@pytest.mark.parametrize("name, counters", [("slots", ("slot_live_steps",)),
                                             ("agent_slots", ("env_live_steps", "env_slot_resumes"))])
def test_continuous_batching_on_a_mesh(tmp_path, on_mesh, name, counters):
  """Per-request keys: the slot engine draws the same tokens on the mesh as on one device; episodes' later turns
  continue the keys/values resident in their slots there too (`env.kv_cache`, default)."""
  mesh, rows = twins(name, tmp_path, on_mesh)
  for counter in counters:
    assert [r[counter] for r in mesh] == [r[counter] for r in rows] and all(r[counter] > 0 for r in mesh), counter


@pytest.mark.slow
def test_speculating_slots_on_a_mesh(tmp_path, on_mesh):
  """Continuous batching and speculative decoding together on the mesh: the same draws, acceptance and slot-steps."""
  mesh, rows = twins("slots_speculative", tmp_path, on_mesh)
  for a, b in zip(mesh, rows):
    assert a["slot_live_steps"] == b["slot_live_steps"] > 0 and a["slot_steps"] == b["slot_steps"]
    assert a["spec_accept_rate"] == pytest.approx(b["spec_accept_rate"], abs=1e-6) and b["spec_tokens_per_call"] > 1


@pytest.mark.slow
def test_packing_on_a_mesh(tmp_path, on_mesh):
  mesh, rows = twins("packing", tmp_path, on_mesh)
  assert all(0 < r["learner_pad_frac"] < 0.1 for r in mesh)  # packed: the padded rows' tail padding is gone
  assert [r["learner_pad_frac"] for r in mesh] == [r["learner_pad_frac"] for r in rows]


def test_packed_rows_are_padded_to_a_multiple_of_the_shards():
  from jaxrl_llm import packing
  B, T = 12, 6
  seq = np.ones((B, T), np.int32)
  seg = np.ones((B, T), np.int32)
  pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
  for chunks, shards in [(1, 1), (1, 8), (2, 8), (3, 4), (4, 8)]:
    pk = packing.pack(seq, pos, seg, 2 * T, chunks, shards)
    assert pk.tokens_RW.shape[0] % shards == 0 and pk.tokens_RW.shape[0] == chunks * pk.rows
    assert pk.rows >= B // chunks // 2  # two sequences per row at least this many rows
    seq_back, _, real = packing.unpack(pk, T)
    np.testing.assert_array_equal(seq_back, seq)  # every sequence kept, the extra rows only padding
    assert real.all()


@pytest.mark.slow
def test_synchronous_source_on_sampler_devices(tmp_path, on_mesh):
  twins("sampler_devices", tmp_path, on_mesh)


@pytest.mark.slow
def test_distilled_drafter_on_a_mesh(tmp_path, on_mesh):
  mesh, rows = twins("drafter", tmp_path, on_mesh)
  for a, b in zip(mesh, rows):  # the drafter distilled the same way and proposed what it proposes on one device
    np.testing.assert_allclose(a["spec_drafter_kl"], b["spec_drafter_kl"], rtol=1e-3)
    assert a["spec_accept_rate"] == pytest.approx(b["spec_accept_rate"], abs=1e-6)
