"""Pats on the tiny model: evidence cards from rollout groups scaffold later rollouts of a recurring prompt
(one-digit multiplication: 100 prompts, 20 held out, so a prompt recurs every ~20 steps of 4 prompts); cards are
retired once bare rows score as well, and evaluation never shows one (jaxrl_llm/rollout/scaffold.py).

Run:  python -m jaxrl_llm --config=configs/pats_tiny.py --workdir=/tmp/pats_tiny
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("tiny.py"))
  c.task.kwargs.num_digits = 1
  c.task.kwargs.ops = "*"
  c.task.held_out = 20  # of the 100 one-digit products: the other 80 recur in training
  c.rollout.pats.on = True
  return c
