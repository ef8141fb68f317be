"""Fault injection (issue 19): one test per case; each failed on the code before the fix.

Crafted pickle in a checkpoint, a changed config on resume, two runs in one workdir, reward errors in
async mode, huge / NaN rewards, a spinning reward in process mode, errors that used to be tracebacks,
SIGINT, optim.max_skips and runs whose every update is skipped, validation of sft / eval fields.
Issue 31 (at the end): damaged metrics.jsonl on resume, a looping chat template, error output after
checkpoint write failures / Ctrl-C twice / a symlinked step, silent nonsense configs, Orbax's tracked_metric.
Issue 43 (at the end): a spinning environment, a harness that never returns + SIGTERM, a harness module that does
not import, steps whose every sample failed, speculative metrics in async mode, the plot's held-out curve.
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
  from jaxrl_llm import wiring
  real = wiring.get_task
  monkeypatch.setattr(wiring, "get_task", lambda *a, **k: dataclasses.replace(real(*a, **k), reward=fn))


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


# --- issue 31: a second audit ----------------------------------------------------------------------------

# `python -m jaxrl_llm` with `patch` (Python source) run first, in the same process (no huge-page re-exec).
_WRAPPED_CLI = """
import runpy, sys
{patch}
sys.argv = ["jaxrl_llm", *sys.argv[1:]]
runpy.run_module("jaxrl_llm", run_name="__main__", alter_sys=True)
"""
QUICK = ["--config.num_steps=2", "--config.sft.steps=0", "--config.eval.every=0", "--config.checkpoint.every=1",
         "--config.log.tensorboard=False"]


def wrapped_cli(*args, patch="", timeout=300, **env):
  env = {**ENV, "JAXRL_LLM_HUGE_PAGES": "0", "PYTHONDONTWRITEBYTECODE": "1", **env}
  return subprocess.run([sys.executable, "-c", _WRAPPED_CLI.format(patch=patch), *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def the_error_line(p) -> str:
  """The one `error:` line of a failed run, which must also be the last line of its stderr."""
  lines = p.stderr.splitlines()
  errors = [x for x in lines if x.startswith("error:")]
  assert p.returncode != 0 and len(errors) == 1 and lines[-1] == errors[0], p.stderr[-3000:]
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  return errors[0]


def _metrics_lines(d):
  return open(d / "metrics.jsonl", "rb").read().splitlines(keepends=True)


def test_truncated_last_metrics_line_is_dropped_on_resume(base_run, tmp_path):
  # issue 31 case 3: a crash or a full disk leaves half a row after the checkpoint; it used to stop the resume
  # with "error: JSONDecodeError" naming no file.
  d = copy_of(base_run, tmp_path)
  before = _metrics_lines(d)
  shutil.rmtree(d / "checkpoints" / "2")  # resume at step 1: the run redoes step 1, as if killed after its row
  with open(d / "metrics.jsonl", "ab") as f:
    f.write(b'{"behavior_version": 1, "lag_max": 0, "reward_mean": 0.1')  # a row cut mid-write
  import warnings
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loop.run(fast(), str(d))
  assert not [w for w in caught if "metrics" in str(w.message)], [str(w.message) for w in caught]
  assert json.load(open(d / "run_info.json"))["resumed_from_step"] == 1
  after = _metrics_lines(d)
  assert after[0] == before[0]  # kept byte for byte
  strip = lambda lines: [{k: v for k, v in json.loads(x).items() if not k.startswith("time_")} for x in lines]
  assert strip(after) == strip(before)  # what the uninterrupted run wrote
  assert not os.path.exists(str(d / "metrics.jsonl") + ".damaged")


def test_garbage_metrics_line_before_the_checkpoint_is_moved_aside(base_run, tmp_path):
  # issue 31 case 3: an unreadable line before the checkpoint step is set aside with a warning naming the file.
  d = copy_of(base_run, tmp_path)
  before = _metrics_lines(d)
  garbage = b"\x00\x00garbage \xff\n"
  open(d / "metrics.jsonl", "wb").write(before[0] + garbage + before[1])
  c = fast()
  c.num_steps = 3
  aside = str(d / "metrics.jsonl") + ".damaged"
  with pytest.warns(RuntimeWarning, match=f"line 2.*moved to {aside}"):
    loop.run(c, str(d))
  assert open(aside, "rb").read() == garbage
  after = _metrics_lines(d)
  assert after[:2] == before and [json.loads(x)["step"] for x in after] == [0, 1, 2]


def test_looping_chat_template_fails_start_up(tmp_path):
  # issue 31 case 4: the Jinja sandbox blocks code, not compute: this template spins for hours, and start-up
  # used to hang without a word. With a 2 s limit the run must stop with one error line.
  from tiny_hf import CHATML, make_checkpoint
  m = make_checkpoint(tmp_path / "m")
  config = json.load(open(m / "tokenizer_config.json"))
  config["chat_template"] = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHATML
  (m / "tokenizer_config.json").write_text(json.dumps(config))
  p = wrapped_cli("--config=configs/tiny.py", f"--workdir={tmp_path}/run", *QUICK, f"--config.model.init_from={m}",
                  patch="from jaxrl_llm.models import tokenizer; tokenizer.RENDER_TIMEOUT_S = 2.0", timeout=240)
  line = the_error_line(p)
  assert "config.model.init_from" in line and "tokenizer_config.json" in line and "did not finish rendering" in line


def test_checkpoint_write_failures_end_with_one_error_line(tmp_path):
  # issue 31 case 5: a file size limit (EFBIG, as a full disk gives ENOSPC) fails the first checkpoint write inside
  # Orbax's threads, whose tracebacks used to bury the error line (and follow it).
  # Python ignores SIGXFSZ: writes past the limit fail with EFBIG. No persistent XLA cache: the limit would
  # leave truncated entries in the one the test session shares.
  # OCDBT packs the arrays into data files whose number depends on the writers' timing: under load the tiny
  # model's ~170 KB once came out as files all under the limit. d_ff=1024 makes each MLP weight (and its Adam
  # moments) 128 KB on its own, and a value is never split across files, so the first write always fails.
  small_files = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))"
  p = wrapped_cli("--config=configs/tiny.py", f"--workdir={tmp_path}/a", *QUICK, "--config.model.d_ff=1024",
                  patch=small_files,
                  JAX_ENABLE_COMPILATION_CACHE="false", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))
  line = the_error_line(p)
  assert "checkpoint step 1" in line and "File too large" in line
  assert os.path.getsize(tmp_path / "a" / "errors.log") > 0  # the tracebacks are kept, in the workdir


def test_ctrl_c_twice_during_a_checkpoint_save_ends_with_one_error_line(tmp_path):
  # issue 31 case 5: Ctrl-C twice while the main thread waits for Orbax's save threads (delivered there,
  # deterministically); the save threads go on (slowly, as on a slow disk) while the process exits, and their
  # tracebacks used to follow the error line.
  patch = """
