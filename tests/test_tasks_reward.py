"""Reward-safety wrapper (errors, timeouts, counts); JSONL loader with a math-verify reward."""

import json
import math
import threading
import time

import numpy as np
import pytest

from jaxrl_llm import tasks
from jaxrl_llm.tasks import jsonl, math_answer
from jaxrl_llm.tasks import reward as reward_lib


def _raises(*args):
  raise RuntimeError("user bug")


def _sleeps(*args):
  time.sleep(5.0)
  return 1.0


# --- safe_reward -------------------------------------------------------------------------------

def test_safe_reward_statuses():
  assert reward_lib.safe_reward(lambda a, b: a + b, 1.0)(0.25, 0.5) == (0.75, "ok")
  assert reward_lib.safe_reward(_raises, 1.0)("x") == (0.0, "error")
  assert reward_lib.safe_reward(_sleeps, 0.05)("x") == (0.0, "timeout")
  # Returned values that are not finite numbers are errors too.
  for bad in (None, "1.0", float("nan"), float("inf"), [1.0], 1j):
    assert reward_lib.safe_reward(lambda v=bad: v, 1.0)() == (0.0, "error")
  assert reward_lib.safe_reward(lambda: True, 1.0)() == (1.0, "ok")
  assert reward_lib.safe_reward(lambda: np.float32(0.5), 1.0)() == (0.5, "ok")
  assert reward_lib.safe_reward(lambda: np.array(2), 1.0)() == (2.0, "ok")


def test_safe_reward_catches_base_exceptions():
  def exits():
    raise SystemExit(3)
  def interrupts():
    raise KeyboardInterrupt
  assert reward_lib.safe_reward(exits, 1.0)() == (0.0, "error")
  assert reward_lib.safe_reward(interrupts, 1.0)() == (0.0, "error")


def test_safe_reward_batch_counts():
  def fn(i):
    if i % 4 == 1:
      raise ValueError(i)
    if i % 4 == 2:
      time.sleep(5.0)
    return i / 10
  out = reward_lib.safe_reward_batch(fn, [(i,) for i in range(8)], timeout_s=0.2, max_workers=3)
  np.testing.assert_allclose(out.reward_B, [0.0, 0.0, 0.0, 0.3, 0.4, 0.0, 0.0, 0.7])
  assert out.reward_B.dtype == np.float32
  assert out.status == ("ok", "error", "timeout", "ok", "ok", "error", "timeout", "ok")
  assert out.counts == {"ok": 4, "error": 2, "timeout": 2}


def test_safe_reward_batch_reuses_workers_and_survives_hung_calls():
  """Workers persist across batches; every hung call is replaced, so later batches still run in full."""
  release = threading.Event()
  def fn(i):
    if i < 0:
      release.wait()  # hangs until the end of the test
    return float(i)
  try:
    reward_lib.safe_reward_batch(fn, [(1,)], timeout_s=5.0, max_workers=2)
    n_threads = threading.active_count()
    for _ in range(20):  # no new thread per call or per batch
      assert reward_lib.safe_reward_batch(fn, [(i,) for i in range(16)], timeout_s=5.0, max_workers=2).counts["ok"] == 16
    assert threading.active_count() == n_threads
    # More hung calls than workers: each times out on its own clock and its worker is replaced.
    t0 = time.monotonic()
    out = reward_lib.safe_reward_batch(fn, [(-1,), (-2,), (-3,), (4,)], timeout_s=0.2, max_workers=2)
    assert out.status == ("timeout", "timeout", "timeout", "ok") and out.reward_B[3] == 4.0
    assert time.monotonic() - t0 < 5.0
    out = reward_lib.safe_reward_batch(fn, [(i,) for i in range(8)], timeout_s=5.0, max_workers=2)
    assert out.counts == {"ok": 8, "error": 0, "timeout": 0}
  finally:
    release.set()


def test_timed_out_thread_is_a_daemon():
  started, threads = threading.Event(), []
  def hang():
    threads.append(threading.current_thread())
    started.set()
    threading.Event().wait()  # never returns
  assert reward_lib.call_with_timeout(hang, (), 0.05) == (0.0, "timeout")
  assert started.wait(5.0)
  # Left running (Python cannot kill it), but as a daemon it cannot block interpreter exit.
  assert threads[0].is_alive() and threads[0].daemon


def test_safe_reward_process_mode():
  # Module-level builtins pickle under spawn; a sleeping child is killed at the deadline.
  out = reward_lib.safe_reward_batch(
      math.sqrt, [(0.25,), (-1.0,)], timeout_s=30.0, max_workers=2, use_process=True)
  assert out.status == ("ok", "error") and out.reward_B.tolist() == [0.5, 0.0]
  assert reward_lib.call_with_timeout(time.sleep, (60,), 0.5, use_process=True) == (0.0, "timeout")
  # Unpicklable functions are errors, not crashes.
  assert reward_lib.call_with_timeout(lambda: 1.0, (), 1.0, use_process=True) == (0.0, "error")


# --- JSONL loading ------------------------------------------------------------------------------

