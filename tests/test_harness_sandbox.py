"""Sandboxed harnesses (issue 48, item 3; `serve.sandbox`): each episode's harness runs in a process of its own that
may reach the endpoint and nothing else. A good harness's episode is recorded as in a thread; one that dials another
address, spins or allocates is killed (`killed`), one that overruns the wall clock is a timeout whose process is gone,
one that raises is an error. Config: the fields are validated, and a harness that is not module-level is refused."""

import os
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from test_serve import chat_tok, harness_config, stub_service  # noqa: E402,F401  (chat_tok: a fixture)

from jaxrl_llm import config as config_lib  # noqa: E402
from jaxrl_llm.config import ConfigError  # noqa: E402
from jaxrl_llm.envs.sandbox import Limits  # noqa: E402
from jaxrl_llm.rollout.sources import harness as harness_source  # noqa: E402

HARNESSES = '''
import os, socket, time

import httpx


def good(base_url, episode_id, seed, reward):  # the official client (it asks `platform` for `uname -p`: cached first)
  import openai
  client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120,
                         default_headers={"X-Episode-Id": episode_id})
  client.completions.create(model="jaxrl-policy", prompt=[5, 6, seed], max_tokens=4)
  httpx.post(f"{base_url}/v1/episodes/{episode_id}/reward", json={"reward": reward}, timeout=120).raise_for_status()


def dial(base_url, episode_id, seed):
  socket.create_connection(("127.0.0.1", 9), timeout=5)


def spin(base_url, episode_id, seed):
  while True:
    pass


def hog(base_url, episode_id, seed):
  a = []
  while True:
    a.append(bytearray(10**7))


def nap(base_url, episode_id, seed):
  with open(os.path.join(os.environ["NAP_DIR"], str(os.getpid())), "w"):
    pass
  time.sleep(600)


def boom(base_url, episode_id, seed):
  raise ValueError("boom")


def dispatch(base_url, episode_id, seed, reward):  # `reward`: serve.harness_kwargs reach the sandboxed process
  name = episode_id.split("-")[0]
  globals()[name](base_url, episode_id, seed, *([reward] if name == "good" else []))
'''


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
  d = tmp_path_factory.mktemp("harnesses")
  (d / "sandboxed_harnesses.py").write_text(HARNESSES)
  sys.path.insert(0, str(d))
  try:
    import sandboxed_harnesses
    yield sandboxed_harnesses
  finally:
    sys.path.remove(str(d))


def test_each_episode_runs_in_its_own_limited_process(chat_tok, harnesses, tmp_path, monkeypatch):  # noqa: F811
  monkeypatch.setenv("NAP_DIR", str(tmp_path))
  service, sampler = stub_service(chat_tok, script=[[7, 8]], auto_open=False)
  try:
    ids = ["good-0", "dial-1", "spin-2", "hog-3", "nap-4", "boom-5"]
    for e in ids:
      service.recorder.open(e)
    limits = Limits(cpu_s=2, memory_mb=64, wall_s=20)
    status = harness_source.play(harnesses.dispatch, service.base_url, ids, seed=3, timeout_s=20, sandbox=limits,
                                 kwargs={"reward": 0.75})
    episodes = [service.recorder.pop(e) for e in ids]
  finally:
    service.close()
  assert status == [None, "killed", "killed", "killed", "timeouts", "errors"]
  good = episodes[0]
  assert good.reward == 0.75 and [c.prompt_ids for c in good.calls] == [[5, 6, 3]] and sampler.calls == 1
  assert all(not ep.calls for ep in episodes[1:])
  pids = [int(p) for p in os.listdir(tmp_path)]
  assert len(pids) == 1
  with pytest.raises(ProcessLookupError):  # the overrunning harness's process was killed, not left behind
    os.kill(pids[0], 0)


def test_sandbox_fields_are_validated_and_an_inner_harness_is_refused(harnesses):
  for field, value in (("sandbox_cpu_s", 0), ("sandbox_memory_mb", -1)):
    c = harness_config(sandbox=True)
    c.serve[field] = value
    with pytest.raises(ConfigError, match=f"config.serve.{field}="):
      config_lib.validate(c)
  config_lib.validate(harness_config(sandbox=True, sandbox_cpu_s=5.0, sandbox_memory_mb=256))
  from jaxrl_llm import wiring
  s = wiring.serve_settings(harness_config(sandbox=True, sandbox_cpu_s=5.0, sandbox_memory_mb=256, timeout_s=9.0))
  assert s.sandbox == Limits(cpu_s=5.0, memory_mb=256, wall_s=9.0)
  assert wiring.serve_settings(harness_config()).sandbox is None
  import types
  inner = harness_config(sandbox=True)
  inner.serve.harness = "test_harness_sandbox:INNER"
  ctx = types.SimpleNamespace(settings=types.SimpleNamespace(serve=wiring.serve_settings(inner)))
  with pytest.raises(ConfigError, match="serve.sandbox=True: tool 'inner' cannot be sandboxed"):
    harness_source.Harness(ctx, store=None)


def _inner():
  def inner(base_url, episode_id, seed):
    del base_url, episode_id, seed
  return inner


INNER = _inner()
