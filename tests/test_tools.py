"""Tool calls (`envs.tools`): schemas, the Hermes call parser, `ToolEnv`'s step rules, and the
`gsm8k_calculator` environment with its safe calculator (golden values written out by hand)."""

import fractions
import json

import pytest

from jaxrl_llm import envs
from jaxrl_llm.envs import gsm8k_calculator as g8
from jaxrl_llm.envs.tools import TOOL_COUNTERS, MalformedToolCall, ToolCall, ToolEnv, parse_tool_calls, tool_schema

pytest.importorskip("transformers")


def add(a: int, b: int) -> int:
  """Adds two integers.

  Args:
    a: the first.
    b: the second.
  """
  return a + b


def boom(reason: str) -> str:
  """Always fails.

  Args:
    reason: what to say.
  """
  raise RuntimeError(reason)


class Adder(ToolEnv):
  """Answer 5 to win; tools add and boom."""

  def __init__(self, max_tool_calls=3):
    super().__init__([add, boom], max_tool_calls=max_tool_calls)

  def first_message(self, seed):
    return [{"role": "system", "content": "Add."}, {"role": "user", "content": f"2 + 3? ({seed})"}]

  def score(self, answer_text):
    return float(answer_text.strip() == "5")


def call(name, **arguments):
  return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def counts(**kw):
  return {k: kw.get(k, 0) for k in TOOL_COUNTERS}


def test_tool_schema_from_signature_and_docstring():
  assert tool_schema(add) == {"type": "function", "function": {
      "name": "add", "description": "Adds two integers.",
      "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first."},
                                                      "b": {"type": "integer", "description": "the second."}},
                     "required": ["a", "b"]},
      "return": {"type": "integer"}}}

  def undocumented(x: int):
    return x

  with pytest.raises(ValueError, match="tool 'undocumented': no JSON schema"):
    tool_schema(undocumented)


def test_parse_hermes_calls():
  text = ('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
          '<tool_call>\n{"name": "boom", "arguments": {}}\n</tool_call>')
  assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("boom", {})]
  assert parse_tool_calls("#### 5") == [] and parse_tool_calls("") == []
  bad = {
      "<tool_call>{name: add}</tool_call>": "tool call 1 is not valid JSON",
      '<tool_call>{"arguments": {}}</tool_call>': 'tool call 1 has no "name" string',
      '<tool_call>["add"]</tool_call>': 'tool call 1 has no "name" string',
      '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>': '"arguments" must be a JSON object',
      '<tool_call>{"name": "add"}</tool_call>': '"arguments" must be a JSON object',
      call("add", a=1, b=2) + call("sub", a=1): "unknown tool 'sub'; the tools are: add, boom",
      '<tool_call>{"name": "add", "arguments": {}}': "not closed by </tool_call>",
  }
  for text, reason in bad.items():
    with pytest.raises(MalformedToolCall, match=reason.replace("(", r"\(").replace("[", r"\[")) as e:
      parse_tool_calls(text, ["add", "boom"])
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_tool_env_steps_counts_and_limit():
  env = Adder(max_tool_calls=3)
  assert [t["function"]["name"] for t in env.tools] == ["add", "boom"]
  assert env.reset(1)[1]["content"] == "2 + 3? (1)"
  # two calls in one action: one tool message each, a failing tool is an "error: ..." message
  obs, r, done, info = env.step(call("add", a=2, b=3) + call("boom", reason="no luck"))
  assert obs == [{"role": "tool", "content": "5"}, {"role": "tool", "content": "error: no luck"}]
  assert (r, done, info) == (0.0, False, counts(tool_calls=2, tool_failed=1))
  # wrong arguments: the tool raises TypeError, counted as failed
  obs, r, done, info = env.step(call("add", a=2))
  assert obs[0]["content"].startswith("error: ") and "b" in obs[0]["content"]
  assert info == counts(tool_calls=1, tool_failed=1)
  # the 4th call of the episode: over max_tool_calls=3 -> done, return 0
  assert env.step(call("add", a=0, b=0)) == ("", 0.0, True, counts(tool_limit=1))
  # a malformed call is an error observation; the episode goes on, and the answer is scored
  env.reset(2)
  obs, r, done, info = env.step('<tool_call>{"name": "add", "arguments": 3}</tool_call>')
  reason = 'tool call 1 (add): "arguments" must be a JSON object'
  assert obs == [{"role": "tool", "content": "error: malformed tool call: " + reason}]
  assert (r, done, info) == (0.0, False, counts(tool_malformed=1))
  assert env.step(" 5 ") == ("", 1.0, True, counts())
  env.reset(3)
  assert env.step("4") == ("", 0.0, True, counts())
  with pytest.raises(ValueError, match="max_tool_calls"):
    Adder(max_tool_calls=-1)
  # schemas given (an MCP server's) must name the functions, in order
  assert ToolEnv([add], schemas=[tool_schema(add)]).tools == [tool_schema(add)]
  with pytest.raises(ValueError, match=r"tool schemas name \['boom'\], the functions are \['add'\]"):
    ToolEnv([add], schemas=[tool_schema(boom)])


