"""Tiny mixture-of-experts run with routing replay (R3): the MoE delta over configs/tiny.py.

Run:  python -m jaxrl_llm --config=configs/moe_tiny.py --workdir=/tmp/moe_tiny
Every layer's MLP is 4 SwiGLU experts, top-2 routing, dropless; the sampler records the expert ids of
every token and the learner replays them (old and current log-prob forwards). For the routing part of a
real train/inference mismatch add --config.sampler.dtype=bfloat16 (and compare with
--config.model.routing_replay=False).
"""

import pathlib

from jaxrl_llm.config import load_file


def _base():
  return load_file(pathlib.Path(__file__).with_name("tiny.py"))


def get_config():
  c = _base()
  c.model.num_experts = 4
  c.model.experts_per_token = 2
  return c
