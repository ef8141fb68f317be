"""AsyncOPD's Monte-Carlo reverse-KL estimator (`opd_reverse_kl_mc`) on the tiny OPD setup.

Run:  python -m jaxrl_llm --config=configs/opd_mc_tiny.py --workdir=/tmp/opd_mc

A delta over configs/opd_tiny.py: `sampler.mc_samples` = J makes the sampler record J candidates per
response position (column 0 the sampled token, columns 1..J-1 drawn i.i.d. from μ with replacement)
and log μ at them (`jaxrl_llm.sampling.behavior`); the teacher scores them when the batch is built
(`mc_teacher_logp_BNJ`, `jaxrl_llm.distill.opd`), and the learner gathers log π_θ at them in its
forward (`mc_logp_BNJ`). Hyper-parameters are the loss's defaults (async-opd's MC example: online
advantage, unclipped).
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("opd_tiny.py"))
  c.loss.name = "opd_reverse_kl_mc"
  c.sampler.mc_samples = 4
  return c
