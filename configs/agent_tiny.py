"""Tiny multi-turn agent: the tiny model plays guess-the-number (`jaxrl_llm.envs.guess_number`) with PPO-clip.

A delta over configs/tiny.py: every episode is up to 4 turns of at most 3 policy tokens, each answered
by "<", ">" or "=" (the environment's tokens are context: no loss); the return is 1 when the secret
digit is guessed. No SFT warm start and no evaluation: configs/agent_sft_tiny.py adds both (SFT on scripted
demonstration episodes, held-out greedy episodes). Runs in every source: sync, fixed_lag, staged, replay and async
(`--config.rollout.mode=async --config.rollout.lag=2`: later turns use the newest parameters, recorded per token).

Run:  python -m jaxrl_llm --config=configs/agent_tiny.py --workdir=/tmp/agent_tiny
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("tiny.py"))
  c.env = ml_collections.ConfigDict()
  # A registered environment (jaxrl_llm.envs), an installed package's entry point (group "jaxrl_llm.envs") or
  # "package.module:factory" (any importable module; docs/agents.md); "" = single-turn.
  c.env.name = "guess_number"  # the environment: a registered name, an entry point or "module:factory"; "" = off
  c.env.kwargs = ml_collections.ConfigDict({"max_turns": 4})  # the environment's own arguments
  c.env.max_turns = 4  # turns the runner plays at most
  c.env.turn_tokens = 3  # policy tokens per turn at most (stop id included)
  c.env.max_episode_tokens = 16  # response budget N of an episode (policy + environment tokens)
  c.env.timeout_s = 5.0  # per environment call; an overrun ends the episode with return 0, counted
  c.env.prompt_width = 8  # P: the first message's bucket ("guess:" + BOS)
  c.env.newest_each_turn = True  # async: turns after the first generate from the newest published parameters
  c.env.kv_cache = True  # keep each episode's KV cache across turns (with slots: in its slot; False: re-prefill)
  c.env.evict = "none"  # context compression before a turn: "none" | "drop_oldest" | "summary" (rollout.evict)
  c.env.context_budget = 0  # live-context tokens above which a turn first evicts (>= 1 with env.evict)
  c.env.keep_last_turns = 1  # turns a "drop_oldest" eviction always keeps
  c.sft.steps = 0
  c.eval.every = 0
  c.loss.name = "ppo_clip"
  return c