@pytest.mark.parametrize("expression, value", [
    ("(48 + 24) / 2", "36"), ("1/3", "0.333333"), ("-2 * -3", "6"), ("1,234 + 1", "1235"), (".5 + 1.", "1.5"),
    ("7/2", "3.5"), ("0.1 * 3", "0.3"), ("2 - 3 * (4 - 1)", "-7"), ("-(1 - 1)", "0"), ("2/3*3", "2")])
def test_calculator_golden(expression, value):
  assert g8.calculator(expression) == value


@pytest.mark.parametrize("expression, reason", [
    ("2/0", "division by zero"), ("2**3", "unexpected '\\*'"), ("__import__('os')", "unsupported character '_'"),
    ("((1)", "missing \\)"), ("1 2", "unexpected '2'"), ("", "empty"), ("1+", "unexpected end"),
    ("(" * 40 + "1" + ")" * 40, "nested deeper"), ("1" * 16, "number too long"), ("1+" * 150 + "1", "longer than 200")])
def test_calculator_rejects(expression, reason):
  with pytest.raises(ValueError, match=reason):
    g8.calculator(expression)


def test_calculator_is_exact():
  assert g8.evaluate("0.1 + 0.2") == fractions.Fraction(3, 10)


def test_gsm8k_calculator_env(tmp_path):
  rows = [{"question": "Ann has 48 pens and buys half as many again. How many pens now?",
           "answer": "48/2 = 24 more.\n48 + 24 = 72\n#### 72"}]
  path = tmp_path / "one.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  env = envs.get("gsm8k_calculator", path=str(path), max_tool_calls=2)
  assert env.tools == [tool_schema(g8.calculator)] and env.tools[0]["function"]["name"] == "calculator"
  first = env.reset(0)
  assert first == rows[0]["question"] + " " + g8.INSTRUCTION
  obs, r, done, info = env.step(call("calculator", expression="48 + 48/2"))
  assert (obs, r, done) == ([{"role": "tool", "content": "72"}], 0.0, False) and info["tool_calls"] == 1
  assert env.step(call("calculator", expression="1/0"))[0] == [{"role": "tool", "content": "error: division by zero"}]
  assert env.step("So she has 72 pens.\n#### 72")[1:3] == (1.0, True)
  env.reset(0)
  assert env.step("#### 70")[1:3] == (0.0, True)
  # the default problems: the sample shipped with the package, deterministic in the seed
  a, b = envs.get("gsm8k_calculator"), envs.get("gsm8k_calculator")
  assert len(a.rows) == 50 and a.reset(7) == b.reset(7) and a.answer == b.answer
  assert len({a.reset(s) for s in range(20)}) > 5


def test_gsm8k_calculator_heldout_problems_are_the_evaluations_only():
  from jaxrl_llm.episode_eval import eval_seeds
  env = envs.get("gsm8k_calculator", heldout=10)
  questions = [q for q, _ in env.rows]
  train = {questions.index(env.reset(s).rsplit(" Use the calculator", 1)[0]) for s in range(2000)}
  held = [questions.index(env.reset(s).rsplit(" Use the calculator", 1)[0]) for s in eval_seeds(12)]
  assert train == set(range(40)) and held == [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 40, 41]
  assert env.answer == env.rows[41][1]
  with pytest.raises(ValueError, match="heldout=50: must be in"):
    envs.get("gsm8k_calculator", heldout=50)


def test_tool_schema_without_transformers_names_the_extra(monkeypatch):
  import sys
  monkeypatch.setitem(sys.modules, "transformers.utils", None)  # `from transformers.utils import ...` fails
  with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]' \(the `hf` extra\)"):
    tool_schema(add)
