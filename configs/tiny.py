"""Smallest end-to-end run (well under a minute on 2 cores); used by the tests and the CLI contract check.

Run:  python -m jaxrl_llm --config=configs/tiny.py --workdir=/tmp/tiny
"""

import importlib.util
import pathlib


def _base():
  # Loaded by path so the config works from any working directory (config_flags loads files by path).
  spec = importlib.util.spec_from_file_location("_jaxrl_default_config", pathlib.Path(__file__).with_name("default.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def get_config():
  c = _base()
  c.num_steps = 6
  c.model.d_model = 32
  c.model.n_heads = 2
  c.model.n_kv_heads = 1
  c.model.head_dim = 16
  c.model.d_ff = 64
  c.model.n_layers = 1
  c.sampler.max_new_tokens = 4
  c.rollout.prompts_per_step = 4
  c.rollout.group_size = 4
  c.sft.steps = 10
  c.sft.batch_size = 16
  c.eval.every = 3
  c.eval.num_prompts = 16
  c.log.progress = False
  return c
