"""`async` on an 8-device mesh with disjoint device sets (6 learner: data=3 × fsdp=2, 2 sampler devices of
their own; forced CPU devices in a subprocess, `tests/async_mesh_probe.py`): publish reshards every
snapshot onto the sampler's devices, equal to the learner's parameters, and every consumed lag stays ≤ η."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_llm import config as config_lib
from test_loop import tiny
from devices import with_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNER, SAMPLER = list(range(6)), [6, 7]


@pytest.mark.slow
def test_async_on_disjoint_sampler_and_learner_devices(tmp_path):
  env = {**with_devices(8), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  steps = 4
  r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "async_mesh_probe.py"), str(tmp_path / "run"),
                      str(steps)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PROBE "))[len("PROBE "):])
  assert out["unit"] == {"sampler_devices": SAMPLER, "learner_devices": LEARNER, "equal": True}
  rows, per_step = out["rows"], out["per_step"]
  assert [x["step"] for x in rows] == list(range(steps))
  eta = 1
  for row, seen in zip(rows, per_step):
    assert seen == {"version": row["version"], "sampler_devices": SAMPLER, "learner_devices": LEARNER, "equal": True}
    assert 0 <= row["lag_max"] <= eta
    hist = row["async_lag_hist"]
    assert len(hist) == eta + 1 and sum(hist) == 6  # every group of the batch, by lag 0..η
    assert max(i for i, n in enumerate(hist) if n) == row["lag_max"]
    assert 0.0 <= row["time_learner_idle_frac"] <= 1.0
  assert [x["version"] for x in rows] == list(range(1, steps + 1))


def test_sampler_devices_must_fit_the_visible_devices():
  c = tiny(rollout__mode="async", rollout__sampler_devices=2)  # this process sees one CPU device
  with pytest.raises(config_lib.ConfigError, match=r"rollout\.sampler_devices=2: .* needs 3 devices but 1"):
    config_lib.validate(c)
  c = tiny(rollout__sampler_devices=-1)
  with pytest.raises(config_lib.ConfigError, match=r"rollout\.sampler_devices=-1"):
    config_lib.validate(c)
