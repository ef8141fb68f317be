"""Tiny multi-turn agent after an SFT warm start on demonstrations: the setting where RL raises held-out
episode success (`experiments/agent_staleness.py`).

A delta over configs/agent_tiny.py: the warm start trains on `sft.demos` scripted guess-the-number episodes of
the consistent-but-not-optimal player (`jaxrl_llm.envs.demos`: each guess uniformly random among the digits
the feedback still allows; it wins about 77% of episodes within 4 turns, binary search wins all), laid out as
the runner lays out an episode; the held-out evaluation plays `eval.num_prompts` greedy episodes on seeds
no training episode uses (`jaxrl_llm.episode_eval`), reported as `eval_episode_success` (= `eval_accuracy`).

Run:  python -m jaxrl_llm --config=configs/agent_sft_tiny.py --workdir=/tmp/agent_sft_tiny
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("agent_tiny.py"))
  c.num_steps = 60
  # Two layers of 64: one layer of 32 (configs/tiny.py) imitates the demos' format but not their play.
  c.model.n_layers = 2
  c.model.d_model = 64
  c.model.n_heads = 2
  c.model.head_dim = 32
  c.model.d_ff = 128
  c.sft.steps = 300
  c.sft.batch_size = 16
  c.sft.lr = 3e-3
  c.sft.demos = 64
  c.sft.demo_player = "consistent"
  c.eval.every = 10
  c.eval.num_prompts = 64
  c.rollout.prompts_per_step = 8
  c.rollout.group_size = 8
  c.optim.lr = 1e-3
  c.loss.name = "ppo_clip"
  c.loss.agg_mode = "seq-mean-token-mean"  # GRPO (experiments.methods: "grpo")
  return c
