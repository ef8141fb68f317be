"""OpenEnv environments (issue 48): an OpenEnv `Environment` defined here plays through `envs.openenv_env` in-process
and over HTTP from OpenEnv's own server with the same transcript, its Action's validation is an invalid action, and
the CLI trains it 2 steps with tokens exact (sync over HTTP: μ equals the learner's recomputed scores) and in async
(in-process). `jaxrl_llm.envs.openenv_bridge` (this project's environments served as OpenEnv ones) runs both ways."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("openenv.core.env_server")

from jaxrl_llm import envs  # noqa: E402
from jaxrl_llm.metrics import read_jsonl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ECHO = '''
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class Say(Action):
  message: str = Field(max_length=6)


class Heard(Observation):
  prompt: str = ""


class Echo(Environment[Say, Heard, State]):
  """Say the seed's last digit within 2 turns (reward 1)."""
  SUPPORTS_CONCURRENT_SESSIONS = True

  def __init__(self):
    super().__init__()
    self._state, self.target = State(step_count=0), "0"

  def reset(self, seed=None, episode_id=None, **kwargs):
    self._state, self.target = State(step_count=0), str((seed or 0) % 10)
    return Heard(prompt=f"say {self.target}", done=False, reward=0.0)

  def step(self, action, timeout_s=None, **kwargs):
    self._state.step_count += 1
    hit = self.target in action.message
    return Heard(prompt="again", done=hit or self._state.step_count >= 2, reward=float(hit))

  @property
  def state(self):
    return self._state


class Untyped(Environment):
  """Echo without type parameters or annotations: its Action must be named."""
  def __init__(self):
    super().__init__()
    self.inner = Echo()

  def reset(self, seed=None, episode_id=None, **kwargs):
    return self.inner.reset(seed)

  def step(self, action, timeout_s=None, **kwargs):
    return self.inner.step(action)

  @property
  def state(self):
    return self.inner.state


class Annotated(Untyped):
  def step(self, action: Say, timeout_s=None, **kwargs):
    return self.inner.step(action)
'''


def _serve(app):
  """`app` on a free localhost port in a daemon thread (the socket is bound before the thread starts); its URL."""
  import uvicorn
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
  threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
  while not server.started:  # startup, not a timing assumption: the loop waits as long as it takes
    time.sleep(0.05)
  return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
  """(the folder holding module `openenv_echo`, the URL of an OpenEnv server playing its Echo)."""
  d = tmp_path_factory.mktemp("openenv")
  (d / "openenv_echo.py").write_text(ECHO)
  sys.path.insert(0, str(d))
  try:
    import openenv_echo
    from openenv.core.env_server import create_fastapi_app
    yield d, _serve(create_fastapi_app(openenv_echo.Echo, openenv_echo.Say, openenv_echo.Heard,
                                       max_concurrent_envs=64))
  finally:
    sys.path.remove(str(d))


def _play(env, seed, actions):
  return [env.reset(seed), *[env.step(a) for a in actions]]


def test_in_process_and_over_http_play_the_same_episode_and_validation_is_an_invalid_action(echo):
  _, url = echo
  local = envs.get("openenv", environment="openenv_echo:Echo")
  remote = envs.get("openenv", base_url=url, action_field="message")
  assert local.action_field == "message"  # the Action's one required str field
  for seed, actions in [(13, ["x", "3"]), (4, ["4"]), (7, ["a", "b"])]:
    want = [f"say {seed % 10}", *[("again", float(a == str(seed % 10)), a == str(seed % 10) or i == 1)
                                  for i, a in enumerate(actions)]]
    assert _play(local, seed, actions) == want
    assert _play(remote, seed, actions) == want
  for env in (local, remote):
    env.reset(1)
    with pytest.raises(envs.InvalidAction):
      env.step("longer than six")  # Say.message has max_length=6
    assert _play(env, 2, ["2"])[1] == ("again", 1.0, True)  # the session survives an invalid action
  local.close()
  remote.close()


def test_the_action_class_is_read_from_the_step_annotation_or_named_and_errors_say_what_to_set(echo):
  with pytest.raises(ValueError, match="cannot tell the Action class of Untyped.*action="):
    envs.get("openenv", environment="openenv_echo:Untyped")
  named = envs.get("openenv", environment="openenv_echo:Untyped", action="openenv_echo:Say")
  annotated = envs.get("openenv", environment="openenv_echo:Annotated")
  for env in (named, annotated):
    assert _play(env, 5, ["5"]) == ["say 5", ("again", 1.0, True)]
  with pytest.raises(ValueError, match="exactly one of environment="):
    envs.get("openenv")
  with pytest.raises(ValueError, match="name the action field"):
    envs.get("openenv", base_url="http://127.0.0.1:9")
  with pytest.raises(ValueError, match="observation_field='text': the observation has prompt"):
    envs.get("openenv", environment="openenv_echo:Echo", observation_field="text").reset(0)
  with pytest.raises(ValueError, match="has no 'Nope'"):
    envs.get("openenv", environment="openenv_echo:Nope")


def test_the_bridge_serves_a_jaxrl_environment_as_an_openenv_one_both_ways():
  from jaxrl_llm.envs import openenv_bridge
  seed = 3
  direct = envs.get("guess_number", max_turns=4)
  want = [direct.reset(seed), *[direct.step(a) for a in "0918"]]
  local = envs.get("openenv", environment="jaxrl_llm.envs.openenv_bridge:guess_number")
  remote = envs.get("openenv", base_url=_serve(openenv_bridge.guess_number_app()), action_field="text")
  n = next(i for i, (_, _, done) in enumerate(want[1:]) if done) + 1  # the bridge's episode ends where direct's does
  assert _play(local, seed, "0918"[:n]) == want[:n + 1]
  assert _play(remote, seed, "0918"[:n]) == want[:n + 1]
  local.reset(0)
  assert local.step("no digit") == ("", 0.0, True)  # the wrapped InvalidAction ends the episode (docstring)
  remote.close()


@pytest.mark.slow
def test_the_cli_trains_an_openenv_environment_over_http_and_in_process(echo, tmp_path):
  d, url = echo
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d), ROOT, os.environ.get("PYTHONPATH", "")])}
  common = [sys.executable, "-m", "jaxrl_llm", "--config=configs/agent_openenv_tiny.py", "--config.num_steps=2",
            "--config.log.tensorboard=False"]
  runs = {"http_sync": ["--config.env.kwargs.environment=", f"--config.env.kwargs.base_url={url}",
                        "--config.env.kwargs.action_field=message"],
          "local_async": ["--config.env.kwargs.environment=openenv_echo:Echo", "--config.rollout.mode=async",
                          "--config.rollout.lag=1"]}
  procs = {m: subprocess.Popen([*common, f"--workdir={tmp_path / m}", *flags], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for m, flags in runs.items()}
  for m, p in procs.items():
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    rows = read_jsonl(str(tmp_path / m / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1], out[-2000:]
    assert all(r["env_policy_tokens"] > 0 and r["env_errors"] + r["env_timeouts"] + r["env_too_long"] == 0
               for r in rows), rows
    assert all(1 <= r["env_turns_mean"] <= 2 for r in rows), rows  # Echo's own 2-turn limit
  sync = read_jsonl(str(tmp_path / "http_sync" / "metrics.jsonl"))
  assert all(r["mismatch_abs_max"] < 1e-5 for r in sync), sync  # μ = the learner's scores of the same tokens
