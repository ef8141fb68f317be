"""SDCC (MemoryWalker) on the tiny agent: episodes whose context is compressed, trained with self-distillation.

A delta over configs/agent_tiny.py (the tiny model plays guess-the-number): before a turn, an episode whose live
context is longer than `env.context_budget` tokens drops its oldest turns (`env.evict="drop_oldest"`,
`rollout.evict`), keeping the last one. Each policy token is trained under the context it was sampled with (the
record packs every live context as its own segment), and at the first turn after each eviction `loss.name=sdcc`
adds λ·KL(sg π(·|uncompressed context) ‖ π_θ(·|compressed context)) to the PPO-clip task term.

Run:  python -m jaxrl_llm --config=configs/sdcc_tiny.py --workdir=/tmp/sdcc_tiny
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("agent_tiny.py"))
  c.env.kwargs.max_turns = 6
  c.env.max_turns = 6
  c.env.max_episode_tokens = 40  # the row holds the copied contexts too
  c.env.evict = "drop_oldest"
  c.env.context_budget = 8  # "guess:" + BOS is 7 tokens: a second turn already triggers an eviction
  c.env.keep_last_turns = 1
  c.loss.name = "sdcc"
  c.loss.hparams.kl_coef = 0.5
  return c
