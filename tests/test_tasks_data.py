"""Math data-file tasks: GSM8K / MATH / DAPO loaders (JSONL + parquet), answer extraction, reward,
errors naming the file and the columns, the held-out split, over-long prompts, config and CLI."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import tasks
from jaxrl_llm.tasks import math_answer, math_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
GSM8K = os.path.join(DATA, "gsm8k_sample.jsonl")
MATH = os.path.join(DATA, "math_sample.jsonl")
MATH500 = os.path.join(DATA, "math500_sample.jsonl")


def _rows(path):
  return [json.loads(line) for line in open(path)]


def _write_parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), path)
  return str(path)


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


# --- loaders: golden reference answers ----------------------------------------------------------

def test_gsm8k_jsonl_and_parquet(tmp_path):
  rows, report = math_data.load_rows("gsm8k", GSM8K, instruction=math_data.GSM8K_INSTRUCTION)
  # The '#### N' line gives the reference; '1,234' loses its separator; row 4 has no '####'.
  assert [a for _, a in rows] == ["12", "1234", "3", "4.5"]
  assert report.bad_rows == ((4, "'answer' has no '#### N' final line"),) and report.num_ok == 4
  q0 = _rows(GSM8K)[0]["question"]
  assert rows[0][0] == q0 + " Let's think step by step and output the final answer after \"####\"."
  parquet = _write_parquet(tmp_path / "train-00000-of-00001.parquet", _rows(GSM8K))
  assert math_data.load_rows("gsm8k", parquet, instruction=math_data.GSM8K_INSTRUCTION) == (
      rows, report.__class__(**{**report.__dict__, "path": os.path.realpath(parquet)}))
  task = tasks.get_task("gsm8k", path=parquet)
  assert task.name == "gsm8k" and task.rows == rows
  assert task.max_prompt_len == max(len(p) for p, _ in rows)
  assert dict(task.kwargs)["instruction"] == math_data.GSM8K_INSTRUCTION


def test_math_competition_and_math500_layouts(tmp_path):
  rows, report = math_data.load_rows("math", MATH)
  # Last \boxed{} of the solution, balanced braces; row 4 has no box.
  assert [a for _, a in rows] == ["\\frac{1}{2}", "2\\sqrt{3}", "2", "\\{1, 2\\}"]
  assert [n for n, _ in report.bad_rows] == [4]
  rows500, report500 = math_data.load_rows("math", MATH500)
  # The answer column wins; an empty answer falls back to the solution's box.
  assert [a for _, a in rows500] == ["1024", "\\frac{3}{4}", "15"] and report500.num_bad == 0
  task = tasks.get_task("math", path=_write_parquet(tmp_path / "test.parquet", _rows(MATH500)))
  assert [a for _, a in task.rows] == ["1024", "\\frac{3}{4}", "15"]
  assert task.rows[0][0].endswith(" Please reason step by step, and put your final answer within \\boxed{}.")


def test_dapo_chat_prompts_and_ground_truth(tmp_path):
  user = lambda text: [{"role": "user", "content": text}]
  rows = [
      {"data_source": "x", "prompt": user("What is 6*7?"), "ability": "MATH",
       "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"}},
      {"data_source": "x", "prompt": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Half of 1?"}],
       "ability": "MATH", "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"}},
      {"data_source": "x", "prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
       "ability": "MATH", "reward_model": {"ground_truth": "1", "style": "rule"}},
      {"data_source": "x", "prompt": user("No answer"), "ability": "MATH",
       "reward_model": {"ground_truth": "", "style": "rule"}},
  ]
  task = tasks.get_task("dapo", path=_write_parquet(tmp_path / "dapo.parquet", rows))
  assert task.rows == (("What is 6*7?", "42"), ("Be brief.\n\nHalf of 1?", "\\frac{1}{2}"))
  _, report = math_data.load_rows("dapo", str(tmp_path / "dapo.parquet"))
  assert [n for n, _ in report.bad_rows] == [3, 4] and "assistant" in report.bad_rows[0][1]
  assert task.reward("", "42", "6*7 = 42.\nAnswer: 42") == 1.0
  # Plain prompt/answer columns, and configurable keys (dotted for nested columns).
  plain = _write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "1+1?", "answer": 2}])
  assert tasks.get_task("dapo", path=plain).rows == (("1+1?", "2"),)
  custom = _write_jsonl(tmp_path / "c.jsonl", [{"q": "2+2?", "meta": {"gt": "4"}}])
  assert tasks.get_task("dapo", path=custom, prompt_key="q", answer_key="meta.gt").rows == (("2+2?", "4"),)


# --- extraction and reward ---------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("so $\\boxed{\\frac{1}{\\sqrt{2}}}$.", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{5} and later #### 6", "5"),          # a box wins over '####'
    ("work\n#### 1,234.", "1234"),
    ("#### 72 dollars", "72"),
    ("Answer: $2\\sqrt{3}$", "2\\sqrt{3}"),
    ("it is -3.5 or maybe 1,000,000", "1000000"),
    ("the ratio is 3/4", "3/4"),
    ("\\boxed{3 unclosed", "3"),                   # no closed box: the last number
    ("\\boxed{7} then \\boxed{ }", "7"),             # an empty box is skipped
    ("no numbers", None),
])
def test_extract_answer(text, expected):
  assert math_answer.extract_answer(text) == expected


@pytest.mark.parametrize("answer,completion,expected", [
    ("0.5", "so the answer is \\boxed{1/2}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("1234", "1000 + 234\n#### 1,234", 1.0),
    ("1234", "#### 1234.", 1.0),
    ("1234", "The total is 1,234 cups", 1.0),
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}", 1.0),
    ("72", "Answer: 72 dollars", 1.0),
    ("1234", "#### 1,235", 0.0),
    ("0.5", "\\boxed{1/3}", 0.0),
    ("12", "\\boxed{12} is wrong, it is 13", 1.0),  # the box is the final answer
    ("3", "", 0.0),
    ("3", "__import__('os').system('true') or 3", 1.0),  # read as the number 3, never executed
])
def test_math_reward(answer, completion, expected):
  assert math_answer.math_reward("p", answer, completion, timeout_s=20.0) == expected


def test_math_reward_never_executes_output(tmp_path):
  marker = tmp_path / "pwned"
  for payload in (f"\\boxed{{__import__('pathlib').Path('{marker}').touch()}}",
                  f"Answer: __import__('pathlib').Path('{marker}').touch()"):
    assert math_answer.math_reward("p", "\\frac{5}{7}", payload, timeout_s=20.0) == 0.0
  assert not marker.exists()
  assert math_answer.math_reward_with_status("1", None) == (0.0, "error")


# --- errors name the path and the expected columns ----------------------------------------------

def test_missing_file_and_wrong_columns(tmp_path):
  with pytest.raises(tasks.TaskError, match=r"nope\.jsonl: no such file; task 'gsm8k' expects .*'question', 'answer'"):
    tasks.get_task("gsm8k", path=str(tmp_path / "nope.jsonl"))
  with pytest.raises(tasks.TaskError, match=r"math_sample\.jsonl: missing column 'question', 'answer'.*"
                                            r"\(the file has 'level', 'problem', 'solution', 'type'\)") as e:
    tasks.get_task("gsm8k", path=MATH)
  assert e.value.kwarg == "path"
  parquet = _write_parquet(tmp_path / "q.parquet", [{"question": "x", "solution": "y"}])
  with pytest.raises(tasks.TaskError, match=r"q\.parquet: missing column 'answer'"):
    tasks.get_task("gsm8k", path=parquet)
  with pytest.raises(tasks.TaskError, match=r"missing column 'problem'.*'problem', 'answer' or 'solution'"):
    tasks.get_task("math", path=GSM8K)
  broken = tmp_path / "broken.parquet"
  broken.write_bytes(b"not parquet")
  with pytest.raises(tasks.TaskError, match="broken.parquet: not a readable parquet file"):
    tasks.get_task("math", path=str(broken))
  with pytest.raises(tasks.TaskError, match="is a directory"):
    tasks.get_task("jsonl", path=str(tmp_path))
  with pytest.raises(tasks.TaskError, match="needs the argument 'path'"):
    tasks.get_task("math")
  with pytest.raises(tasks.TaskError, match="long_prompts"):
    tasks.get_task("gsm8k", path=GSM8K, long_prompts="cut")


# --- over-long prompts -------------------------------------------------------------------------

def test_overlong_prompt_dropped_or_truncated_and_counted(tmp_path):
  path = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "what is 1+1?", "answer": "2"},
                                                {"prompt": "x" * 100_000, "answer": "1"},
                                                {"prompt": "what is 2+2?", "answer": "4"}])
  task = tasks.get_task("jsonl", path=path)
  assert [a for _, a in task.rows] == ["2", "4"] and task.max_prompt_len == len("what is 1+1?")
  _, report = math_data.load_rows("jsonl", path)
  assert report.num_long == 1 and report.num_ok == 2 and report.num_bad == 0
  cut = tasks.get_task("jsonl", path=path, max_prompt_chars=100, long_prompts="truncate")
  assert [len(p) for p, _ in cut.rows] == [12, 100, 12] and cut.max_prompt_len == 100
  with pytest.raises(tasks.TaskError, match="1 over max_prompt_chars=5"):
    tasks.get_task("jsonl", path=_write_jsonl(tmp_path / "one.jsonl", [{"prompt": "abcdefg", "answer": "1"}]),
                   max_prompt_chars=5)


# --- held-out split ----------------------------------------------------------------------------

def _file_task(tmp_path, n, name="d.jsonl", dup=False):
  rows = [{"prompt": f"q{i % 3 if dup else i}", "answer": str(i)} for i in range(n)]
  return tasks.get_task("jsonl", path=_write_jsonl(tmp_path / name, rows))


def test_num_held_out(tmp_path):
  t20, t700, t7000 = (_file_task(tmp_path, n, f"{n}.jsonl") for n in (20, 700, 7000))
  assert [tasks.num_held_out(t, 0) for t in (t20, t700, t7000)] == [2, 70, 500]
  assert tasks.num_held_out(t20, 0.25) == 5 and tasks.num_held_out(t20, 3) == 3
  assert tasks.num_held_out(t20, 19.0) == 19
  assert tasks.num_held_out(tasks.get_task("arithmetic"), 0) == 500
  assert tasks.num_held_out(tasks.get_task("arithmetic"), 0.01) == 50  # of num_train=5000
  for bad in (20, -1, 1.5, True):
    with pytest.raises(ValueError, match="held_out"):
      tasks.num_held_out(t20, bad)


def test_row_split_partitions_the_file(tmp_path):
  task = _file_task(tmp_path, 700)
  test = tasks.split_examples(task, "test", seed=0, num_test=70)
  train = tasks.split_examples(task, "train", seed=0, num_test=70)  # num_train does not cap a file
  assert len(test) == 70 and len(train) == 630
  assert sorted(ex["prompt"] for ex in test + train) == sorted(f"q{i}" for i in range(700))
  assert [ex["example_id"] for ex in train] == list(range(630))
  assert tasks.split_examples(task, "test", seed=0, num_test=70) == test
  assert tasks.split_examples(task, "test", seed=1, num_test=70) != test
  # Duplicate prompts never straddle the split.
  dup = _file_task(tmp_path, 12, "dup.jsonl", dup=True)
  held = {ex["prompt"] for ex in tasks.split_examples(dup, "test", seed=0, num_test=1)}
  assert held and not held & {ex["prompt"] for ex in tasks.split_examples(dup, "train", seed=0, num_test=1)}


def test_same_rows_through_tfds_and_grain(tmp_path):
  from jaxrl_llm.rollout import collect
  kw = dict(path=_write_parquet(tmp_path / "g.parquet", _rows(GSM8K)))
  for split in ("train", "test"):
    mem = collect.load_split("gsm8k", split, kw, "memory", None, 0, num_test=1)
    tf = collect.load_split("gsm8k", split, kw, "tfds", str(tmp_path / "tfds"), 0, num_test=1)
    assert len(tf) == len(mem) == (3 if split == "train" else 1)
    assert [tf[i] for i in range(len(tf))] == [mem[i] for i in range(len(mem))]


# --- config ------------------------------------------------------------------------------------

def _config(**task):
  c = config_lib.load_file(os.path.join(ROOT, "configs", "tiny.py"))
  for k, v in task.items():
    if k == "kwargs":
      for kk, vv in v.items():
        c.task.kwargs[kk] = vv
    else:
      c.task[k] = v
  return c


def test_config_task_kwargs_and_held_out(tmp_path, capsys):
  config_lib.validate(_config(name="gsm8k", kwargs={"path": GSM8K}))
  config_lib.validate(_config(name="math", kwargs={"path": MATH500}, held_out=1.0))
  # Another task's argument (a config file's setting for its own task, left behind by --config.task.name)
  # is set aside with a note; the task is built without it.
  capsys.readouterr()
  c = _config(name="gsm8k", kwargs={"path": GSM8K, "num_digits": 3})
  config_lib.validate(c)
  assert "config.task.kwargs.num_digits=3 is not an argument of task 'gsm8k'; ignored" in capsys.readouterr().out
  assert config_lib.task_kwargs(c) == {"path": GSM8K}
  with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.kwargs\.path='.*nope.jsonl': no such file"):
    config_lib.validate(_config(name="gsm8k", kwargs={"path": str(tmp_path / "nope.jsonl")}))
  with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.held_out=3\.0: .*leaving none to train on"):
    config_lib.validate(_config(name="math", kwargs={"path": MATH500}, held_out=3.0))
  with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.held_out=-0\.5"):
    config_lib.validate(_config(held_out=-0.5))
  c = _config()
  c.task.kwargs.unknown = 1
  with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.kwargs\.unknown=1: task 'arithmetic' takes no"):
    config_lib.validate(c)
  # One typed field per argument name across all tasks; unset = None.
  kw = tasks.kwargs_config()
  assert set(kw) == {k for n in tasks.task_names() for k in tasks.task_kwarg_names(n)}
  assert all(v is None for v in kw.values())


@pytest.mark.slow
def test_cli_jsonl_20_rows(tmp_path):
  data = _write_jsonl(tmp_path / "t20.jsonl", [{"prompt": f"what is {i % 7}+{i // 7}?", "answer": str(i % 7 + i // 7)}
                                               for i in range(20)])
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  base = [sys.executable, "-m", "jaxrl_llm", "--config=configs/tiny.py", "--config.task.name=jsonl",
          "--config.num_steps=2", "--config.sft.steps=2", "--config.log.tensorboard=False", "--config.eval.every=2"]
  r = subprocess.run(base + [f"--workdir={tmp_path / 'run'}", f"--config.task.kwargs.path={data}",
                             "--config.task.held_out=4"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout + r.stderr
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [row["step"] for row in rows] == [0, 1] and "eval_accuracy" in rows[1]
  saved = json.load(open(tmp_path / "run" / "config.json"))
  assert saved["task"]["kwargs"]["path"] == data and saved["task"]["held_out"] == 4
  r = subprocess.run(base + [f"--workdir={tmp_path / 'bad'}", f"--config.task.kwargs.path={tmp_path}/nope.jsonl"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith(
      f"error: config.task.kwargs.path='{tmp_path}/nope.jsonl': no such file; task 'jsonl' expects")


def test_loop_setup_uses_held_out_and_ignores_overlong_rows(tmp_path):
  """A 20-row file with one 100k-character row: 19 rows kept, `task.held_out` of them held out, and the
  prompt width comes from the kept rows."""
  from jaxrl_llm import loop
  rows = [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(19)]
  rows.insert(7, {"prompt": "y" * 100_000, "answer": "0"})
  c = _config(name="jsonl", kwargs={"path": _write_jsonl(tmp_path / "d.jsonl", rows)}, held_out=4.0)
  config_lib.validate(c)
  run = loop.setup(c)
  assert len(run.train_examples) == 15 and len(run.test.examples) == 4
  assert run.P == len("what is 18+1?") + 1
  held = {ex["prompt"] for ex in run.test.examples}
  assert not held & {run.train_examples[i]["prompt"] for i in range(15)}
  assert len(tasks.sft_examples(run.task, 40, num_test=4)) == 40


def test_prompt_iterator_over_a_data_file(tmp_path):
  from jaxrl_llm.tasks import pipeline
  path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
  it = pipeline.make_prompt_iterator("jsonl", "train", 6, 0, tmp_path / "tfds", source="tfds",
                                     task_kwargs={"path": path}, num_epochs=1, drop_remainder=False)
  seen = [p.decode() for batch in it for p in batch["prompt"]]
  assert len(seen) == 18 and len(set(seen)) == 18  # auto held-out: 2 of 20 rows, each train row once
