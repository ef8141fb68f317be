"""verifiers environments (0.4, `verifiers.v1`) trained through the endpoint: the harness `run` plays one episode of a
verifiers taskset against the run's endpoint, scored by the taskset's own rewards.

    serve.harness = "jaxrl_llm.serve.verifiers_env:run"
    serve.harness_kwargs = {"taskset": "<verifiers taskset id>", "taskset_args": {...}}   # configs/verifiers_tiny.py

A verifiers environment is a taskset (tasks, each with its `@vf.reward` functions) played by a harness (the agent
program); both are plugins found by module name (a dotted one too: `plugin_id`). `run(base_url, episode_id, seed,
...)` loads the environment once per process (`vf.load_environment`, runtime "subprocess": nothing leaves the
machine), keeps its `serving()` open on a background event loop, and plays task `seed % len(tasks)` (a GRPO group's G
episodes share the seed, so the task) with verifiers' relay client pointed at the endpoint: `ModelContext(model=<the
endpoint's model>, client=EvalClientConfig(base_url=<endpoint>/v1), sampling={"user": episode_id})`. Every model call
goes harness -> verifiers' interception server -> our `/v1/chat/completions`, carrying the episode id in `user` and
nothing else verifiers adds (no sampling field: the run's sampler settings hold), so the recorder keeps the served
tokens: the learner row holds the policy's tokens exactly as sampled and μ as served, whatever verifiers rebuilds from
them. The trace's `reward` (the weighted sum of the task's rewards) is reported to `/v1/episodes/{id}/reward`; an
episode verifiers marks failed (a harness, scoring or model error) raises, costing that episode only.

The harness: `harness=""` plays with the taskset's default one (its module's exported Harness subclass, else
verifiers' "bash"), any other value is a harness id. The default, `CHAT_HARNESS`, is `ChatHarness` below: a chat
loop run in this process (verifiers allows a harness to run its loop in-process as long as every model call goes
through the endpoint it is given), calling the task's MCP tools (`Toolset`s) through verifiers' own client helpers
when the model asks, until a reply without tool calls or `max_turns` replies. verifiers' bundled harnesses ("null",
"bash", ...) run as `uv` scripts that stream (`stream=true`, which the endpoint refuses: a completion is one whole
sample) and need the network to build their environment, so they do not run here. Its token-in client
(`/inference/v1/generate`, served too) needs a Hugging Face tokenizer by name; the relay keeps tokens exact without.

Versions: `pip install --no-deps verifiers==0.4.0` plus the `verifiers` extra (its other requirements): 0.4.0 pins
mcp==2.0.0 and openai<3, which break OpenEnv's client and `envs.mcp_tools`; everything used here runs on the
mcp and openai the other extras install (tested).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import importlib
import json
import sys
import threading
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.env import RunSlot
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

CHAT_HARNESS = __name__  # ChatHarness's plugin id


def plugin_id(module: str) -> str:
  """A verifiers plugin id for `module`: verifiers imports a taskset or harness by an undotted module name (or
  `owner/name`), so a dotted one (a module in a package, e.g. this one) is imported here and listed in
  `sys.modules` under its name with dots as underscores."""
  if "." not in module or "/" in module:
    return module
  flat = module.replace(".", "_")
  sys.modules.setdefault(flat, importlib.import_module(module))
  return flat


class ChatHarnessConfig(vf.HarnessConfig):
  max_turns: int = 8  # model replies per episode at most (a tool call and its results take one)


class ChatHarness(vf.Harness[ChatHarnessConfig]):
  """A chat loop in this process (module docstring): the task's system prompt and prompt, then model replies; the
  tool calls of a reply are answered by the task's MCP tools (unknown tools and bad arguments as error results),
  until a reply calls none. Non-streaming calls with no sampling fields: the endpoint samples at the run's."""

  APPENDS_SYSTEM_PROMPT = True
  SUPPORTS_MCP = True
  EXECUTES_CODE = False
  NEEDS_CONTAINER = False

  async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
    del trace, runtime, tool_interception_url
    system, prompt = self.resolve_prompt(data)
    messages = [{"role": "system", "content": system}] if system else []
    messages += ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                 else [message_to_wire(m) for m in prompt or []])
    reply = ""
    async with contextlib.AsyncExitStack() as stack:
      client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
      stack.push_async_callback(client.close)
      tools, dispatch, servers = [], {}, {}
      if mcp_urls:
        spec = {"mcpServers": {n: {"url": u, "timeout": self.config.tool_timeout} for n, u in mcp_urls.items()}}
        tools, dispatch, servers = await connect_mcp(spec, stack)
      for _ in range(self.config.max_turns):
        tool_arg = {"tools": tools} if tools else {}
        out = await client.chat.completions.create(model=ctx.model, messages=messages, **tool_arg)
        msg = out.choices[0].message
        reply = msg.content or ""
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
          break
        for call in msg.tool_calls:
          messages.append({"role": "tool", "tool_call_id": call.id,
                           "content": await _tool_result(call, dispatch, servers)})
    return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")


