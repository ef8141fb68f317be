"""Environments from outside the package (issue 48): `env.name="module:factory"` for any importable module, and the
entry points of an installed distribution (group `jaxrl_llm.envs`), in-process and through the CLI in sync and async.
The environment is the worked example of docs/agents.md."""

import os
import subprocess
import sys

import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import envs
from jaxrl_llm.config import load_file
from jaxrl_llm.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COUNTDOWN = '''
class Countdown:
  def __init__(self, max_turns: int = 3):
    self.max_turns = max_turns

  def reset(self, seed):
    self.left = self.max_turns
    return f"from {seed % 10}"  # configs/agent_tiny.py's character model reads 8 tokens (env.prompt_width)

  def step(self, action):
    self.left -= 1
    return "next", float(any(ch.isdigit() for ch in action)), self.left == 0
'''


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
  """A folder with a plain module (`countdown_env`) and a tiny installed distribution (`countdown_pkg`: its package
  and the dist-info pip would leave, naming the entry point `countdown_ep`)."""
  d = tmp_path_factory.mktemp("plugins")
  (d / "countdown_env.py").write_text(COUNTDOWN)
  (d / "countdown_pkg").mkdir()
  (d / "countdown_pkg" / "__init__.py").write_text(COUNTDOWN)
  info = d / "countdown_pkg-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: countdown-pkg\nVersion: 0.1\n")
  (info / "entry_points.txt").write_text(f"[{envs.ENTRY_POINT_GROUP}]\ncountdown_ep = countdown_pkg:Countdown\n")
  return d


def test_module_factories_and_entry_points_resolve_and_errors_name_what_is_missing(plugins, monkeypatch):
  monkeypatch.syspath_prepend(str(plugins))
  env = envs.get("countdown_env:Countdown", max_turns=2)
  assert env.reset(13) == "from 3"
  assert env.step("3") == ("next", 1.0, False) and env.step("x") == ("next", 0.0, True)
  assert envs.kwarg_names("countdown_env:Countdown") == ["max_turns"]
  assert "countdown_ep" in envs.names() and "guess_number" in envs.names()
  ep = envs.get("countdown_ep", max_turns=1)
  assert type(ep).__module__ == "countdown_pkg" and ep.reset(0) == "from 0"
  with pytest.raises(ValueError, match="takes no argument 'turns'"):
    envs.get("countdown_env:Countdown", turns=2)
  with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
    envs.get("no_such_module:Env")
  with pytest.raises(ValueError, match="has no callable 'Nope'"):
    envs.get("countdown_env:Nope")
  with pytest.raises(ValueError, match=r"unknown environment 'nope'; valid names: .*countdown_ep"):
    envs.get("nope")
  c = load_file(os.path.join(ROOT, "configs", "agent_tiny.py"))
  c.env.name = "no_such_module:Env"
  with pytest.raises(config_lib.ConfigError, match=r"^config\.env\.name='no_such_module:Env': .*cannot import"):
    config_lib.validate(c)
  c.env.name, c.sft.steps = "countdown_env:Countdown", 0
  config_lib.validate(c)


@pytest.mark.slow
def test_the_cli_trains_an_outside_environment_in_sync_and_async(plugins, tmp_path):
  """No launcher and no import in a config: the module by `module:factory` (sync), the installed one by its entry
  point (async, played by rollout worker threads)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), ROOT, os.environ.get("PYTHONPATH", "")])}
  common = [sys.executable, "-m", "jaxrl_llm", "--config=configs/agent_tiny.py", "--config.num_steps=2",
            "--config.sft.steps=0", "--config.eval.every=0", "--config.log.tensorboard=False",
            "--config.env.kwargs.max_turns=2"]
  runs = {"sync": ["--config.env.name=countdown_env:Countdown"],
          "async": ["--config.env.name=countdown_ep", "--config.rollout.mode=async", "--config.rollout.lag=1"]}
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
    assert all(r["env_turns_mean"] <= 2 for r in rows), rows  # the module's own episode length, max_turns=2


def test_an_environment_defined_in_a_config_file_survives_a_second_load(tmp_path):
  """Issue 48: a config file that registers an environment is loaded twice when a bad flag is reported (by
  config_flags, then by the error path under another module name): the second load replaces the same definition
  instead of failing with "already registered"; another definition under a taken name is still refused."""
  import importlib.util
  cfg = tmp_path / "with_env.py"
  cfg.write_text("from jaxrl_llm import envs\n\n"
                 "@envs.register('test_config_defined_env')\n"
                 "class Defined:\n  def reset(self, seed):\n    return 'hi'\n\n  def step(self, action):\n"
                 "    return 'ok', 0.0, True\n\n"
                 "def get_config():\n  return None\n")
  for module_name in ("config_flags_like", "config_flags_like", "_jaxrl_config_with_env"):
    spec = importlib.util.spec_from_file_location(module_name, cfg)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
  assert envs.get("test_config_defined_env").reset(0) == "hi"
  with pytest.raises(ValueError, match="'test_config_defined_env' is already registered .*with_env.py"):
    envs.register("test_config_defined_env")(type("Defined", (), {"reset": lambda self, seed: "other"}))
