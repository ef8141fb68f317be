"""Tool calls for text environments: schemas from Python functions, the Hermes call format, `ToolEnv`.

The policy calls a tool by writing one block per call (the format `tasks.encoder.hermes_tools_text`
describes to templates that do not render tools, and that Qwen2.5 / Hermes chat models are trained on):

  <tool_call>{"name": "calculator", "arguments": {"expression": "48/2"}}</tool_call>

`ToolEnv` runs the calls and answers with one `{"role": "tool", "content": ...}` message per call; an
action without a tool call is the final answer, scored by the subclass. Text only: no model, sampler or
rollout is imported (`.importlinter`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Sequence

from jaxrl_llm.envs import sandbox as sandbox_lib

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
TOOL_COUNTERS = ("tool_calls", "tool_malformed", "tool_failed", "tool_limit", "tool_killed")


class MalformedToolCall(ValueError):
  """A `<tool_call>` block the environment cannot run; the message is a one-line reason."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: the tool's name and its keyword arguments."""
  name: str
  arguments: dict


def tool_schema(fn: Callable) -> dict:
  """The JSON schema of `fn` (`{"type": "function", "function": {name, description, parameters}}`) from its
  signature's type hints and Google-style docstring (`Args:`), via `transformers.utils.get_json_schema`.
  A function without a docstring or an argument description is a ValueError naming it."""
  try:
    from transformers.utils import get_json_schema  # noqa: PLC0415  (heavy; only tool environments need it)
  except ImportError as e:
    raise ImportError("tool schemas need transformers: pip install -e '.[hf]' (the `hf` extra)") from e
  try:
    return get_json_schema(fn)
  except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
    raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: no JSON schema ({e})") from e


def parse_tool_calls(text: str, names: Sequence[str] | None = None) -> list[ToolCall]:
  """The Hermes-format calls in `text`, in order ([] when there is none).

  Raises MalformedToolCall (one line) for the first block that is not a JSON object with a str "name" and an
  object "arguments", names a tool not in `names` (None: any name), or is not closed by `</tool_call>`.
  """
  blocks = _CALL_RE.findall(text)
  if text.count(_OPEN) != len(blocks):
    raise MalformedToolCall("a <tool_call> block is not closed by </tool_call>")
  calls = []
  for i, raw in enumerate(blocks):
    try:
      obj = json.loads(raw)
    except json.JSONDecodeError as e:
      raise MalformedToolCall(f"tool call {i + 1} is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      raise MalformedToolCall(f'tool call {i + 1} has no "name" string')
    args = obj.get("arguments", None)
    if not isinstance(args, dict):
      raise MalformedToolCall(f'tool call {i + 1} ({obj["name"]}): "arguments" must be a JSON object')
    if names is not None and obj["name"] not in names:
      raise MalformedToolCall(f"unknown tool {obj['name']!r}; the tools are: {', '.join(names)}")
    calls.append(ToolCall(obj["name"], args))
  return calls


def _one_line(text: str, limit: int = 300) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def run_tool(fn: Callable, arguments: dict) -> tuple[str, bool]:
  """`(content, ok)`: `fn(**arguments)` as text, or "error: <reason>" when it raises (ok False)."""
  try:
    out = fn(**arguments)
  except Exception as e:  # pylint: disable=broad-except  # a failing tool is an observation, not a crash
    return f"error: {_one_line(str(e) or type(e).__name__)}", False
  return (out if isinstance(out, str) else json.dumps(out, default=str)), True


class ToolEnv:
  """An environment whose policy may call `functions` before it answers (the `envs.Env` interface).

  Subclasses implement `first_message(seed)` (the episode's start: a str or system/user message dicts) and
  `score(answer_text) -> float` (the final answer's reward). `step(action)`:
    - tool calls in the action: each runs; one `{"role": "tool"}` message per call (its result, or
      "error: ..." when it raises: counted `tool_failed`), step reward 0, not done;
    - a malformed call: one tool message "error: malformed tool call: <reason>" (counted `tool_malformed`),
      nothing runs, not done: the policy may try again;
    - more calls than `max_tool_calls` in the episode (malformed ones included): done with reward 0
      (counted `tool_limit`);
    - no tool call: the final answer, reward `score(action)`, done.
  `sandbox` (an `envs.sandbox.Limits`, a mapping of its fields, or True for its defaults): every call runs in a
  fresh process with CPU, memory and wall limits, no network and no new processes (`envs.sandbox`); a call stopped
  by one of them ends the episode with reward 0 (counted `tool_killed`, and `tool_failed`): code that had to be
  killed is not given another turn to burn. The functions must then be module-level (importable).
  The fourth element `info` holds this step's counts `TOOL_COUNTERS` (the runner sums them as `env_<key>`).
  `tools` lists the functions' JSON schemas (`tool_schema`, or `schemas` when given, e.g. an MCP server's:
  `envs.mcp_tools`), what the runner hands the chat template. A function's tool name is its `__name__`.
  """

  counters = TOOL_COUNTERS  # every batch's stats carry them (`env_tool_*`), 0 where no step reported one

  def __init__(self, functions: Sequence[Callable], max_tool_calls: int = 4, schemas: Sequence[dict] | None = None,
               sandbox: Any = None):
    if isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 0:
      raise ValueError(f"max_tool_calls={max_tool_calls!r}: must be an int >= 0")
    self.functions = {f.__name__: f for f in functions}
    self.tools = [tool_schema(f) for f in functions] if schemas is None else [dict(x) for x in schemas]
    named = [x.get("function", {}).get("name") for x in self.tools]
    if named != list(self.functions):
      raise ValueError(f"tool schemas name {named}, the functions are {list(self.functions)}")
    self.max_tool_calls = max_tool_calls
    self.calls_made = 0
    self.sandbox = sandbox_lib.Limits.of(sandbox)
    if self.sandbox is not None:
      for f in functions:
        sandbox_lib.importable(f)

  def first_message(self, seed: int) -> str | list[dict]:
    raise NotImplementedError

  def score(self, answer_text: str) -> float:
    raise NotImplementedError

  def reset(self, seed: int) -> str | list[dict]:
    self.calls_made = 0
    return self.first_message(seed)

  def step(self, action_text: str) -> tuple[Any, float, bool, dict]:
    info = dict.fromkeys(TOOL_COUNTERS, 0)
    attempts = action_text.count(_OPEN)
    if attempts and self.calls_made + attempts > self.max_tool_calls:
      info["tool_limit"] = 1
      return "", 0.0, True, info
    self.calls_made += attempts
    try:
      calls = parse_tool_calls(action_text, list(self.functions))
    except MalformedToolCall as e:
      info["tool_malformed"] = 1
      return [{"role": "tool", "content": f"error: malformed tool call: {e}"}], 0.0, False, info
    if not calls:
      return "", float(self.score(action_text)), True, info
    messages = []
    for call in calls:
      fn = self.functions[call.name]
      if self.sandbox is None:
        (content, ok), violation = run_tool(fn, call.arguments), None
      else:
        content, ok, violation = sandbox_lib.call(fn, call.arguments, self.sandbox)
      info["tool_calls"] += 1
      info["tool_failed"] += not ok
      if violation is not None:
        info["tool_killed"] = 1
        return "", 0.0, True, info
      messages.append({"role": "tool", "content": content})
    return messages, 0.0, False, info