def test_jsonl_malformed_rows_counted_with_line_numbers(tmp_path):
  lines = [
      json.dumps({"prompt": "1+1?", "answer": "2"}),            # 1 ok
      "{not json",                                              # 2 bad JSON
      json.dumps({"prompt": "x"}),                              # 3 missing answer
      "",                                                       # 4 blank: ignored
      json.dumps({"prompt": 5, "answer": "1"}),                 # 5 prompt not a string
      json.dumps(["prompt", "answer"]),                         # 6 not an object
      json.dumps({"prompt": "half?", "answer": 0.5}),           # 7 ok, numeric answer
      json.dumps({"prompt": "p", "answer": None}),              # 8 null answer
      json.dumps({"prompt": "p", "answer": True}),              # 9 bool answer
      json.dumps({"prompt": "", "answer": "1"}),                # 10 empty prompt
      json.dumps({"question": "p", "answer": "1"}),             # 11 missing prompt
      json.dumps({"prompt": "ünï", "answer": "\\frac{1}{2}", "extra": 1}),   # 12 ok
  ]
  path = tmp_path / "data.jsonl"
  path.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe bad utf8\n" + b"[[[" * 50000)
  rows, report = jsonl.load_jsonl(path)
  assert [r["line"] for r in rows] == [1, 7, 12]
  assert [r["answer"] for r in rows] == ["2", "0.5", "\\frac{1}{2}"]
  assert [n for n, _ in report.bad_lines] == [2, 3, 5, 6, 8, 9, 10, 11, 13, 14]
  assert report.num_ok == 3 and report.num_bad == 10
  reasons = dict(report.bad_lines)
  assert "JSON" in reasons[2] and "'answer'" in reasons[3] and "UTF-8" in reasons[13]


def test_jsonl_custom_keys_and_task(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"q": "What is 1/2?", "a": "\\frac{1}{2}"}) + "\n")
  rows, report = jsonl.load_jsonl(path, prompt_key="q", answer_key="a")
  assert len(rows) == 1 and report.num_bad == 0
  task = tasks.get_task("jsonl", path=str(path), prompt_key="q", answer_key="a")
  ex = task.make_example(np.random.default_rng(0))
  assert ex == {"prompt": "What is 1/2?", "answer": "\\frac{1}{2}"}
  assert task.reward(ex["prompt"], ex["answer"], "so it is 0.5") == 1.0
  assert task.reward(ex["prompt"], ex["answer"], "so it is 0.6") == 0.0
  empty = tmp_path / "e.jsonl"
  empty.write_text("oops\n")
  with pytest.raises(ValueError, match="no valid rows"):
    tasks.get_task("jsonl", path=str(empty))


# --- the jsonl task's reward: math_answer's extraction + comparison ------------------------------

def _jsonl_task(tmp_path, answer, timeout_s=20.0):
  path = tmp_path / "one.jsonl"
  path.write_text(json.dumps({"prompt": "p", "answer": answer}) + "\n")
  return tasks.get_task("jsonl", path=str(path), timeout_s=timeout_s)


@pytest.mark.parametrize("answer,completion,expected", [
    ("\\frac{1}{2}", "0.5", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("0.5", "so \\boxed{\\frac{2}{4}}.", 1.0),
    ("\\frac{1}{2}", "1/2", 1.0),
    ("\\frac{1}{2}", "Answer: $\\frac{1}{2}$", 1.0),
    ("-3", "x = -3", 1.0),
    # math_answer's formats, which the old LaTeX-only extractor of this task missed or misread:
    ("1234", "The total is \\boxed{1,234}.", 1.0),  # thousands separator inside a box
    ("72", "#### 72 dollars", 1.0),  # GSM8K line with a unit
    ("7", "\\boxed{7} (checked: 3 + 4)", 1.0),  # the boxed answer wins over a later number
    ("\\frac{1}{2}", "0.6", 0.0),
    ("\\frac{1}{2}", "", 0.0),
    ("\\frac{1}{2}", "1/0", 0.0),
    ("\\frac{1}{2}", "__import__('os').system('touch /tmp/pwned_jaxrl')", 0.0),
    ("\\frac{1}{2}", "💥" * 1000 + "{{{{(((", 0.0),
])
def test_jsonl_reward_is_the_math_answer_reward(tmp_path, answer, completion, expected):
  task = _jsonl_task(tmp_path, answer)
  assert task.reward("p", answer, completion) == expected
  assert math_answer.math_reward("p", answer, completion, timeout_s=20.0) == expected


def test_jsonl_reward_never_executes_output(tmp_path):
  marker = tmp_path / "pwned"
  payload = f"__import__('pathlib').Path('{marker}').touch() or 1"
  assert _jsonl_task(tmp_path, "1").reward("p", "1", payload) in (0.0, 1.0)
  assert not marker.exists()


def test_jsonl_reward_keeps_its_timeout(tmp_path, monkeypatch):
  """`timeout_s` of the jsonl config still bounds each reward call (a hung verifier scores 0)."""
  monkeypatch.setattr(math_answer, "_score", _sleeps)
  assert _jsonl_task(tmp_path, "1", timeout_s=0.1).reward("p", "1", "1") == 0.0
  with pytest.raises(tasks.TaskError, match="timeout_s"):
    _jsonl_task(tmp_path, "1", timeout_s=0)


def test_safe_reward_batches_from_several_threads_share_the_lanes():
  """Async rollout workers score their groups concurrently: each batch gets its own results in order,
  and a hung call in one batch times out without holding up the others' calls."""
  release = threading.Event()

  def fn(i):
    if i == -1:
      release.wait()
    return float(i)

  outs = {}

  def worker(w):
    args = [(-1,)] if w == 0 else []
    args += [(100 * w + j,) for j in range(16)]
    outs[w] = reward_lib.safe_reward_batch(fn, args, timeout_s=0.3, max_workers=3)

  try:
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(30.0)
    assert sorted(outs) == [0, 1, 2, 3]
    assert outs[0].status == ("timeout",) + ("ok",) * 16
    for w in range(4):
      np.testing.assert_array_equal(outs[w].reward_B[-16:], [100 * w + j for j in range(16)])
  finally:
    release.set()
