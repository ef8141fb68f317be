"""Tokenizer, task registry, arithmetic and countdown tasks, the safe expression parser, splits."""

import collections
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm import tasks
from jaxrl_llm.tasks import arithmetic, countdown, expr
from jaxrl_llm.tasks import tokenizer as tok

# Inputs every reward must survive: garbage, unicode, huge, deep nesting, division by zero, ...
HOSTILE = [
    "", " ", "\n", "\x00", "59\x00", "ǅ", "５９", "٥٩", "💥" * 100, "a" * 10**6, "9" * 10**6,
    "1/0", "(1/0)", "10**9", "9**9**9**9", "(" * 10000 + ")" * 10000, "(((((", ")))", "()",
    "1+", "+1", "--1", "1 2", "__import__('os').system('echo hi')", "eval('1')", "nan", "inf",
    "1e9", "0x10", "1_000", None, 12, b"59", ["59"],
]


# --- tokenizer ---------------------------------------------------------------------------------

def test_tokenizer_ids_and_vocab():
  assert tok.vocab_size == 64
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
  assert tok.encode("0189") == [4, 5, 12, 13]
  assert tok.encode("+-*=(), ") == [14, 15, 16, 17, 18, 19, 20, 21]
  assert tok.encode("az") == [22, 47]
  assert tok.encode("12", add_bos=True, add_eos=True) == [1, 5, 6, 2]


def test_tokenizer_round_trip_every_character():
  text = "".join(tok._CHARS) + " countdown 3 5 7 -> 22: (3+5)*7-1 \\frac{1}{2}"
  ids = tok.encode(text)
  assert len(ids) == len(text) and max(ids) < tok.vocab_size and min(ids) >= 4
  assert tok.decode(ids) == text
  assert tok.decode(np.asarray(ids, dtype=np.int32)) == text


def test_tokenizer_unknown_and_specials_never_raise():
  assert tok.encode("Aé\n💥") == [tok.unk_id] * 4
  assert tok.decode([tok.unk_id, 99, -5]) == "\ufffd" * 3
  # pad/bos skipped anywhere, decoding stops at the first eos.
  assert tok.decode([0, 0, 1, 5, 0, 6, 2, 7, 8]) == "12"
  assert tok.decode([]) == ""
  assert tok.decode(np.array([[5, 6], [2, 7]])) == "12"


def test_pad_left_and_right():
  tokens_BP, len_B = tok.pad_left([[1, 5], [1, 5, 6, 7], []], 4)
  np.testing.assert_array_equal(tokens_BP, [[0, 0, 1, 5], [1, 5, 6, 7], [0, 0, 0, 0]])
  np.testing.assert_array_equal(len_B, [2, 4, 0])
  tokens_BA, len_B = tok.pad_right([[5, 2], [2]], 3)
  np.testing.assert_array_equal(tokens_BA, [[5, 2, 0], [2, 0, 0]])
  np.testing.assert_array_equal(len_B, [2, 1])
  with pytest.raises(ValueError, match="width 2"):
    tok.pad_left([[1, 2, 3]], 2)


