"""Fault injection (issue 19): one test per case; each failed on the code before the fix.

Crafted pickle in a checkpoint, a changed config on resume, two runs in one workdir, reward errors in
async mode, huge / NaN rewards, a spinning reward in process mode, errors that used to be tracebacks,
SIGINT, optim.max_skips and runs whose every update is skipped, validation of sft / eval fields.
"""

import base64
import dataclasses
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxrl_llm import checkpoint as checkpoint_lib, config as config_lib, loop, workdir as workdir_lib
from jaxrl_llm.errors import RunError
from jaxrl_llm.metrics import read_jsonl
from jaxrl_llm.tasks import reward as reward_lib
from test_loop import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def fast(**over):
  """tiny, 2 steps, a checkpoint every step, no eval / SFT / tensorboard (faults, not learning)."""
  c = tiny(**over)
  c.num_steps, c.eval.every, c.checkpoint.every, c.sft.steps = 2, 0, 1, 0
  return c


def strict_rows(path):
  """metrics.jsonl parsed strictly: NaN / Infinity are not JSON."""
  def bad(x):
    raise ValueError(f"non-JSON constant {x}")
  return [json.loads(line, parse_constant=bad) for line in open(path)]


def spin(*args):
  """A reward that never returns and never sleeps (module-level: picklable for worker processes)."""
  while True:
    pass


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
  d = tmp_path_factory.mktemp("base") / "run"
  loop.run(fast(), str(d))
  return d


def copy_of(base_run, tmp_path):
  d = tmp_path / "run"
  shutil.copytree(base_run, d)
  return d


class _Payload:
  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (open, (self.marker, "w"))  # creates the marker file if ever unpickled


def test_crafted_pickle_in_checkpoint_is_never_loaded(base_run, tmp_path):
  d = copy_of(base_run, tmp_path)
  marker = tmp_path / "pwned"
  meta_file = d / "checkpoints" / "2" / "meta" / "metadata"
  meta = json.load(open(meta_file))
  meta["async_engine"] = base64.b64encode(pickle.dumps(_Payload(str(marker)))).decode()
  json.dump(meta, open(meta_file, "w"))
  c = fast()
  c.num_steps = 3
  with pytest.warns(checkpoint_lib.CheckpointWarning, match="step 2.*pickled"):
    loop.run(c, str(d))
  assert not marker.exists()
  assert json.load(open(d / "run_info.json"))["resumed_from_step"] == 1  # the step before the forged one
  assert [r["step"] for r in strict_rows(d / "metrics.jsonl")] == [0, 1, 2]


def test_config_change_on_resume_is_refused_and_nothing_is_touched(base_run, tmp_path):
  d = copy_of(base_run, tmp_path)
  before = {p: open(d / p, "rb").read() for p in ("metrics.jsonl", "config.json")}
  steps = sorted(os.listdir(d / "checkpoints"))
  c = fast(model__d_ff=128, optim__lr=0.5)
  c.num_steps = 4
  with pytest.raises(RunError, match=r"model\.d_ff: 64 -> 128.*optim\.lr.*config_change=restart"):
    loop.run(c, str(d))
  assert sorted(os.listdir(d / "checkpoints")) == steps  # nothing quarantined
  assert {p: open(d / p, "rb").read() for p in before} == before  # config.json not overwritten, metrics kept
  assert not os.path.exists(d / ".lock")
  # "resume" is deliberate, but arrays that no longer fit are still refused, and left in place.
  c.checkpoint.config_change = "resume"
  with pytest.warns(RuntimeWarning, match="model.d_ff"), pytest.raises(RunError, match="step 2.*does not fit"):
    loop.run(c, str(d))
  assert sorted(os.listdir(d / "checkpoints")) == steps
  # "restart" moves the old run aside and starts at step 0.
  c.checkpoint.config_change = "restart"
  c.num_steps = 1
  loop.run(c, str(d))
  moved = [x for x in os.listdir(d) if x.startswith("previous-")]
  assert len(moved) == 1 and open(d / moved[0] / "metrics.jsonl", "rb").read() == before["metrics.jsonl"]
  assert json.load(open(d / "run_info.json"))["resumed_from_step"] == 0


def test_two_runs_one_workdir(tmp_path):
  d = tmp_path / "run"
  other = subprocess.Popen(["sleep", "60"])
  try:
    d.mkdir()
    (d / workdir_lib.LOCK).write_text(json.dumps({"pid": other.pid, "host": os.uname().nodename, "started": "x"}))
    with pytest.raises(RunError, match=f"in use by another run \\(pid {other.pid}"):
      loop.run(fast(), str(d))
    assert not (d / "metrics.jsonl").exists()
  finally:
    other.kill()
    other.wait()
  with pytest.warns(RuntimeWarning, match="stale lock"):  # the owner is dead: taken over
    lock = workdir_lib.acquire(str(d))
  assert json.load(open(lock))["pid"] == os.getpid()
  workdir_lib.release(lock)
  assert not os.path.exists(lock)