import asyncio, os, signal
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.path import async_path
real_exists = async_path.exists
async def exists(path):
  await asyncio.sleep(1.0)
  return await real_exists(path)
async_path.exists = exists
real, hit = future._SignalingThread.join, []
def join(self, timeout=None):
  if not hit:
    hit.append(1)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
  return real(self, timeout)
future._SignalingThread.join = join
"""
  p = wrapped_cli("--config=configs/tiny.py", f"--workdir={tmp_path}/a", *QUICK, patch=patch)
  assert p.returncode == 130
  assert "interrupted" in the_error_line(p)
  # issue 43 (d): the `note:` line that the CLI help promises for errors.log was not printed (the save threads
  # fail after the error line, when stderr already goes to the log): it comes before the error line, once.
  log = tmp_path / "a" / "errors.log"
  notes = [x for x in p.stderr.splitlines() if x.startswith("note:")]
  assert len(notes) == 1 and str(log) in notes[0], p.stderr[-3000:]


def test_symlinked_checkpoint_retired_by_keep_is_named(base_run, tmp_path):
  # issue 31 case 5: Orbax cannot delete a symlinked step when checkpoint.keep retires it; the error named no file.
  d = copy_of(base_run, tmp_path)
  os.rename(d / "checkpoints" / "2", tmp_path / "elsewhere")
  os.symlink(tmp_path / "elsewhere", d / "checkpoints" / "2")
  p = wrapped_cli("--config=configs/tiny.py", f"--workdir={d}", *QUICK, "--config.num_steps=3",
                  "--config.checkpoint.keep=1")
  line = the_error_line(p)
  assert f"{d}/checkpoints/2 are symbolic links" in line and "checkpoint.keep" in line


def test_missing_config_file_message_is_whole(tmp_path):
  # issue 31 case 5: with a --config.FIELD override the message was cut at 200 characters, mid-path.
  for extra in ([], ["--config.num_steps=3"]):
    p = subprocess.run([sys.executable, "-m", "jaxrl_llm", "--config=configs/nope.py", f"--workdir={tmp_path}/a",
                        *extra], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    line = the_error_line(p)
    assert p.returncode == 2 and line.startswith("error: --config=configs/nope.py: cannot load the config file")
    assert "No such file or directory" in line and "configs/nope.py')" in line, line


def test_group_size_one_and_bad_learning_rates_are_refused_or_flagged():
  # issue 31 case 7: a group of one has no group-relative baseline; lr=inf passed while nan was refused.
  for name in config_lib.GROUP_ADVANTAGES:
    with pytest.raises(config_lib.ConfigError, match=f"config.rollout.group_size=1: advantage.name='{name}'"):
      config_lib.validate(fast(rollout__group_size=1, advantage__name=name))
  config_lib.validate(fast(rollout__group_size=1, advantage__name="reinforce_pp"))  # a batch-wide baseline
  with pytest.raises(config_lib.ConfigError, match="config.rollout.group_size=1: rollout.dynamic_sampling"):
    config_lib.validate(fast(rollout__group_size=1, advantage__name="reinforce_pp", rollout__dynamic_sampling=True))
  for lr in (float("inf"), float("nan"), 0.0, -1e-3):
    with pytest.raises(config_lib.ConfigError, match="config.optim.lr=.*finite number > 0"):
      config_lib.validate(fast(optim__lr=lr))
  with pytest.warns(RuntimeWarning, match=r"config.optim.lr=1000000.0 is above 1"):
    config_lib.validate(fast(optim__lr=1e6))


def test_num_steps_zero_and_a_huge_lr_say_so_once(tmp_path):
  # issue 31 case 7: num_steps=0 on an empty workdir said it "already holds a run"; lr=1e6 (a uniform policy,
  # grad_norm 0) gave no warning. The warning must show once although the config is validated twice.
  p = subprocess.run([sys.executable, "-m", "jaxrl_llm", "--config=configs/tiny.py", f"--workdir={tmp_path}/a",
                      *QUICK, "--config.num_steps=0", "--config.optim.lr=1e6"], cwd=ROOT, env=ENV,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "nothing to do: config.num_steps=0" in p.stdout and "already holds" not in p.stdout, p.stdout
  assert p.stderr.count("config.optim.lr=1000000.0 is above 1") == 1, p.stderr[-2000:]


def test_lock_with_a_non_integer_pid_is_taken_over(tmp_path):
  # issue 31 case 7: a `.lock` holding {"pid": "abc"} failed with "ValueError: invalid literal for int()".
  for pid in ("abc", None, -1, 10**30, True):
    (tmp_path / workdir_lib.LOCK).write_text(json.dumps({"pid": pid, "host": os.uname().nodename, "started": "x"}))
    with pytest.warns(RuntimeWarning, match="stale lock \\(unreadable pid"):
      lock = workdir_lib.acquire(str(tmp_path))
    assert json.load(open(lock))["pid"] == os.getpid()
    workdir_lib.release(lock)


def test_checkpoints_without_eval_are_saved_without_orbax_warnings(tmp_path, caplog):
  # issue 31 case 8: with best-checkpoint tracking on, Orbax warned "Requested `tracked_metric`; did not provide
  # metrics." at every save of a step that was not evaluated (most steps of `make demo`).
  import logging
  import jax.numpy as jnp
  caplog.set_level(logging.WARNING)
  with checkpoint_lib.Checkpointer(tmp_path, keep=1, best_metric="acc", keep_best=1) as ck:
    ck.save(1, {"x": jnp.ones(1)}, {}, metrics={"acc": 0.7})
    for step in (2, 3):
      ck.save(step, {"x": jnp.ones(1)}, {})  # not evaluated
    ck.save(4, {"x": jnp.ones(1)}, {}, metrics={"acc": 0.1})
    assert ck.all_steps() == [1, 4]  # the best (evaluated) one and the newest
  assert not [r for r in caplog.records if "tracked_metric" in r.getMessage()]


# --- issue 31: rewards right and bounded by default ---------------------------------------------

def _jsonl(tmp_path, rows, name="d.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.mark.parametrize("executor,workers", [("auto", 8), ("thread", 8), ("thread", 2), ("process", 3)])
def test_correct_math_answers_all_score_one_through_the_run_path(tmp_path, executor, workers):
  """Issue 31 case 1: the data tasks' reward ran its own time-limited call on the thread lanes that the
  outer calls held, so 53 of 64 correct completions scored as timeouts under the default executor."""
  from jaxrl_llm import tasks
  from jaxrl_llm.rollout import collect
  from jaxrl_llm.tasks import tokenizer as tok
  task = tasks.get_task("jsonl", path=_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(7 + i)} for i in range(4)]))
  phrasings = ("the answer is {}", "so the answer is {}", "#### {}", "\\boxed{{{}}}")
  examples = [{"prompt": f"q{i % 4}", "answer": str(7 + i % 4)} for i in range(64)]
  texts = [phrasings[i % 4].format(ex["answer"]) for i, ex in enumerate(examples)]
  width = max(map(len, texts)) + 1
  tokens_BN = np.stack([np.pad(tok.CHAR_TOKENIZER.encode(t), (0, width - len(t)), constant_values=tok.CHAR_TOKENIZER.eos_id)
                        for t in texts])
  policy = reward_lib.RewardPolicy(timeout_s=5.0, executor=executor, workers=workers)
  reward_B, counts, decoded = collect.score_completions(task, examples, tokens_BN, policy,
                                                       tokenizer=tok.CHAR_TOKENIZER)
  assert decoded == texts
  assert counts == {"ok": 64, "error": 0, "timeout": 0} and reward_B.tolist() == [1.0] * 64


def test_a_time_limited_call_inside_a_reward_runs_inline():
  """Issue 31 case 1, the mechanism: a reward that makes its own time-limited call gets the outer limit only."""
  def inner(x):
    return 1.0 if reward_lib.in_limited_call() else 0.5
  def outer(x):
    return reward_lib.call_with_timeout(inner, (x,), 5.0)[0]
  rb = reward_lib.safe_reward_batch(outer, [(i,) for i in range(32)], 5.0, max_workers=2)
  assert rb.counts["ok"] == 32 and rb.reward_B.tolist() == [1.0] * 32
  assert reward_lib.call_with_timeout(inner, (0,), 5.0) == (1.0, "ok")  # on its own: limited, on a lane


def test_slow_math_answers_are_bounded_before_sympy(tmp_path):
  """Issue 31 case 2 (the fast path): sympy would compute 10^(10^(10^10)) in C holding the GIL, and parse a
  3000-deep \\frac for minutes; both compare as strings only, so a step stays fast. (On the code before the
  fix this test does not finish: run it under a timeout.)"""
  from jaxrl_llm import tasks
  from jaxrl_llm.tasks import math_answer
  tower, deep = "10^{10^{10^{10}}}", "\\frac{1}{" * 3000 + "2" + "}" * 3000
  task = tasks.get_task("jsonl", path=_jsonl(tmp_path, [{"prompt": "q", "answer": "1"}] * 3), timeout_s=60.0)
  for gold in (tower, deep, "100000!"):
    rb = reward_lib.safe_reward_batch(task.reward, [("p", gold, "the answer is 7")] * 4, 60.0)
    assert rb.counts["ok"] == 4 and rb.reward_B.tolist() == [0.0] * 4
  assert math_answer.math_reward("p", tower, f"\\boxed{{{tower}}}") == 1.0  # equal strings still score
  assert math_answer.math_reward("p", "10^{3}", "1000") == 1.0  # small powers still compare symbolically


def test_slow_answer_run_keeps_stepping_and_honours_sigterm(tmp_path):
  """Issue 31 case 2: a JSONL answer 10^{10^{10^{10}}} hung the run (no step in 150 s with reward.timeout_s=2) and
  SIGTERM was not acted on. Now each step finishes and SIGTERM saves a checkpoint and exits 0."""
  data = _jsonl(tmp_path, [{"prompt": f"what is {i}?", "answer": "10^{10^{10^{10}}}"} for i in range(12)])
  d = tmp_path / "run"
  flags = ["--config.task.name=jsonl", f"--config.task.kwargs.path={data}", "--config.task.held_out=2",
           "--config.num_steps=200", "--config.eval.every=0", "--config.checkpoint.every=0", "--config.sft.steps=0",
           "--config.log.tensorboard=False", "--config.reward.timeout_s=2"]
  p = subprocess.Popen([sys.executable, "-m", "jaxrl_llm", "--config=configs/tiny.py", f"--workdir={d}", *flags],
                       cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  path = d / "metrics.jsonl"
  try:
    t0 = time.time()
    while not (path.exists() and len(open(path).readlines()) >= 2):
      assert p.poll() is None, p.stdout.read()[-2000:]
      assert time.time() - t0 < 400, "no second learner step within 400 s"
      time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=200)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  assert p.returncode == 0 and "preempted" in out, out[-2000:]
  saved = max(int(x) for x in os.listdir(d / "checkpoints") if x.isdigit())
  rows = read_jsonl(str(path))
  assert saved == len(rows) >= 2 and all(r["reward_mean"] == 0.0 for r in rows)


# --- issue 31 case 6: async over several processes ------------------------------------------------
# Async over several processes: a rollout worker thread runs only arrays made for it on the main thread.
#
# Issue 31 item 6: a 2-process async run once lost a worker to `ValueError('Expected 1 per-device arrays ...,
# but got 2')`, the check of `jax.make_array_from_single_device_arrays`. The one place a worker built arrays
# was `multiprocess.local_view`, run by every worker on every rollout over the shared global snapshot (a
# new Mesh, sharding and array per leaf) while the learner thread published, resharded (the same array
# constructors) and ran collectives. The view is now taken once per snapshot by the ParamStore on the
# publishing thread, before the snapshot is visible (`Snapshot.worker_params`); a worker only reads it.
# The crash itself was not reproduced here (it is a rare interleaving), so this test checks the fix's
# invariant: no worker thread builds arrays from a snapshot.
#
# Several processes are faked here (one process, `multiprocess.multi` patched, a spy for `local_view`), so the
# run's own wiring (`loop.new_store`, the async source's engine) is what is checked, in a few seconds.

def test_async_workers_generate_from_the_view_made_at_publish(monkeypatch):
  """Issue 31 case 6 (see the comment above)."""
  from jaxrl_llm import multiprocess
  from jaxrl_llm.rollout import generation
  from jaxrl_llm.rollout.sources import asynchronous
  from test_loop import fresh_run
  import jax
  import jax.numpy as jnp
  c = tiny(rollout__mode="async", rollout__lag=1, rollout__num_workers=2, rollout__prompts_per_step=2)
  made, view_threads = {}, []

  def spy_view(tree):  # stands for local_view: records its thread, returns arrays it can recognise
    view_threads.append(threading.current_thread().name)
    out = jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    made.update({id(x): x for x in jax.tree.leaves(out)})  # kept alive: ids are not reused
    return out

  generated_from_view = []
  real_generate = generation.generate  # what `Generation.generate_fn` calls

  def spy_generate(params, *args):
    generated_from_view.append(all(id(x) in made for x in jax.tree.leaves(params)))
    return real_generate(params, *args)

  monkeypatch.setattr(multiprocess, "multi", lambda: True)
  monkeypatch.setattr(multiprocess, "local_view", spy_view)
  monkeypatch.setattr(generation, "generate", spy_generate)
  r, state, _, store = fresh_run(c)  # loop.new_store, version 0 published
  with asynchronous.async_engine(r.ctx, store, None) as engine:
    for _ in range(2):
      engine.next_batch(store.latest_version, timeout=300.0)
      store.publish(state.params)  # the learner's publish, concurrent with the workers
  assert view_threads and set(view_threads) == {"MainThread"}, view_threads  # never on a rollout thread
  assert generated_from_view and all(generated_from_view), generated_from_view


def test_a_background_write_failure_is_named_by_its_own_step(tmp_path):
  """Orbax may raise a failed background write only at the next save: the error names the step that failed."""
  from jaxrl_llm import checkpoint as checkpoint_lib

  class Manager:  # stands for Orbax's CheckpointManager: step 1's write fails after `save` returned
    def __init__(self):
      self.calls = 0

    def all_steps(self):
      return []  # step 1 never reached the disk

    def save(self, step, **kw):
      self.calls += 1
      if self.calls == 2:
        raise OSError(27, "File too large")
      return True

    def wait_until_finished(self):
      pass

  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "c"))
  real, ckpt._mngr = ckpt._mngr, Manager()
  try:
    state = {"w": np.zeros(3, np.float32)}
    assert ckpt.save(1, state, {})
    ckpt.wait()
    with pytest.raises(RunError, match=r"checkpoint step 1 in .*File too large"):
      ckpt.save(2, state, {})
  finally:
    ckpt._mngr = real
    ckpt.close()


# --- issue 43 item 5: a third audit ----------------------------------------------------------------------

def harness_tiny(**serve):
  """configs/harness_tiny.py, small rows, no checkpoints / tensorboard / progress bar."""
  c = config_lib.load_file(os.path.join(ROOT, "configs", "harness_tiny.py"))
  c.log.tensorboard, c.log.progress, c.checkpoint.every = False, False, 0
  c.serve.max_context, c.serve.prompt_width, c.serve.max_tokens = 48, 24, 6
  for k, v in serve.items():
    c.serve[k] = v
  return c


def test_a_harness_module_that_does_not_import_names_the_field(tmp_path):
  # issue 43 (c): serve.harness=nosuchmodule:run ended with "error: ModuleNotFoundError: ..." naming no field.
  with pytest.raises(config_lib.ConfigError, match=r"config\.serve\.harness='nosuchmodule:run'.*ModuleNotFoundError"):
    loop.run(harness_tiny(harness="nosuchmodule:run"), str(tmp_path / "run"))


def test_a_step_whose_every_sample_failed_leaves_the_weights_alone(monkeypatch):
  # issue 43 (e): a batch whose every reward call failed still applied an AdamW update (moments, weight decay):
  # now it skips the update, counted by updates_skipped_empty; the next, normal step still updates.
  import jax
  from jaxrl_llm.rollout import sources
  from test_loop import fresh_run
  broken = [True]

  def reward(prompt, answer, completion):
    if broken[0]:
      raise RuntimeError("reward bug")
    return float(len(completion) % 2)
  _with_reward(monkeypatch, reward)
  c = fast(optim__warmup_steps=0, optim__weight_decay=0.01)
  c.loss.entropy_coef = 0.01  # a gradient even when every reward is equal
  r, state, extra, store = fresh_run(c)
  source = sources.get("sync")(r.ctx, store)
  leaves = lambda tree: [np.array(x) for x in jax.tree.leaves(jax.device_get(tree))]
  try:
    ro = source.next_batch(0, store.latest_version)
    assert ro.stat("reward_errors") == len(ro.reward_B)
    before = leaves((state.params, state.opt_state))
    state, m, _ = loop._learn(r, store, state, extra, ro, 0)
    assert all(np.array_equal(a, b) for a, b in zip(before, leaves((state.params, state.opt_state))))
    assert (m["updates_skipped_empty"], m["updates_applied"], m["update_skipped"]) == (1, 0, 1)
    assert m["skipped_consecutive"] == 0  # nothing was non-finite
    assert store.latest_version == 0  # nothing published
    broken[0] = False
    ro = source.next_batch(1, store.latest_version)
    assert ro.stat("reward_errors") == 0
    params = leaves(state.params)
    state, m, _ = loop._learn(r, store, state, extra, ro, 1)
    assert (m["updates_skipped_empty"], m["updates_applied"], m["update_skipped"]) == (0, 1, 0)
    assert not all(np.array_equal(a, b) for a, b in zip(params, leaves(state.params)))
  finally:
    source.close()


def test_which_batches_count_as_every_sample_failed():
  # Episodes are judged by the environment's own counters: an episode ended by an invalid action (counted in
  # reward_errors too) is a sample of the policy's behaviour to learn from, not a failure.
  from jaxrl_llm import batch as batch_lib

  class Ro:
    def __init__(self, **stats):
      self.reward_B, self.stats = [0.0] * 4, stats

    def stat(self, name, default=0):
      return self.stats.get(name, default)

  failed = batch_lib._every_sample_failed  # pylint: disable=protected-access
  assert failed(Ro(reward_errors=4)) and not failed(Ro(reward_errors=3))  # single-turn rewards
  assert not failed(Ro(reward_errors=4, env_errors=0, env_timeouts=0, env_invalid=4, env_too_long=0))
  assert failed(Ro(reward_errors=3, env_errors=2, env_timeouts=1, env_invalid=0, env_too_long=1))
  assert not failed(Ro(reward_errors=3, env_errors=2, env_timeouts=1, env_invalid=1, env_too_long=0))


def test_the_plot_held_out_curve_starts_with_the_before_accuracy(tmp_path):
  # issue 43 item 4: `make demo`'s plot drew held-out accuracy from the first evaluation in metrics.jsonl (step 9)
  # on, so the "start" accuracy that the summary prints was not on it.
  from jaxrl_llm import metrics
  rows = [{"step": t, "reward_mean": 0.1 * t, **({"eval_accuracy": 0.3 + t / 100} if t % 10 == 9 else {})}
          for t in range(20)]
  series = metrics.plot_series(rows, initial_eval=0.25)
  assert series["held_out"] == ([0, 10, 20], [0.25, 0.39, 0.49])  # before, after step 9's update, the final one
  assert series["reward"] == (list(range(20)), [0.1 * t for t in range(20)])
  start, end = metrics.summary_table(rows, 0.25).split("held-out accuracy")[1].split()[:2]
  assert (float(start), float(end)) == (0.25, 0.49)  # the summary's start and end are the curve's ends
  assert metrics.plot_series(rows)["held_out"][0] == [10, 20]  # no initial evaluation: nothing at 0
  metrics.plot(rows, str(tmp_path / "p.png"), initial_eval=0.25)
  assert os.path.getsize(tmp_path / "p.png") > 0


@pytest.mark.parametrize("partial_chunk", [0, 2])
def test_speculative_metrics_in_async_mode(tmp_path, partial_chunk):
  # issue 43 (f): sampler.spec_gamma in rollout.mode=async speculated but reported no spec_* metrics. With partial
  # rollouts (rollout.partial_chunk) the chunks are draft-and-verify calls (issue 44).
  c = fast(rollout__mode="async", rollout__lag=1, rollout__partial_chunk=partial_chunk, sampler__spec_gamma=2,
           sampler__spec_draft_layers=1)
  c.checkpoint.every = 0
  rows = loop.run(c, str(tmp_path / "run"))
  for r in rows:
    assert 0.0 <= r["spec_accept_rate"] <= 1.0, r
    assert 1.0 <= r["spec_tokens_per_call"] <= 3.0, r  # at most γ + 1 tokens per verification call


_SPINNING_ENV = """
from jaxrl_llm import envs
@envs.register("test_spin")
class Spin:
  def __init__(self, max_turns=4):
    pass
  def reset(self, seed):
    return "guess:"
  def step(self, action):
    while True:  # never returns, never sleeps
      pass
