"""ADWIN adaptive prefix horizons on the tiny OPD run: the loss trains on the first H response tokens of each rollout.

Run:  python -m jaxrl_llm --config=configs/opd_adwin_tiny.py --workdir=/tmp/opd_adwin_tiny

A delta over configs/opd_tiny.py (opd_reverse_kl, the SFT teacher) with `distill.adwin` on (fields and
defaults: jaxrl_llm/distill/extras.py). Rollouts stop at the horizon: the sampler generates H's power-of-two
bucket of new tokens (`generation.TokenBudget`, metric gen_max_new_tokens), full length (sampler.max_new_tokens = 4
here, so H lives in [1, 4]) on probe steps only; the learner batch keeps the first H counted tokens of each row
(`adwin.prefix_mask`). Every `probe_period` steps the step's own batch is the probe: the share of the
teacher signal |log p(y_t) − log μ(y_t)| inside the first H tokens (`adwin.kl_mass_alignment`) is the
agreement; ≥ tau shrinks H by gamma_down, else it grows by gamma_up; a probe more than `max_probe_age`
versions old changes nothing. Metrics: adwin_horizon (the H the step trained on), adwin_kept_frac,
adwin_agreement and adwin_probe_age on probe steps.

[GUESS]: the whole rule (only the ADWIN abstract, arXiv 2605.28396, is public: see distill/adwin.py), the
agreement proxy (the paper's cosine of prefix and full update directions needs a second backward and is
not wired), and these tiny-scale horizons and factors.
Carried state (horizon, last probe step, step count) is `DistillExtras.state()`; a resumed run keeps it
only if the loop checkpoints it.
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("opd_tiny.py"))
  c.distill.adwin = ml_collections.ConfigDict({
      "enabled": True,  # train on the first H counted response tokens of each row
      "h_init": 3,  # initial horizon H in tokens (here of sampler.max_new_tokens = 4)
      "h_min": 1,  # lower bound of H
      "h_max": 4,  # upper bound of H
      "gamma_down": 0.8,  # H <- H * gamma_down when a probe agrees (>= tau)
      "gamma_up": 1.5,  # H <- H * gamma_up when it does not
      "tau": 0.8,  # agreement threshold (share of the teacher signal inside the first H tokens)
      "probe_period": 2,  # learner steps between probes (here steps 0, 2, 4, ...)
      "max_probe_age": 4,  # a probe whose rows are more versions old than this changes nothing
      "anchor_threshold": 0.0,  # off; > 0 also cuts a row at its first token with log μ − log p above it
  })
  return c