async def _tool_result(call, dispatch: dict, servers: dict):
  """A tool call's result: the MCP tool's content, or an error message the model reads."""
  try:
    args = json.loads(call.function.arguments or "{}")
  except json.JSONDecodeError as e:
    return f"error: invalid JSON in tool arguments ({e})"
  if not isinstance(args, dict):
    return f"error: tool arguments must be a JSON object, got {type(args).__name__}"
  if call.function.name not in dispatch:
    return f"error: unknown tool {call.function.name!r}"
  return await call_mcp(servers, dispatch, call.function.name, args)


class Runner:
  """A verifiers environment with its `serving()` open on a background event loop; `play` is thread-safe (the
  harness threads of a run share one interception server, as verifiers' own evaluation does)."""

  def __init__(self, taskset: str, taskset_args: dict, harness: str):
    agent: dict[str, Any] = {"runtime": {"type": "subprocess"}}
    if harness:
      agent["harness"] = {"id": plugin_id(harness)}
    self.env = vf.load_environment(vf.SingleAgentEnvConfig(taskset={"id": plugin_id(taskset), **taskset_args},
                                                           agent=agent))
    self.tasks = list(self.env.taskset)
    if not self.tasks:
      raise ValueError(f"verifiers taskset {taskset!r} has no tasks")
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=f"verifiers-{taskset}")
    self._thread.start()
    self._opened, self._stop = threading.Event(), None
    self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)
    if not self._opened.wait(120):
      raise RuntimeError(f"verifiers environment {taskset!r} did not start serving")

  async def _serve(self) -> None:
    self._stop = asyncio.Event()
    async with self.env.serving():
      self._opened.set()
      await self._stop.wait()

  def close(self) -> None:
    """Leaves `serving()` (its servers closed) and stops the loop."""
    self.loop.call_soon_threadsafe(self._stop.set)
    try:
      self._serving.result(30)
    finally:
      self.loop.call_soon_threadsafe(self.loop.stop)
      self._thread.join(30)

  def play(self, task, ctx, timeout_s: float):
    """verifiers' episode of `task` (an `Episode`); one not done within `timeout_s` is cancelled (TimeoutError)."""
    fut = asyncio.run_coroutine_threadsafe(self.env.run_slot(RunSlot(task), ctx), self.loop)
    try:
      return fut.result(timeout_s)
    except concurrent.futures.TimeoutError:
      fut.cancel()
      raise


_RUNNERS: dict[str, Runner] = {}
_LOCK = threading.Lock()


@atexit.register
def close_all() -> None:
  """Closes this process's runners (at exit: no server or loop left to the interpreter's shutdown)."""
  with _LOCK:
    while _RUNNERS:
      _RUNNERS.popitem()[1].close()


def runner(taskset: str, taskset_args: dict | None = None, harness: str = CHAT_HARNESS) -> Runner:
  """This process's `Runner` of (taskset, its args, harness): built on first use."""
  key = json.dumps([taskset, taskset_args or {}, harness], sort_keys=True)
  with _LOCK:
    if key not in _RUNNERS:
      _RUNNERS[key] = Runner(taskset, dict(taskset_args or {}), harness)
    return _RUNNERS[key]


@functools.lru_cache(maxsize=16)
def _model_name(base_url: str) -> str:
  """The model the endpoint at `base_url` serves (asked once per endpoint)."""
  import httpx  # noqa: PLC0415
  return httpx.get(f"{base_url}/v1/models", timeout=30).raise_for_status().json()["data"][0]["id"]


def run(base_url: str, episode_id: str, seed: int, *, taskset: str, taskset_args: dict | None = None,
        harness: str = CHAT_HARNESS, timeout_s: float = 600.0) -> float:
  """Plays task `seed % len(tasks)` of verifiers taskset `taskset` (its config fields: `taskset_args`) with
  `harness` against the endpoint at `base_url` as episode `episode_id`; reports and returns the trace's reward."""
  import httpx  # noqa: PLC0415

  r = runner(taskset, taskset_args, harness)
  ctx = vf.ModelContext(model=_model_name(base_url), client=vf.EvalClientConfig(base_url=f"{base_url}/v1",
                                                                api_key_var="JAXRL_LLM_UNUSED_KEY"),
                        sampling=vf.SamplingConfig(user=episode_id))
  episode = r.play(r.tasks[seed % len(r.tasks)], ctx, timeout_s)
  if not episode.ok:
    raise RuntimeError(f"verifiers episode {episode_id} failed: {[str(e) for e in episode.errors]}")
  reward = float(episode.traces[0].reward)
  httpx.post(f"{base_url}/v1/episodes/{episode_id}/reward", json={"reward": reward},
             timeout=30).raise_for_status()
  return reward


# `serve.sandbox` allows one socket (the endpoint) and no new process: verifiers' interception server and tool servers
run.unsandboxable = ("verifiers relays each call through an interception server of its own and runs a task's tools "
                     "in processes of their own, which the sandbox forbids")


__all__ = ["ChatHarness", "run", "runner", "plugin_id", "CHAT_HARNESS"]
