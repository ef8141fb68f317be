"""verifiers (0.4, `verifiers.v1`) environments through the endpoint (`jaxrl_llm.serve.verifiers_env`): an episode's
model calls reach the endpoint with nothing verifiers adds, the recorder keeps the served ids, the reward is the
taskset's own; a taskset written in a test module with a tool runs its tool through verifiers' MCP server; the
shipped config trains 2 steps from the CLI with μ equal to the learner's scores."""

import json
import os
import random
import re
import subprocess
import sys
import types

import numpy as np
import pytest

pytest.importorskip("verifiers.v1")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from jaxrl_llm.envs import verifiers_sums  # noqa: E402
from jaxrl_llm.serve import verifiers_env  # noqa: E402
from test_serve import ROOT, chat_tok, stub_service  # noqa: E402,F401  (chat_tok: a fixture)

SUMS = "jaxrl_llm.envs.verifiers_sums"


@pytest.fixture(autouse=True)
def tool_server_path(monkeypatch):
  """verifiers starts vf_tool_taskset's MCP server as `python -m vf_tool_taskset`: it imports from tests/."""
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]))


def _task_prompt(seed: int) -> str:
  """Task `seed`'s prompt as the taskset's docstring defines it (written here from the docstring, not its code)."""
  rng = random.Random(seed)
  a, b = rng.randint(0, 99), rng.randint(0, 99)
  return f"{a}+{b}="


@pytest.mark.parametrize("reply", ["right", "one digit", "wrong"])
def test_an_episode_is_served_recorded_and_scored_by_the_taskset(chat_tok, reply):  # noqa: F811
  tok = chat_tok
  seed = 7
  prompt = _task_prompt(seed)
  a, b = map(int, prompt[:-1].split("+"))
  answer = str(a + b)
  text = {"right": answer, "one digit": answer[0] + "x" * (len(answer) - 1), "wrong": "x" * len(answer)}[reply]
  want = {"right": 1.0, "one digit": 0.5 / len(answer), "wrong": 0.0}[reply]
  script = [tok.encode(text) + [tok.end_of_turn_id]]
  svc, sampler = stub_service(tok, script)
  try:
    got = verifiers_env.run(svc.base_url, "ep-7", seed, taskset=SUMS, timeout_s=120)
    ep = svc.recorder.pop("ep-7")
  finally:
    svc.close()
  assert got == pytest.approx(want) and ep.reward == pytest.approx(want)
  # one call: the task's prompt alone through the chat template (verifiers added no message), the served ids kept
  assert sampler.calls == 1 and len(ep.calls) == 1
  assert ep.calls[0].prompt_ids == tok.chat_ids([{"role": "user", "content": prompt}], add_generation_prompt=True)
  assert ep.calls[0].completion_ids == script[0]
  np.testing.assert_allclose(ep.calls[0].logprobs, -0.1 * (np.arange(len(script[0])) + 1), atol=1e-6)


def test_a_failed_episode_raises_and_reports_nothing(chat_tok):  # noqa: F811
  """A reward function that raises fails verifiers' episode: the harness raises (the source counts it failed) and
  no reward reaches the endpoint."""
  svc, _ = stub_service(chat_tok, [chat_tok.encode("1") + [chat_tok.end_of_turn_id]])
  try:
    with pytest.raises(RuntimeError, match="verifiers episode ep-x failed"):
      verifiers_env.run(svc.base_url, "ep-x", 0, taskset="vf_tool_taskset", taskset_args={"fail": True},
                        timeout_s=120)
    assert svc.recorder.pop("ep-x").reward is None
  finally:
    svc.close()


def test_a_tool_call_runs_the_tasks_mcp_tool(chat_tok):  # noqa: F811
  """A taskset written outside the package (tests/vf_tool_taskset.py) with a verifiers `Toolset`: the chat harness
  lists its tool to the model, runs the model's call through verifiers' MCP server (a subprocess) and sends the
  result back; the second reply is scored. The recorded episode extends: call 2's prompt is call 1's ids, its
  served ids and the tool message."""
  tok = chat_tok
  call = '<tool_call>{"name": "calc_add", "arguments": {"a": 3, "b": 4}}</tool_call>'
  script = [tok.encode(call) + [tok.end_of_turn_id], tok.encode("7") + [tok.end_of_turn_id]]
  svc, sampler = stub_service(tok, script)
  try:
    got = verifiers_env.run(svc.base_url, "ep-t", 0, taskset="vf_tool_taskset", timeout_s=120)
    ep = svc.recorder.pop("ep-t")
  finally:
    svc.close()
  assert got == 1.0 and sampler.calls == 2 and len(ep.calls) == 2
  assert "calc_add" in tok.decode(ep.calls[0].prompt_ids)  # the tool's schema was shown
  second = tok.decode(ep.calls[1].prompt_ids)
  assert ep.calls[1].prompt_ids[:len(ep.calls[0].prompt_ids) + len(script[0])] == ep.calls[0].prompt_ids + script[0]
  assert re.search(r"tool\n7", second), second  # the MCP tool's result, 3 + 4


def test_sandboxing_it_is_a_config_error():
  """serve.sandbox would kill every episode (verifiers' own servers): refused before the run, naming the field."""
  from jaxrl_llm import wiring
  from jaxrl_llm.config import ConfigError, load_file
  from jaxrl_llm.rollout.sources import harness as harness_source
  c = load_file(os.path.join(ROOT, "configs", "verifiers_tiny.py"))
  c.serve.sandbox = True
  ctx = types.SimpleNamespace(settings=types.SimpleNamespace(serve=wiring.serve_settings(c)))
  with pytest.raises(ConfigError, match=r"config.serve.sandbox=True: .*interception server"):
    harness_source.Harness(ctx, store=None)


def test_dotted_module_ids_are_plugins():
  assert verifiers_env.plugin_id("vf_tool_taskset") == "vf_tool_taskset"
  assert verifiers_env.plugin_id(SUMS) == "jaxrl_llm_envs_verifiers_sums"
  assert sys.modules["jaxrl_llm_envs_verifiers_sums"] is verifiers_sums


def test_shipped_config_trains_two_steps(tmp_path):
  """configs/verifiers_tiny.py from the CLI (its own process): 8 episodes a step, none failed, the taskset's rewards
  in the rows, μ equal to the learner's scores of the served tokens."""
  wd = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl_llm", f"--config={os.path.join(ROOT, 'configs', 'verifiers_tiny.py')}",
         f"--workdir={wd}", "--config.log.tensorboard=False", "--config.checkpoint.every=0",
         "--config.sft.steps=0"]  # the warm start shapes rewards only; none of the checks below needs it
  p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                     timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "Exception ignored" not in p.stderr  # the runner's servers and loop closed before the interpreter's exit
  rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1]
  for r in rows:
    assert r["serve_episodes"] == 8 and r["serve_failed"] == 0 and r["serve_split"] == 0
    assert r["mismatch_abs_max"] < 1e-5 and np.isfinite(r["loss"])
  timeline = [json.loads(line) for line in (wd / "timeline.jsonl").read_text().splitlines()]
  rewards = [e["reward"] for e in timeline]
  assert len(rewards) == 16 and all(r == 1.0 or 0 <= r <= 0.5 for r in rewards)  # the taskset's score range
  assert np.mean(rewards) == pytest.approx(np.mean([r["reward_mean"] for r in rows]), abs=1e-6)
