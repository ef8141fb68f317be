"""Open-MOPD on the tiny OPD run: two teachers, each prompt routed to its domain's one, with M1 and M2 budgets.

Run:  python -m jaxrl_llm --config=configs/opd_mopd_tiny.py --workdir=/tmp/opd_mopd_tiny

A delta over configs/opd_tiny.py (fields and defaults: jaxrl_llm/distill/extras.py, the method:
jaxrl_llm/distill/mopd.py, arXiv 2608.19098):
  distill.teacher = "mopd" and distill.teachers lists two SFT teachers of different shape and seed
  (2 x 64 and 1 x 96); list index = domain.
  Domain of a prompt (M0 hard routing): the training example's `domain` when it has one, else
  `example_id % len(distill.teachers)`. The arithmetic task has no domain column, so here the domains
  are example_id % 2 (a labelled dataset overrides them with its own column).
  M1 token-share balancing (`mopd.token_share`) toward `mopd.target_share` and M2 gap-following
  (`mopd.gap_follow`, m_d = mean |r_t| over domain d's tokens, anchored at its first value) give each
  row a weight w_b (token-weighted mean 1) that multiplies its advantage. The OPD losses do not read the
  advantage, so this config trains `ppo_clip` on adv_BN = w_b · (log p_d(y_t) − log μ(y_t))
  (`mopd.reward_advantage`): with w = 1 that is exactly opd_reverse_kl's advantage form.
  M0 routing alone works with any OPD loss: --config.distill.mopd.token_share=False
  --config.distill.mopd.gap_follow=False --config.distill.mopd.reward_advantage=False
  --config.loss.name=opd_reverse_kl.
Metrics: mopd_token_share_{y}, mopd_weight_{y} (mean row weight of domain y), mopd_gap_factor_{y}.

[GUESS]: the order of M1 × M2 and the renormalisation (mopd.domain_loss_weights), the gap statistic and
its anchoring, the example_id % Y domains of a task without domains, and the 0.7 / 0.3 target shares.
M4 reward refresh: the loss `mopd_refresh` rebuilds r_t(v) from the current student at every inner update
with M0 routing (M1/M2's weights multiply an advantage, which it does not read): --config.loss.name=mopd_refresh
--config.distill.mopd.reward_advantage=False --config.distill.mopd.token_share=False
--config.distill.mopd.gap_follow=False.
Carried state (the M2 references) is `DistillExtras.state()`; a resumed run keeps it only if the loop
checkpoints it.
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("opd_tiny.py"))
  c.loss.name = "ppo_clip"  # with mopd.reward_advantage: the reverse-KL advantage form, weighted per domain
  c.distill.teacher = "mopd"
  c.distill.teachers = [  # teacher specs, one per domain (list index); fields: distill.extras.SPEC_FIELDS
      ml_collections.ConfigDict({"teacher": "sft", "teacher_d_model": 64, "teacher_n_layers": 2,
                                 "teacher_sft_steps": 150, "domain": "even"}),
      ml_collections.ConfigDict({"teacher": "sft", "teacher_d_model": 96, "teacher_n_layers": 1,
                                 "teacher_sft_steps": 150, "seed": 1, "domain": "odd"}),
  ]
  c.distill.mopd = ml_collections.ConfigDict({
      "token_share": True,  # M1: token-share balancing weights per domain
      "target_share": (0.7, 0.3),  # target token share per domain; () = uniform
      "gap_follow": True,  # M2: gap-following factors (multiply the M1 weights)
      "gap_stat": "mean",  # m_d: a statistic of |r_t| over domain d's tokens
      "gap_alpha": 1.0,  # the factor is clip((m_d / ref_d) ** gap_alpha, 0.05, 20)
      "gap_reference": "anchored",  # ref_d: the first m_d seen ("anchored") or an EMA of the earlier steps' ("ema")
      "gap_decay": 0.9,  # decay of that EMA
      "reward_advantage": True,  # train on adv = w_b · (log p_d − log μ), with an advantage loss (ppo_clip)
  })
  return c
