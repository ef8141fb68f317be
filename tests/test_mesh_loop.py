"""`loop.run` on an 8-device mesh (fsdp=4 × data=2, forced CPU devices in a subprocess) matches the
one-device run, and resumes from its own checkpoint."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm import loop
from jaxrl_llm.metrics import read_jsonl
from test_loop import assert_learns, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--config.rollout.mode=fixed_lag", "--config.rollout.lag=1", "--config.loss.entropy_coef=0.01",
         "--config.optim.lr=0.01", "--config.optim.warmup_steps=0", "--config.eval.every=2",
         "--config.log.tensorboard=False", "--config.loss.kl_coef=0.05"]


@pytest.mark.slow
def test_mesh_run_matches_one_device_and_resumes(tmp_path):
  c = tiny(rollout__mode="fixed_lag", rollout__lag=1, optim__lr=0.01, optim__warmup_steps=0)
  c.loss.entropy_coef, c.loss.kl_coef, c.eval.every, c.num_steps = 0.01, 0.05, 2, 4  # KL: the fused reference step
  ref = loop.run(c, str(tmp_path / "one"))
  assert_learns(ref)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  d = str(tmp_path / "mesh")
  base = [sys.executable, "-m", "jaxrl_llm", "--config=configs/tiny.py", f"--workdir={d}", *FLAGS,
          "--config.mesh.fsdp=4", "--config.mesh.data=2"]
  r = subprocess.run(base + ["--config.num_steps=4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  rows = read_jsonl(os.path.join(d, "metrics.jsonl"))
  assert [x["step"] for x in rows] == [0, 1, 2, 3]
  for a, b in zip(ref, rows):
    assert a["completion_len"] == b["completion_len"] and a["behavior_version"] == b["behavior_version"]
    for k in ("loss", "grad_norm", "entropy", "ratio_max", "kl_mu_k3", "kl_ref"):
      np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-7, err_msg=k)
  r = subprocess.run(base + ["--config.num_steps=6"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert rows[-1]["kl_ref"] > 0
  assert json.load(open(os.path.join(d, "run_info.json")))["resumed_from_step"] == 4
  assert [x["step"] for x in read_jsonl(os.path.join(d, "metrics.jsonl"))] == list(range(6))


def test_mesh_size_must_match_the_devices():
  from jaxrl_llm import config as config_lib
  c = tiny()
  c.mesh.fsdp = 4  # this test process sees one CPU device
  with pytest.raises(config_lib.ConfigError, match="multiply to 4 but 1 devices"):
    config_lib.validate(c)
