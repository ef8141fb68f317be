"""Tiny agent on a real game: the tiny model plays textarena's GuessTheNumber-v0 (`jaxrl_llm.envs.textarena_env`).

A delta over configs/agent_tiny.py. Needs the `envs` extra (`pip install -e '.[envs]'`). The character
tokenizer has no upper case, newline or brackets (they encode to unk), so the observations are kept
short with `observation="last_line"`: the first message is "Enter your guess." and a turn's answer is
textarena's one-line hint ("[GAME] The target number is lower.", 34 characters) or its invalid-move
notice (~210 characters). A policy action without brackets is put in brackets by textarena ("7" ->
"[7]"), so digits are a valid move. Return: 1 for a win, else GuessTheNumber's partial reward
(1 - distance of the last guess / 19), 0 after two invalid moves in a row. An untrained character
model mostly writes non-numbers, so most early episodes end at the second invalid move with return 0
(or "truncated", when the notices overrun the token budget): this config shows the plumbing, not
learning. A real tokenizer (configs/smollm2_*.py) would use observation="new" and a wider
prompt_width (the full first message is ~500 characters).

Run:  python -m jaxrl_llm --config=configs/agent_textarena_tiny.py --workdir=/tmp/ta_tiny
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("agent_tiny.py"))
  c.env.name = "textarena"
  c.env.kwargs = ml_collections.ConfigDict({"env_id": "GuessTheNumber-v0", "observation": "last_line"})
  c.env.max_turns = 4  # runner turns (the game itself allows 10 guesses)
  c.env.turn_tokens = 3  # a guess of 1..20 and the stop id
  c.env.max_episode_tokens = 256  # room for one invalid-move notice and a few hints
  c.env.prompt_width = 24  # "Enter your guess." + BOS
  return c
