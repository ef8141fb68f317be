"""MCP tool sources (`envs.mcp_tools`): a tiny stdio server written here, spawned as a subprocess, its
tools listed as schemas and called through `ToolEnv` (results, server-side errors, overlapping calls)."""

import concurrent.futures
import json
import sys
import textwrap

import pytest

from jaxrl_llm.envs.tools import ToolEnv

pytest.importorskip("mcp.server.mcpserver")  # the SDK v2
from jaxrl_llm.envs import mcp_tools  # noqa: E402

SERVER = textwrap.dedent('''
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("tiny")

    @app.tool()
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        return a + b

    @app.tool()
    def shout(text: str) -> str:
        """Upper-cases a text."""
        if not text:
            raise ValueError("nothing to shout")
        return text.upper()

    if __name__ == "__main__":
        app.run()
''')


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  path = tmp_path_factory.mktemp("mcp") / "server.py"
  path.write_text(SERVER)
  src = mcp_tools.MCPToolSource(sys.executable, [str(path)], timeout_s=60.0)
  yield src
  src.close()


class Answer(ToolEnv):
  def first_message(self, seed):
    return "add 2 and 3"

  def score(self, answer_text):
    return float(answer_text.strip() == "5")


def call(name, args):
  return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_lists_tools_as_schemas_and_calls_them(source):
  by_name = {t["function"]["name"]: t["function"] for t in source.tools}
  assert sorted(by_name) == ["add", "shout"]
  assert by_name["add"]["description"] == "Adds two integers."
  assert by_name["add"]["parameters"]["required"] == ["a", "b"]
  assert by_name["add"]["parameters"]["properties"]["a"]["type"] == "integer"
  assert source.call("add", {"a": 2, "b": 3}) == "5"
  assert source.call("shout", {"text": "hi"}) == "HI"
  with pytest.raises(mcp_tools.ToolError, match="shout"):
    source.call("shout", {"text": ""})
  with pytest.raises(mcp_tools.ToolError, match="Unknown tool"):
    source.call("nope", {})


def test_tool_env_over_an_mcp_server(source):
  env = Answer(source.functions(), max_tool_calls=4, schemas=source.tools)
  assert env.tools == source.tools
  env.reset(0)
  obs, r, done, info = env.step(call("add", {"a": 2, "b": 3}) + call("shout", {"text": "ok"}))
  assert obs == [{"role": "tool", "content": "5"}, {"role": "tool", "content": "OK"}] and (r, done) == (0.0, False)
  assert info["tool_calls"] == 2 and info["tool_failed"] == 0
  obs, _, done, info = env.step(call("add", {"a": 2}))  # a missing argument: the server's validation error
  assert obs[0]["content"].startswith("error: ") and "b" in obs[0]["content"] and info["tool_failed"] == 1 and not done
  assert env.step("5")[1:3] == (1.0, True)


def test_overlapping_calls_from_worker_threads(source):
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(lambda i: source.call("add", {"a": i, "b": 100}), range(16)))
  assert got == [str(i + 100) for i in range(16)]


def test_a_server_that_does_not_start_is_a_tool_error(tmp_path):
  with pytest.raises(mcp_tools.ToolError, match="failed to start|did not start"):
    mcp_tools.MCPToolSource(sys.executable, ["-c", "import sys; sys.exit(3)"], timeout_s=20.0)
  path = tmp_path / "server.py"
  path.write_text(SERVER)
  src = mcp_tools.MCPToolSource(sys.executable, [str(path)], timeout_s=60.0)
  assert src.call("add", {"a": 1, "b": 1}) == "2"
  src.close()
  src.close()  # idempotent
  with pytest.raises(mcp_tools.ToolError, match="closed"):
    src.call("add", {"a": 1, "b": 1})