"""


def test_a_spinning_environment_run_exits(tmp_path):
  # issue 43 (a): env.step busy-looping in Python with env.timeout_s=1: the run counted the timeouts and wrote its
  # checkpoint and run_info.json, but the process never exited (the spinning threads starved it of the GIL).
  d = tmp_path / "run"
  args = ["--config=configs/agent_tiny.py", f"--workdir={d}", "--config.env.name=test_spin",
          "--config.env.timeout_s=1", "--config.num_steps=2", "--config.checkpoint.every=0",
          "--config.log.tensorboard=False", "--config.log.progress=False"]
  env = {**ENV, "JAXRL_LLM_HUGE_PAGES": "0", "PYTHONDONTWRITEBYTECODE": "1"}
  p = subprocess.Popen([sys.executable, "-c", _WRAPPED_CLI.format(patch=_SPINNING_ENV), *args], cwd=ROOT, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    t0 = time.time()
    while not (d / "run_info.json").exists():
      assert p.poll() is None, p.stdout.read()[-3000:]
      assert time.time() - t0 < 400, "no run_info.json within 400 s"
      time.sleep(0.5)
    out, _ = p.communicate(timeout=1 + 60)  # env.timeout_s plus a margin
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  assert p.returncode == 0, out[-3000:]
  rows = read_jsonl(str(d / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [0, 1] and all(r["env_timeouts"] == r["env_episodes"] > 0 for r in rows)


def blocking_harness(base_url, episode_id, seed):
  """A harness that never returns (and never calls the endpoint)."""
  threading.Event().wait()


def test_a_harness_that_never_returns_cannot_fail_a_sigterm(tmp_path):
  # issue 43 (b): a harness blocking forever and a SIGTERM: the checkpoint was saved, then "error: RuntimeError:
  # rollout workers did not stop within 60.0 s" and exit 1 (a worker joined its G harness threads one after the
  # other, serve.timeout_s each), without run_info.json. Now the run exits 0 with both, within a bounded time.
  d = tmp_path / "run"
  c = harness_tiny()
  over = {"serve.harness": "test_faults:blocking_harness", "serve.timeout_s": 5.0, "serve.concurrency": 16,
          "serve.max_context": c.serve.max_context, "serve.prompt_width": c.serve.prompt_width,
          "serve.max_tokens": c.serve.max_tokens, "rollout.group_size": 16, "rollout.prompts_per_step": 1,
          "num_steps": 50, "log.tensorboard": False, "log.progress": False, "checkpoint.every": 0}
  env = {**ENV, "PYTHONPATH": os.pathsep.join((os.path.join(ROOT, "tests"), ENV["PYTHONPATH"]))}
  p = subprocess.Popen([sys.executable, "-m", "jaxrl_llm", "--config=configs/harness_tiny.py", f"--workdir={d}",
                        *[f"--config.{k}={v}" for k, v in over.items()]], cwd=ROOT, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  path = d / "metrics.jsonl"
  try:
    t0 = time.time()
    while not (path.exists() and len(open(path).readlines()) >= 1):
      assert p.poll() is None, p.stdout.read()[-3000:]
      assert time.time() - t0 < 400, "no learner step within 400 s"
      time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=5 + 45)  # serve.timeout_s plus a margin
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  assert p.returncode == 0 and "preempted" in out, out[-3000:]
  info = json.load(open(d / "run_info.json"))
  assert info["stopped_by_signal"] == signal.SIGTERM
  rows = read_jsonl(str(path))
  assert max(int(x) for x in os.listdir(d / "checkpoints") if x.isdigit()) == len(rows)
  assert all(r["serve_timeouts"] == r["serve_episodes"] == 16 and r["updates_skipped_empty"] == 1 for r in rows)


def test_the_summary_counts_environment_failures_apart_from_invalid_actions():
  # issue 48 (4): the summary's "reward errors / timeouts" line of an episode run also counted invalid actions (the
  # policy's samples, `reward_errors` counts them): episodes now report the environment's failures and them apart.
  from jaxrl_llm import metrics
  ep = [{"step": 0, "reward_mean": 0.0, "reward_errors": 5, "env_errors": 1, "env_timeouts": 2, "env_invalid": 2},
        {"step": 1, "reward_mean": 0.0, "reward_errors": 1, "env_errors": 0, "env_timeouts": 0, "env_invalid": 1}]
  lines = {line[:28].strip(): line.split()[-1] for line in metrics.summary_table(ep).splitlines() if line.strip()}
  assert lines["env errors / timeouts"] == "3" and lines["invalid actions (episodes)"] == "3"
  assert "reward errors / timeouts" not in lines
  single = [{"step": 0, "reward_mean": 0.0, "reward_errors": 4}]
  assert metrics.summary_table(single).splitlines()[-1].split()[-1] == "4"
