"""Arithmetic phrased as a chat question (``style="chat"``): prompts, last-integer reward."""

import re

import numpy as np
import pytest

from jaxrl_llm import tasks
from jaxrl_llm.tasks import arithmetic
from tests.test_tasks import HOSTILE


def test_chat_examples_match_raw_problems():
  """Same rng state, same problem: the chat prompt restates the raw one, the answer is unchanged."""
  for ops in ("+", "-", "*", "+-*"):
    for d in (1, 2, 3):
      raw = tasks.get_task("arithmetic", num_digits=d, ops=ops)
      chat = tasks.get_task("arithmetic", num_digits=d, ops=ops, style="chat")
      r1, r2 = np.random.default_rng(d), np.random.default_rng(d)
      for _ in range(100):
        e1, e2 = raw.make_example(r1), chat.make_example(r2)
        a, op, b = re.fullmatch(r"([0-9]+)([-+*])([0-9]+)=", e1["prompt"]).groups()
        assert e2["prompt"] == f"What is {a} {op} {b}? Reply with only the number."
        assert e2["answer"] == e1["answer"]
        assert len(e2["prompt"]) <= chat.max_prompt_len
        assert chat.reward(e2["prompt"], e2["answer"], e2["answer"]) == 1.0


def test_chat_default_golden():
  task = tasks.get_task("arithmetic", style="chat")
  # Both operands drawn from [10, 100) by default_rng(0): 86 and 67 (same draws as the raw task).
  assert task.make_example(np.random.default_rng(0)) == {
      "prompt": "What is 86 + 67? Reply with only the number.", "answer": "153"}
  assert task.max_prompt_len == len("What is 99 + 99? Reply with only the number.") == 44
  assert task.kwargs == (("num_digits", 2), ("ops", "+"), ("style", "chat"))
  # The raw style keeps its kwargs (TFDS config names of existing datasets stay the same).
  assert tasks.get_task("arithmetic", style="raw").kwargs == (("num_digits", 2), ("ops", "+"))


@pytest.mark.parametrize("completion,expected", [
    ("59", 1.0), (" 59\n", 1.0), ("The answer is 59.", 1.0), ("12 + 47 = 59", 1.0),
    ("**59**", 1.0), ("059", 1.0), ("I think 58. No: 59", 1.0),
    ("59 or 60", 0.0), ("59.5", 0.0), ("59.0", 0.0), ("58", 0.0), ("five nine", 0.0),
    ("", 0.0), ("５９", 0.0), ("5 9", 0.0), ("59" * 1000, 0.0),
])
def test_chat_reward_golden(completion, expected):
  assert arithmetic.chat_reward("What is 12 + 47?", "59", completion) == expected


@pytest.mark.parametrize("completion,expected", [
    ("-35", 1.0), ("12 - 47 = -35", 1.0), ("It is -35.", 1.0), ("35", 0.0), ("47-35", 0.0),
])
def test_chat_reward_negative_answer(completion, expected):
  # A minus between two digits is subtraction, not a sign: "47-35" ends in 35.
  assert arithmetic.chat_reward("What is 12 - 47?", "-35", completion) == expected


@pytest.mark.parametrize("text,value", [
    ("1,234", 1234), ("total 12,345,678 items", 12345678), ("5-3", 3), ("x -7", -7),
    ("a1b22c333", 333), ("3.25 then 4", 4), ("4 then 3.25", None), ("none", None), ("", None),
    ("1,23", 23),
])
def test_last_integer_golden(text, value):
  assert arithmetic.last_integer(text) == value


@pytest.mark.parametrize("completion", HOSTILE, ids=range(len(HOSTILE)))
def test_chat_reward_survives_hostile_completions(completion):
  task = tasks.get_task("arithmetic", style="chat")
  ex = task.make_example(np.random.default_rng(0))
  assert task.reward(ex["prompt"], ex["answer"], completion) in (0.0, 1.0)
  assert task.reward(ex["prompt"], completion, ex["answer"]) in (0.0, 1.0)


def test_arithmetic_chat_task_is_the_chat_style():
  """The registered `arithmetic_chat` task: same examples and reward as style="chat", its own name."""
  a = tasks.get_task("arithmetic_chat", num_digits=3, ops="*")
  b = tasks.get_task("arithmetic", num_digits=3, ops="*", style="chat")
  assert a.name == "arithmetic_chat" and a.kwargs == (("num_digits", 3), ("ops", "*"))
  assert a.make_example(np.random.default_rng(5)) == b.make_example(np.random.default_rng(5))
  assert a.reward is arithmetic.chat_reward and a.max_prompt_len == b.max_prompt_len
  # Its kwargs rebuild it (TFDS builders call get_task(name, **kwargs)).
  again = tasks.get_task(a.name, **dict(a.kwargs))
  assert (again.name, again.kwargs) == (a.name, a.kwargs)
  assert again.make_example(np.random.default_rng(1)) == a.make_example(np.random.default_rng(1))
  with pytest.raises(tasks.TaskError, match="'arithmetic_chat' takes no argument 'style'"):
    tasks.get_task("arithmetic_chat", style="chat")


def test_chat_style_validation():
  with pytest.raises(ValueError, match="style"):
    tasks.get_task("arithmetic", style="prose")
