"""PPO-EWMA (Hilton et al. 2021) on the smallest end-to-end run (configs/tiny.py): decoupled PPO whose proximal
policy is an EWMA of past weights (`rollout.old_logp="ewma"`, decay `rollout.ewma_beta`), on rollouts 2 versions
stale (fixed lag 2), where the behaviour policy μ, the proximal π_EWMA and the learner's π_θ all differ.

Run:  python -m jaxrl_llm --config=configs/ppo_ewma_tiny.py --workdir=/tmp/ppo_ewma
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("tiny.py"))
  c.loss.name = "ppo_ewma"
  c.rollout.old_logp = "ewma"
  c.rollout.ewma_beta = 0.9
  c.rollout.mode = "fixed_lag"
  c.rollout.lag = 2
  return c
