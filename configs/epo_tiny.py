"""EPO on the tiny multi-turn agent: configs/agent_tiny.py with `loss.name="epo"` (entropy smoothed per turn).

EPO reads each token's turn (`turn_BN`, filled by the episodes) and keeps a per-turn entropy history.

Run:  python -m jaxrl_llm --config=configs/epo_tiny.py --workdir=/tmp/epo_tiny
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("agent_tiny.py"))
  c.loss.name = "epo"
  return c