def _with_reward(monkeypatch, fn):
  real = loop.get_task
  monkeypatch.setattr(loop, "get_task", lambda *a, **k: dataclasses.replace(real(*a, **k), reward=fn))


def test_async_reward_errors_are_counted(tmp_path, monkeypatch):
  def broken(*args):
    raise RuntimeError("reward bug")
  _with_reward(monkeypatch, broken)
  c = fast(rollout__mode="async", rollout__lag=1)
  rows = loop.run(c, str(tmp_path / "run"))
  B = c.rollout.prompts_per_step * c.rollout.group_size
  assert [r["reward_errors"] for r in rows] == [B, B]
  assert json.load(open(tmp_path / "run" / "run_info.json"))["reward_errors"] == 2 * B


def test_huge_and_nan_rewards_are_errors_and_metrics_stay_json(tmp_path, monkeypatch):
  values = {1: 1e300, 2: float("nan"), 3: float("inf"), 4: 2.0e6}
  calls = []

  def absurd(prompt, answer, completion):
    calls.append(1)
    return values.get(len(calls) % 5, 0.5)  # every fifth call is a sane 0.5
  _with_reward(monkeypatch, absurd)
  rows = loop.run(fast(), str(tmp_path / "run"))
  B = 16
  assert [r["reward_errors"] for r in rows] == [B - B // 5, B - B // 5]
  # The sane calls score 0.5, the rest 0: a finite mean, and a finite update.
  assert [r["reward_mean"] for r in rows] == [pytest.approx(0.5 * (B // 5) / B)] * 2
  assert all(r["update_skipped"] == 0 for r in rows)
  strict_rows(tmp_path / "run" / "metrics.jsonl")
  out = reward_lib.safe_reward_batch(lambda v: v, [(1e300,), (float("nan"),), (-1e7,), (1e6,), (10**400,)],
                                     max_abs=1e6)
  assert out.status == ("error", "error", "error", "ok", "error") and out.reward_B.tolist() == [0, 0, 0, 1e6, 0]


def test_nonfinite_metrics_are_written_as_null(tmp_path):
  from jaxrl_llm.metrics import MetricsWriter
  w = MetricsWriter(str(tmp_path), tensorboard=False)
  w.write({"step": 0, "a": float("nan"), "b": [1.0, float("inf")], "c": np.float32("-inf")})
  w.close()
  assert strict_rows(tmp_path / "metrics.jsonl") == [{"step": 0, "a": None, "b": [1.0, None], "c": None}]


def test_spinning_reward_in_process_mode_is_killed_and_leaks_nothing():
  n_threads = threading.active_count()
  for _ in range(3):
    out = reward_lib.safe_reward_batch(spin, [(0,), (1,)], timeout_s=0.5, max_workers=2, use_process=True)
    assert out.status == ("timeout", "timeout")
  ok = reward_lib.safe_reward_batch(abs, [(-1,), (-2,), (3,)], timeout_s=30.0, max_workers=2, use_process=True)
  assert ok.reward_B.tolist() == [1.0, 2.0, 3.0]
  assert threading.active_count() == n_threads  # no thread per call
  assert reward_lib._PROCESSES.processes() <= 2  # spinning workers were killed, not kept


def test_hung_rewards_in_thread_mode_are_bounded():
  release = threading.Event()
  pool = reward_lib._LanePool(max_stuck=3)
  hang = lambda i: release.wait() or 1.0
  try:
    for _ in range(4):
      out = pool.run(hang, [(i,) for i in range(4)], 0.05, 2)
      assert [s for _, s in out] == ["timeout"] * 4
      assert pool.threads() <= 2 + 3
  finally:
    release.set()


def test_every_error_is_one_line_without_traceback(tmp_path):
  def cli(*args):
    p = subprocess.run([sys.executable, "-m", "jaxrl_llm", "--config=configs/tiny.py", *args], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode != 0 and "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-2000:]
    return lines[0]
  assert "--config.model.nope: unknown config field 'nope'" in cli(f"--workdir={tmp_path}/a", "--config.model.nope=1")
  (tmp_path / "file").write_text("x")
  assert f"--workdir={tmp_path}/file: exists and is not a directory" in cli(f"--workdir={tmp_path}/file")
  assert "cannot create it" in cli(f"--workdir={tmp_path}/file/sub")


def test_broken_init_from_names_the_file(tmp_path):
  import jax
  from jaxrl_llm.models import ModelConfig, init_params, save_hf
  from jaxrl_llm.tasks import tokenizer as tok
  cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
  m = tmp_path / "m"
  save_hf(str(m), cfg, init_params(cfg, jax.random.key(0)))
  tok.CHAR_TOKENIZER.save(str(m))  # a jaxrl_llm export: the weights are what is broken, not the tokenizer
  c = fast()
  c.model.init_from = str(m)
  st = next(f for f in os.listdir(m) if f.endswith(".safetensors"))
  data = open(m / st, "rb").read()
  open(m / st, "wb").write(data[: len(data) // 2])
  with pytest.raises(config_lib.ConfigError, match=r"init_from=.*safetensors"):
    loop.run(c, str(tmp_path / "a"))
  (m / "config.json").write_text("{broken")
  with pytest.raises(config_lib.ConfigError, match=r"init_from=.*config\.json"):
    loop.run(c, str(tmp_path / "b"))


def test_unmovable_bad_checkpoint_falls_back(base_run, tmp_path, monkeypatch):
  d = copy_of(base_run, tmp_path)
  os.remove(d / "checkpoints" / "2" / "_CHECKPOINT_METADATA")
  def no_move(*a, **k):
    raise PermissionError(13, "Permission denied")
  monkeypatch.setattr(checkpoint_lib.shutil, "move", no_move)
  c = fast()
  c.num_steps = 3
  with pytest.warns(checkpoint_lib.CheckpointWarning, match="step 2.*could not move it aside"):
    loop.run(c, str(d))
  assert json.load(open(d / "run_info.json"))["resumed_from_step"] == 1


def test_validation_of_sft_and_eval_fields():
  c = fast()
  c.sft.steps, c.sft.batch_size = 5, 0
  with pytest.raises(config_lib.ConfigError, match="config.sft.batch_size=0"):
    config_lib.validate(c)
  c = fast()
  c.eval.every, c.eval.num_prompts = 2, 0
  with pytest.raises(config_lib.ConfigError, match="config.eval.num_prompts=0"):
    config_lib.validate(c)
  c = fast()
  c.reward.timeout_s = 0
  with pytest.raises(config_lib.ConfigError, match="config.reward.timeout_s=0"):
    config_lib.validate(c)


def test_max_skips_writes_the_row_and_a_checkpoint_then_fails(tmp_path):
  c = fast(sampler__temperature=1e-30, optim__max_skips=2)  # logits / T overflow: every update is non-finite
  c.num_steps, c.checkpoint.every = 5, 0
  with pytest.raises(RunError, match="optim.max_skips=2"):
    loop.run(c, str(tmp_path / "a"))
  rows = strict_rows(tmp_path / "a" / "metrics.jsonl")
  assert [r["step"] for r in rows] == [0, 1] and rows[-1]["skipped_consecutive"] == 2
  assert os.listdir(tmp_path / "a" / "checkpoints") == ["2"]
  c.num_steps = 1  # fewer steps than max_skips: all skipped is still a failure, not a normal summary
  with pytest.raises(RunError, match="every update of this run"):
    loop.run(c, str(tmp_path / "b"))


def test_sigint_saves_a_checkpoint_and_the_run_resumes(tmp_path):
  d = tmp_path / "run"
  flags = ["--config.num_steps=200", "--config.eval.every=0", "--config.checkpoint.every=0", "--config.sft.steps=0",
           "--config.log.tensorboard=False"]
  p = subprocess.Popen([sys.executable, "-m", "jaxrl_llm", "--config=configs/tiny.py", f"--workdir={d}", *flags],
                       cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  path = d / "metrics.jsonl"
  t0 = time.time()
  while not (path.exists() and len(open(path).readlines()) >= 2):
    assert p.poll() is None and time.time() - t0 < 300, p.stdout.read()[-2000:] if p.poll() is not None else "slow"
    time.sleep(0.2)
  p.send_signal(signal.SIGINT)
  out, _ = p.communicate(timeout=120)
  assert p.returncode == 130, out[-2000:]
  assert "Traceback" not in out
  saved = max(int(x) for x in os.listdir(d / "checkpoints") if x.isdigit())
  assert saved == len(read_jsonl(str(path))) >= 2
  c = fast()
  c.num_steps = saved + 1
  loop.run(c, str(d))
  assert json.load(open(d / "run_info.json"))["resumed_from_step"] == saved
  assert [r["step"] for r in read_jsonl(str(path))] == list(range(saved + 1))
