"""Tiny agent on reasoning-gym: the tiny model answers reasoning-gym's basic_arithmetic, scored by its own verifier
(`jaxrl_llm.envs.reasoning_gym_env`; a single-turn environment, so one turn per episode).

A delta over configs/agent_tiny.py. Needs the `envs` extra (`pip install -e '.[envs]'`). The dataset is configured
for the character model to read: two one-digit terms, "+" only, no parentheses or negation ("Calculate 4 + 1.",
at most 18 characters; the capital C is the tokenizer's unk), answers 0-18 written bare (the environment scores
the whole action when it has no <answer> tags). Any of reasoning-gym's ~100 tasks plays the same way
(`--config.env.kwargs.task=chain_sum`, its own `config` fields); a real tokenizer reads them all (configs/smollm2_*.py
with `env.name="reasoning_gym"` and a wider `env.prompt_width`).

Run:  python -m jaxrl_llm --config=configs/agent_reasoning_gym_tiny.py --workdir=/tmp/rg_tiny
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("agent_tiny.py"))
  c.env.name = "reasoning_gym"
  c.env.kwargs = ml_collections.ConfigDict({
      "task": "basic_arithmetic", "size": 1000, "dataset_seed": 0,
      "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                 "allow_parentheses": False, "allow_negation": False, "whitespace": "single"}})
  c.env.max_turns = 1  # reasoning-gym tasks are single-turn
  c.env.turn_tokens = 3  # up to two digits and the stop id
  c.env.max_episode_tokens = 4
  c.env.prompt_width = 24  # "Calculate 9 + 9." + BOS
  return c
