"""Exact resume: SIGKILL / SIGTERM mid-run, restart, and the metrics stream equals an uninterrupted run.

Also: async runs lose or duplicate no trajectory across a resume; a corrupt latest checkpoint is
skipped (reported) and the previous one is used.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import load_file
from jaxrl_llm.metrics import read_jsonl
from test_loop import assert_learns, strip, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow

FLAGS = ["--config.rollout.mode=fixed_lag", "--config.rollout.lag=2", "--config.loss.entropy_coef=0.01",
         "--config.optim.lr=0.01", "--config.optim.warmup_steps=0", "--config.eval.every=3",
         "--config.checkpoint.every=1", "--config.log.tensorboard=False", "--config.num_steps=9"]


def config():
  c = tiny(rollout__mode="fixed_lag", rollout__lag=2, optim__lr=0.01, optim__warmup_steps=0)
  c.loss.entropy_coef = 0.01
  c.eval.every = 3
  c.checkpoint.every = 1
  c.num_steps = 9
  return c


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  d = tmp_path_factory.mktemp("ref")
  loop.run(config(), str(d))
  rows = strip(read_jsonl(str(d / "metrics.jsonl")))
  assert_learns(rows)  # resumed runs are compared with a run whose parameters move every step
  return rows


def launch(workdir):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
  return subprocess.Popen([sys.executable, "-m", "jaxrl_llm", "--config=configs/tiny.py", f"--workdir={workdir}", *FLAGS],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_rows(workdir, n, proc, timeout=300):
  path = os.path.join(workdir, "metrics.jsonl")
  t0 = time.time()
  while time.time() - t0 < timeout:
    if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
      return
    if proc.poll() is not None:
      raise AssertionError(f"run ended early: {proc.stdout.read()[-2000:]}")
    time.sleep(0.2)
  raise AssertionError("timed out waiting for metrics")


def test_sigkill_then_restart_equals_uninterrupted(tmp_path, reference):
  d = str(tmp_path / "run")
  p = launch(d)
  wait_for_rows(d, 4, p)
  p.kill()  # SIGKILL: no chance to save anything
  p.wait()
  assert len(read_jsonl(os.path.join(d, "metrics.jsonl"))) < 9
  p = launch(d)
  out, _ = p.communicate(timeout=600)
  assert p.returncode == 0, out[-3000:]
  info = json.load(open(os.path.join(d, "run_info.json")))
  assert info["resumed_from_step"] >= 3
  assert strip(read_jsonl(os.path.join(d, "metrics.jsonl"))) == reference


def test_sigterm_saves_and_exits_zero_then_resumes(tmp_path, reference):
  d = str(tmp_path / "run")
  p = launch(d)
  wait_for_rows(d, 3, p)
  t0 = time.time()
  p.send_signal(signal.SIGTERM)
  out, _ = p.communicate(timeout=120)
  assert p.returncode == 0, out[-3000:]
  assert time.time() - t0 < 120
  assert "preempted" in out or len(read_jsonl(os.path.join(d, "metrics.jsonl"))) == 9
  p = launch(d)
  out, _ = p.communicate(timeout=600)
  assert p.returncode == 0, out[-3000:]
  assert strip(read_jsonl(os.path.join(d, "metrics.jsonl"))) == reference


def test_corrupt_latest_checkpoint_is_skipped(tmp_path, reference):
  d = tmp_path / "run"
  c = config()
  c.num_steps = 5
  loop.run(c, str(d))
  ckdir = d / "checkpoints"
  latest = max(int(x) for x in os.listdir(ckdir) if x.isdigit())
  # Truncate every array file of the newest checkpoint.
  for root, _, files in os.walk(ckdir / str(latest)):
    for f in files:
      if not f.startswith("_") and not f.endswith(".json"):
        with open(os.path.join(root, f), "r+b") as fh:
          fh.truncate(max(0, os.path.getsize(os.path.join(root, f)) // 2))
  with pytest.warns(UserWarning, match=str(latest)):
    loop.run(config(), str(d))
  info = json.load(open(d / "run_info.json"))
  assert info["resumed_from_step"] < latest
  assert strip(read_jsonl(str(d / "metrics.jsonl"))) == reference


def test_async_resume_loses_and_duplicates_nothing(tmp_path):
  c = tiny(rollout__mode="async", rollout__lag=1)
  c.eval.every = 0
  c.checkpoint.every = 2
  c.num_steps = 4
  d = str(tmp_path / "async")
  first = loop.run(c, d)
  c.num_steps = 8
  second = loop.run(c, d)
  rows = read_jsonl(os.path.join(d, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(8))
  ids = [i for r in rows for i in r["request_ids"]]
  assert len(ids) == len(set(ids)), "a trajectory was consumed twice"
  assert all(r["lag_max"] <= 1 for r in rows)
  assert len(first) == 4 and len(second) == 4


def test_staged_resume_mid_stage_regenerates_the_stage(tmp_path):
  def cfg(n):
    c = tiny(rollout__mode="staged", rollout__lag=3, optim__lr=0.01, optim__warmup_steps=0)
    c.loss.entropy_coef, c.eval.every, c.checkpoint.every, c.num_steps = 0.01, 0, 1, n
    return c
  loop.run(cfg(5), str(tmp_path / "a"))
  loop.run(cfg(2), str(tmp_path / "b"))  # stops inside the first stage (steps 0-2)
  loop.run(cfg(5), str(tmp_path / "b"))
  a, b = (strip(read_jsonl(str(tmp_path / x / "metrics.jsonl"))) for x in "ab")
  assert_learns(a)
  assert a == b
  assert [r["lag_max"] for r in a] == [0, 1, 2, 0, 1]


AGENT_FLAGS = ["--config.rollout.mode=fixed_lag", "--config.rollout.lag=2", "--config.optim.lr=0.01",
               "--config.optim.warmup_steps=0", "--config.checkpoint.every=1", "--config.log.tensorboard=False",
               "--config.num_steps=5", "--config.env.kv_cache=False"]  # resume is the point: fewer programs


def test_agent_fixed_lag_sigterm_with_episodes_in_flight_resumes_identically(tmp_path):
  """configs/agent_tiny.py at fixed lag 2: the queue holds the episodes of the next two steps (generated by older
  snapshots) when SIGTERM arrives (sent from the step hook after step 1, so it lands at that step whatever the
  machine's speed); the resumed run's metrics equal an uninterrupted run's."""
  c = load_file(os.path.join(ROOT, "configs", "agent_tiny.py"))
  for flag in AGENT_FLAGS:
    key, value = flag[len("--config."):].split("=")
    *path, name = key.split(".")
    node = c[path[0]] if path else c
    node[name] = type(node[name])(value) if value not in ("True", "False") else value == "True"
  loop.run(c, str(tmp_path / "ref"))
  want = strip(read_jsonl(str(tmp_path / "ref" / "metrics.jsonl")))
  assert len(want) == 5 and len({r["loss"] for r in want}) > 1 and want[0]["env_policy_tokens"] > 0
  d = str(tmp_path / "run")
  sigterm_after_1 = lambda row, store: os.kill(os.getpid(), signal.SIGTERM) if row["step"] == 1 else None
  stopped = loop.run(c, d, on_step=sigterm_after_1)
  assert [r["step"] for r in stopped] == [0, 1]  # stopped with the episodes of steps 2 and 3 queued
  assert json.load(open(os.path.join(d, "run_info.json")))["stopped_by_signal"] == signal.SIGTERM
  loop.run(c, d)
  info = json.load(open(os.path.join(d, "run_info.json")))
  assert info["resumed_from_step"] == 2
  assert strip(read_jsonl(os.path.join(d, "metrics.jsonl"))) == want
