"""Config validation names the bad field; the CLI rejects unknown fields with their name."""

import os
import subprocess
import sys

import pytest

from jaxrl_llm import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name="tiny"):
  return config_lib.load_file(os.path.join(ROOT, "configs", f"{name}.py"))


def test_default_and_tiny_are_valid():
  config_lib.validate(load("default"))
  config_lib.validate(load("tiny"))


@pytest.mark.parametrize("field,value,needle", [
    ("rollout.mode", "bogus", "config.rollout.mode='bogus'"),
    ("rollout.lag", -1, "config.rollout.lag=-1"),
    ("model.n_kv_heads", 3, "config.model.n_kv_heads=3"),
    ("sampler.temperature", 0.0, "config.sampler.temperature=0.0"),
    ("sampler.top_p", 1.5, "config.sampler.top_p=1.5"),
    ("loss.agg_mode", "mean", "config.loss.agg_mode='mean'"),
    ("task.name", "chess", "config.task.name='chess'"),
    ("optim.lr", 0.0, "config.optim.lr=0.0"),
    ("advantage.name", "gae", "config.advantage.name='gae'"),
    ("loss.name", "nope", "unknown loss"),
])
def test_bad_values_name_the_field(field, value, needle):
  c = load()
  section, key = field.split(".")
  c[section][key] = value
  with pytest.raises(config_lib.ConfigError, match=None) as e:
    config_lib.validate(c)
  assert needle in str(e.value)
  assert field.split(".")[-1] in str(e.value)


def test_unknown_loss_lists_valid_names():
  c = load()
  c.loss.name = "nope"
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert "ppo_clip" in str(e.value) and "pg" in str(e.value)


def test_unknown_loss_hparam_names_field():
  c = load()
  c.loss.hparams = {"eps_bogus": 0.1}
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert "loss.hparams.eps_bogus" in str(e.value)


def test_staged_requires_stage_length():
  c = load()
  c.rollout.mode, c.rollout.lag = "staged", 0
  with pytest.raises(config_lib.ConfigError, match="rollout.lag"):
    config_lib.validate(c)


def test_cli_rejects_unknown_field_and_bad_value(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  base = [sys.executable, "-m", "jaxrl_llm", "--config=configs/tiny.py", f"--workdir={tmp_path}"]
  r = subprocess.run(base + ["--config.no_such_field=1"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert r.returncode != 0 and "no_such_field" in (r.stdout + r.stderr)
  r = subprocess.run(base + ["--config.rollout.mode=bogus"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert r.returncode == 2 and "config.rollout.mode='bogus'" in r.stderr


def test_import_has_no_side_effects():
  code = ("import logging, jax, jaxrl_llm, jaxrl_llm.losses, jaxrl_llm.models, jaxrl_llm.tasks, jaxrl_llm.sampling;"
          "from jax._src import xla_bridge as xb;"
          "assert not xb._backends, 'devices initialised at import';"
          "assert not logging.getLogger().handlers, 'logging configured at import';"
          "print('ok')")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr


def test_unmet_loss_needs_fail_at_startup():
  c = load()
  c.loss.name = "opd_forward_kl"  # needs teacher/student logits, which the RL loop does not compute
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  msg = str(e.value)
  assert "config.loss.name='opd_forward_kl'" in msg and "student_logits" in msg and "does not provide" in msg


def test_every_rl_loss_is_runnable_by_the_loop():
  from jaxrl_llm import losses
  rl = [n for n in losses.names() if not losses.missing_needs(losses.get(n), config_lib.available_needs(load()))]
  for name in ("pg", "ppo_clip", "gspo", "cispo", "tis", "mis", "icepop", "minirl", "decoupled_ppo", "a3po",
               "vespo", "m2po", "sat", "sat_gspo", "dppo", "drpo", "mu_grpo", "delightful_pg", "r2vpo",
               "hispo", "alp"):
    assert name in rl
  # PPO-EWMA anchors to the EWMA copy of the weights: only a run that keeps one provides its π_prox
  assert "ppo_ewma" not in rl
  c = load()
  c.loss.name = "ppo_ewma"
  with pytest.raises(config_lib.ConfigError, match=r"needs \['ewma_prox'\].*rollout\.old_logp='ewma'"):
    config_lib.validate(c)
  c.rollout.old_logp = "ewma"
  config_lib.validate(c)


@pytest.mark.parametrize("field,value,needle", [
    ("model.experts_per_token", 9, "config.model.experts_per_token=9"),
    ("optim.grad_accum", 5, "config.optim.grad_accum=5"),
    ("mesh.fsdp", 0, "config.mesh.fsdp=0"),
    ("sampler.quantize", "int4", "config.sampler.quantize='int4'"),
    ("sampler.behavior_topk", -1, "config.sampler.behavior_topk=-1"),
    ("sampler.mc_samples", -3, "config.sampler.mc_samples=-3"),
])
def test_scale_and_sampler_fields_name_the_field(field, value, needle):
  c = load()
  c.model.num_experts = 4
  section, key = field.split(".")
  c[section][key] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert needle in str(e.value)


def test_grad_accum_refused_for_stateful_loss():
  c = load()
  c.loss.name, c.optim.grad_accum = "r2vpo", 2
  with pytest.raises(config_lib.ConfigError, match="config.optim.grad_accum=2"):
    config_lib.validate(c)


def test_mesh_size_must_match_the_devices():
  c = load("tiny")
  c.mesh.fsdp = 4  # this test process sees one CPU device
  with pytest.raises(config_lib.ConfigError, match="multiply to 4 but 1 devices"):
    config_lib.validate(c)


@pytest.mark.parametrize("field,value,why", [
    ("n_kv_heads", 3, "must divide model.n_heads=4"), ("head_dim", 7, "must be even"), ("d_ff", 0, "positive int"),
    ("dtype", "float8", "must be one of"), ("capacity_factor", -1.0, "must be >= 0"),
])
def test_model_fields_have_one_rule_for_the_config_and_the_model(field, value, why):
  """`config.model.*` and `ModelConfig` apply the same rule (`jaxrl_llm.model_fields`), each naming the field."""
  import dataclasses
  from jaxrl_llm.models import ModelConfig
  c = load("tiny")
  c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 4, 2, 8
  c.model[field] = value
  with pytest.raises(config_lib.ConfigError, match=f"config.model.{field}=.*{why}"):
    config_lib.validate(c)
  good = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
  with pytest.raises(ValueError, match=f"model.{field}=.*{why}"):
    dataclasses.replace(good, **{field: value})
