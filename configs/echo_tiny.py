"""ECHO on the tiny arithmetic task: per task one attempt, G critic diagnoses of it and G refinements, trained by
dual-track GRPO (the diagnoses on their refinement's shaped gain, the refinements on their reward); the critic is the
policy's own weights in the critic role (jaxrl_llm/rollout/cascade.py).

Run:  python -m jaxrl_llm --config=configs/echo_tiny.py --workdir=/tmp/echo_tiny
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("tiny.py"))
  c.rollout.echo.on = True  # 4 prompts per step = 2 tasks, each a critic group and a policy group of 4
  return c
