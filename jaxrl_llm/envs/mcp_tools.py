"""Tools served by an MCP (Model Context Protocol) server over stdio, for `envs.tools.ToolEnv`.

  source = mcp_tools.shared_source(sys.executable, ["my_server.py"])   # one server per (command, args)
  env = ToolEnv(source.functions(), schemas=source.tools)              # or a ToolEnv subclass

The server runs as a subprocess for the source's lifetime (until `close`, or the end of the program for
`shared_source`'s). A background thread runs an asyncio loop holding the client session (`mcp.Client`, the
SDK v2); `call(name, arguments)` blocks the calling thread (any thread: environments step on the runner's
worker threads, and calls may overlap) until the result or `timeout_s`. A result the server marks as an
error (the tool raised, bad arguments, unknown tool) raises `ToolError` with the server's text, which
`ToolEnv` turns into an "error: ..." tool message. The tools are listed once, at the start (first page).
Text results are joined with newlines; other content (images, resources) is named, not included.
Needs the `mcp` package (`pip install 'mcp>=2'`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import threading
from typing import Any, Callable, Sequence


class ToolError(RuntimeError):
  """A tool call the MCP server answered with an error (or did not answer in time)."""


def _mcp():
  try:
    import mcp  # noqa: PLC0415  (optional dependency, only MCP tool sources need it)
  except ImportError as e:
    raise ImportError("MCP tool sources need the mcp package (SDK v2): pip install 'mcp>=2'") from e
  return mcp


def _schema(tool) -> dict:
  """An MCP tool listing as the `{"type": "function", "function": ...}` schema chat templates take."""
  return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                           "parameters": dict(tool.input_schema)}}


def _text(result) -> str:
  return "\n".join(c.text if getattr(c, "type", None) == "text" else f"[{getattr(c, 'type', 'content')}]"
                   for c in result.content)


class MCPToolSource:
  """The tools of one MCP server launched as `command args` (module docstring).

  Attributes:
    tools: the servers' tools as JSON schemas (`ToolEnv`'s `schemas`).
    timeout_s: the limit of the start-up (launch, handshake, listing) and of each call.
  """

  def __init__(self, command: str, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
               cwd: str | None = None, timeout_s: float = 30.0):
    mcp = _mcp()
    self.timeout_s = float(timeout_s)
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-tools", daemon=True)
    self._thread.start()
    self._stop: asyncio.Event | None = None
    self._client: Any = None
    ready: concurrent.futures.Future = concurrent.futures.Future()
    params = mcp.StdioServerParameters(command=command, args=list(args), env=env, cwd=cwd)
    self._main = asyncio.run_coroutine_threadsafe(self._serve(mcp, params, ready), self._loop)
    try:
      listed = ready.result(self.timeout_s)
    except concurrent.futures.TimeoutError:
      self.close()
      raise ToolError(f"MCP server {command!r} did not start and list its tools within {self.timeout_s:g} s") from None
    except Exception as e:
      self.close()
      raise ToolError(f"MCP server {command!r} failed to start: {type(e).__name__}: {e}") from e
    self.tools = [_schema(t) for t in listed.tools]

  async def _serve(self, mcp, params, ready: concurrent.futures.Future) -> None:
    """Holds the session open (entered and left in this one task, as anyio requires) until `close`."""
    self._stop = asyncio.Event()
    try:
      async with mcp.Client(params) as client:
        listed = await client.list_tools()
        self._client = client
        ready.set_result(listed)
        await self._stop.wait()
    except BaseException as e:
      if not ready.done():
        ready.set_exception(e)
      raise

  def call(self, name: str, arguments: dict) -> str:
    """The text result of tool `name`; ToolError with the server's text when it answers with an error."""
    if self._client is None:
      raise ToolError("the MCP tool source is closed")
    fut = asyncio.run_coroutine_threadsafe(self._client.call_tool(name, arguments), self._loop)
    try:
      result = fut.result(self.timeout_s)
    except concurrent.futures.TimeoutError:
      fut.cancel()
      raise ToolError(f"tool {name!r} gave no result within {self.timeout_s:g} s") from None
    text = _text(result)
    if result.is_error:
      raise ToolError(text or f"tool {name!r} failed")
    return text

  def functions(self) -> list[Callable[..., str]]:
    """One callable per tool (`__name__` = the tool's name, keyword arguments = its arguments), for `ToolEnv`."""
    def make(name):
      def fn(**arguments):
        return self.call(name, arguments)
      fn.__name__ = name
      return fn
    return [make(t["function"]["name"]) for t in self.tools]

  def close(self) -> None:
    """Ends the session and the server process, then the loop thread (idempotent)."""
    if not self._thread.is_alive():
      return
    if self._stop is not None:
      self._loop.call_soon_threadsafe(self._stop.set)
    try:
      self._main.result(self.timeout_s)
    except Exception:  # pylint: disable=broad-except  # a failed start already raised; closing goes on
      pass
    self._client = None
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(self.timeout_s)
    if not self._thread.is_alive():
      self._loop.close()


@functools.lru_cache(maxsize=None)
def _shared(command: str, args: tuple[str, ...], timeout_s: float) -> MCPToolSource:
  source = MCPToolSource(command, args, timeout_s=timeout_s)
  atexit.register(source.close)
  return source


def shared_source(command: str, args: Sequence[str] = (), timeout_s: float = 30.0) -> MCPToolSource:
  """One `MCPToolSource` per (command, args) for the whole program (environments are made one per episode
  row; they share the server), closed at exit."""
  return _shared(command, tuple(args), float(timeout_s))
