"""On-policy distillation of a multi-turn agent: the tiny guess-the-number agent (configs/agent_tiny.py) learns from
a teacher that scores every token of its episodes in context (the environment's answers are context: no loss).

The "sft" teacher (2 layers of width 64) is trained once, and cached, on `sft.demos` demonstration episodes of the
binary-search player (`distill.teacher_demo_player="optimal"`, which always wins within 4 turns); the student
starts from its random init (no warm start). Works in every source: sync, fixed_lag, staged, replay and async.

Run:  python -m jaxrl_llm --config=configs/opd_agent_tiny.py --workdir=/tmp/opd_agent_tiny
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("agent_tiny.py"))
  opd = load_file(pathlib.Path(__file__).with_name("opd_tiny.py"))  # its loss, lr and 2-layer width-64 teacher
  c.loss, c.optim.lr, c.distill = opd.loss, opd.optim.lr, opd.distill
  c.distill.teacher_sft_steps = 300
  c.distill.teacher_demo_player = "optimal"
  return c