def test_import_is_light():
  code = ("import sys, jaxrl_llm.tasks; "
          "print(sorted(m for m in ('jax', 'grain', 'tensorflow_datasets', 'math_verify', 'sympy')"
          " if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


# --- registry ----------------------------------------------------------------------------------

def test_registry():
  assert tasks.task_names() == ["arithmetic", "arithmetic_chat", "countdown", "dapo", "gsm8k", "jsonl", "math",
                               "reasoning_gym"]
  assert tasks.get_task("arithmetic").name == "arithmetic"
  assert tasks.get_task("countdown", max_count=3).kwargs == tasks.get_task(
      "countdown", max_count=3).kwargs
  with pytest.raises(ValueError, match="arithmetic, arithmetic_chat, countdown, dapo, gsm8k, jsonl, math"):
    tasks.get_task("nope")
  # None = the task's default; an argument the task does not take is named.
  assert tasks.get_task("arithmetic", num_digits=None, path=None).kwargs == (("num_digits", 2), ("ops", "+"))
  with pytest.raises(tasks.TaskError, match="'arithmetic' takes no argument 'path'") as e:
    tasks.get_task("arithmetic", path="x.jsonl")
  assert e.value.kwarg == "path"


def test_task_argument_validation():
  with pytest.raises(ValueError, match="num_digits"):
    tasks.get_task("arithmetic", num_digits=0)
  with pytest.raises(ValueError, match="ops"):
    tasks.get_task("arithmetic", ops="/")
  with pytest.raises(ValueError, match="min_count"):
    tasks.get_task("countdown", min_count=5, max_count=4)


# --- arithmetic --------------------------------------------------------------------------------

def test_arithmetic_examples_are_correct_and_bounded():
  for ops in ("+", "-", "*", "+-*"):
    for d in (1, 2, 3):
      task = tasks.get_task("arithmetic", num_digits=d, ops=ops)
      rng = np.random.default_rng(d)
      for _ in range(200):
        ex = task.make_example(rng)
        m = re.fullmatch(r"([0-9]+)([-+*])([0-9]+)=", ex["prompt"])
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert op in ops and len(m.group(1)) == d and len(m.group(3)) == d
        assert int(ex["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert len(ex["prompt"]) <= task.max_prompt_len
        assert len(ex["answer"]) <= task.max_answer_len
        assert task.reward(ex["prompt"], ex["answer"], ex["answer"]) == 1.0


def test_arithmetic_default_is_two_digit_addition():
  task = tasks.get_task("arithmetic")
  ex = task.make_example(np.random.default_rng(0))
  assert re.fullmatch(r"[1-9][0-9]\+[1-9][0-9]=", ex["prompt"])
  assert (task.max_prompt_len, task.max_answer_len) == (6, 3)


@pytest.mark.parametrize("completion,expected", [
    ("59", 1.0), (" 59 ", 1.0), ("59\n", 1.0), ("059", 0.0), ("59.0", 0.0), ("5 9", 0.0),
    ("58", 0.0), ("59+0", 0.0), ("５９", 0.0), ("", 0.0), ("59" * 1000, 0.0),
])
def test_arithmetic_reward_golden(completion, expected):
  assert arithmetic.reward("12+47=", "59", completion) == expected


def test_arithmetic_reward_negative_answer():
  assert arithmetic.reward("12-47=", "-35", "-35") == 1.0
  assert arithmetic.reward("12-47=", "-35", "35") == 0.0


@pytest.mark.parametrize("completion", HOSTILE, ids=range(len(HOSTILE)))
def test_rewards_survive_hostile_completions(completion):
  for task in (tasks.get_task("arithmetic"), tasks.get_task("countdown", format_reward=0.1)):
    ex = task.make_example(np.random.default_rng(0))
    r = task.reward(ex["prompt"], ex["answer"], completion)
    assert isinstance(r, float) and 0.0 <= r <= 1.0
    # Hostile prompts and answers as well.
    r = task.reward(completion, completion, ex["answer"])
    assert isinstance(r, float) and 0.0 <= r <= 1.0


# --- safe expression parser --------------------------------------------------------------------

@pytest.mark.parametrize("text,value,literals", [
    ("3*5+7", 22, (3, 5, 7)),
    ("3+5*7", 38, (3, 5, 7)),
    ("(3+5)*7", 56, (3, 5, 7)),
    ("7-5-3", -1, (7, 5, 3)),          # left-associative
    ("7-(5-3)", 5, (7, 5, 3)),
    ("2*3*4", 24, (2, 3, 4)),
    (" ( ( 8 ) ) ", 8, (8,)),
    ("((((1+2))))*((3))", 9, (1, 2, 3)),
    ("10-2*3+4", 8, (10, 2, 3, 4)),
])
def test_parse_expression_golden(text, value, literals):
  assert expr.parse_expression(text) == (value, literals)


@pytest.mark.parametrize("text", [
    "", "()", "1+", "+1", "-1", "1 2", "(1+2", "1+2)", "1/2", "1/0", "2**3", "1e3", "٣",
    "1.5", "x", "1234567", "(" * 40 + "1" + ")" * 40, "1+" * 200 + "1", None, 7,
])
def test_parse_expression_rejects(text):
  assert expr.parse_expression(text) is None


# --- countdown ---------------------------------------------------------------------------------

def test_countdown_reference_solutions_solve_their_instances():
  task = tasks.get_task("countdown")
  rng = np.random.default_rng(0)
  counts = collections.Counter()
  for _ in range(500):
    ex = task.make_example(rng)
    numbers, target = countdown.parse_prompt(ex["prompt"])
    value, literals = expr.parse_expression(ex["answer"])
    assert value == target and 1 <= target <= 999
    assert sorted(literals) == sorted(numbers)  # every number exactly once
    assert all(1 <= n <= 9 for n in numbers)
    assert len(ex["prompt"]) <= task.max_prompt_len
    assert len(ex["answer"]) <= task.max_answer_len
    assert task.reward(ex["prompt"], ex["answer"], ex["answer"]) == 1.0
    counts[len(numbers)] += 1
  assert set(counts) == {3, 4}


def test_countdown_minimal_parentheses():
  # a-(b+c) keeps its parentheses, (a*b)+c loses them.
  assert countdown._combine((7, "7", 3), (8, "5+3", 1), "-") == (-1, "7-(5+3)", 1)
  assert countdown._combine((6, "2*3", 2), (4, "4", 3), "+") == (10, "2*3+4", 1)
  assert countdown._combine((8, "5+3", 1), (2, "2", 3), "*") == (16, "(5+3)*2", 2)
  assert countdown._combine((2, "2", 3), (15, "3*5", 2), "*") == (30, "2*3*5", 2)


@pytest.mark.parametrize("completion,expected", [
    ("3*5+7", 1.0),
    ("7+5*3", 1.0),          # any valid expression, not only the reference
    (" 7 + 3 * 5 ", 1.0),
    ("(3*5)+7", 1.0),
    ("3*5+7+0", 0.0),        # 0 is not a given number
    ("3*5+7*1", 0.0),
    ("3*5", 0.1),            # well formed, allowed numbers, wrong value: format reward
    ("3+3+5+7", 0.0),        # 3 used twice but given once
    ("22", 0.0),
    ("3*5+7=22", 0.0),
    ("(3*5+7", 0.0),
    ("15+7", 0.0),
    ("3/1*5+7", 0.0),
    ("", 0.0),
])
def test_countdown_reward_golden(completion, expected):
  reward = tasks.get_task("countdown", format_reward=0.1).reward
  assert reward("countdown 3 5 7 -> 22:", "3*5+7", completion) == expected


def test_countdown_repeated_numbers_may_repeat():
  reward = tasks.get_task("countdown").reward
  assert reward("countdown 3 3 4 -> 13:", "3*3+4", "3*3+4") == 1.0
  assert reward("countdown 3 3 4 -> 13:", "3*3+4", "3*3+4-3+3") == 0.0
  assert reward("countdown 3 5 7 -> 22:", "3*5+7", "3*5") == 0.0  # binary by default


# --- splits, determinism, SFT data ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_examples_deterministic_by_seed(name):
  task = tasks.get_task(name)
  def draw(seed):
    rng = np.random.default_rng(seed)
    return [task.make_example(rng) for _ in range(50)]
  assert draw(3) == draw(3)
  assert draw(3) != draw(4)
  split = lambda seed: tasks.split_examples(task, "train", seed=seed, num_train=200, num_test=50)
  assert split(0) == split(0)
  assert split(0) != split(1)


@pytest.mark.parametrize("name,kw", [("arithmetic", {}), ("countdown", {}),
                                     ("arithmetic", {"num_digits": 1})])
def test_train_test_disjoint(name, kw):
  task = tasks.get_task(name, **kw)
  test = tasks.split_examples(task, "test", seed=0, num_train=2000, num_test=50)
  train = tasks.split_examples(task, "train", seed=0, num_train=2000, num_test=50)
  assert len(test) == 50 and len(train) == 2000
  test_prompts = {ex["prompt"] for ex in test}
  assert len(test_prompts) == 50
  assert not test_prompts & {ex["prompt"] for ex in train}
  assert [ex["example_id"] for ex in train] == list(range(2000))


def test_split_errors():
  task = tasks.get_task("arithmetic", num_digits=1)  # 100 distinct prompts
  with pytest.raises(ValueError, match="distinct prompts"):
    tasks.split_examples(task, "test", num_test=101)
  with pytest.raises(ValueError, match="valid splits"):
    tasks.split_examples(task, "validation")


def test_score_completions():
  task = tasks.get_task("arithmetic")
  ids_BN = np.array([tok.encode("59", add_eos=True) + [7, 7],   # text after EOS is ignored
                     tok.encode("599") + [0, 0],                 # no EOS: judged on its text
                     tok.encode(" 59") + [tok.eos_id, 0],
                     [tok.eos_id, 5, 5, 5, 5]])
  reward_B = tasks.score_completions(task, [b"12+47="] * 4, [b"59", "59", "59", "59"], ids_BN)
  assert reward_B.dtype == np.float32
  np.testing.assert_array_equal(reward_B, [1.0, 0.0, 1.0, 0.0])


def test_sft_examples():
  task = tasks.get_task("arithmetic")
  pairs = tasks.sft_examples(task, 20, seed=0)
  train = tasks.split_examples(task, "train", seed=0, num_train=20)
  assert len(pairs) == 20
  for (prompt_tokens, target_tokens), ex in zip(pairs, train):
    assert prompt_tokens[0] == tok.bos_id and tok.decode(prompt_tokens) == ex["prompt"]
    assert target_tokens[-1] == tok.eos_id and tok.decode(target_tokens) == ex["answer"]
    # The SFT target is exactly a reward-1 completion.
    assert task.reward(ex["prompt"], ex["answer"], tok.decode(target_tokens)) == 1.0
  assert pairs == tasks.sft_examples(task, 20, seed=0)
