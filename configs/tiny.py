"""Smallest end-to-end run (well under a minute on 2 cores); used by the tests and the CLI contract check.

It must learn from its first step, or the equality tests built on it (resume, determinism, sharding,
replay) would compare runs whose parameters never move: partial-credit rewards (arithmetic
`partial_credit`: a wrong answer earns up to 0.5 for the digits in place) after a 150-step SFT warm
start give varied rewards in every group, so every step has a non-zero policy gradient.

Run:  python -m jaxrl_llm --config=configs/tiny.py --workdir=/tmp/tiny
"""

import pathlib

from jaxrl_llm.config import load_file


def _base():
  return load_file(pathlib.Path(__file__).with_name("default.py"))


def get_config():
  c = _base()
  c.num_steps = 6
  c.task.kwargs.partial_credit = True
  c.model.d_model = 32
  c.model.n_heads = 2
  c.model.n_kv_heads = 1
  c.model.head_dim = 16
  c.model.d_ff = 64
  c.model.n_layers = 1
  c.sampler.max_new_tokens = 4
  c.rollout.prompts_per_step = 4
  c.rollout.group_size = 4
  c.sft.steps = 150
  c.sft.batch_size = 16
  c.eval.every = 3
  c.eval.num_prompts = 16
  c.log.progress = False
  return c
