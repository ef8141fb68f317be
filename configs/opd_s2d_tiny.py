"""S²D-OPD (`s2d_opd`) on the tiny OPD setup: Direct-OPD rewards from a teacher and its pre-RL reference.

Run:  python -m jaxrl_llm --config=configs/opd_s2d_tiny.py --workdir=/tmp/opd_s2d

A delta over configs/opd_tiny.py. The candidate set V_K(s_t) is the student's top-K (K = 16, the
paper's): `sampler.behavior_topk` = 16 records the rollout-time student's top-K ids at every response
position (`jaxrl_llm.sampling.behavior`). The teacher (150 SFT steps) and a reference teacher
(`distill.ref_teacher`: the same architecture and initialisation after 50 SFT steps, standing in for
the pre-RL checkpoint) are scored at those ids when the batch is built; the learner gathers the student
there and scores the run's frozen initial student (`ref_logp_BN`, the α·k3 anchor). The paper averages
over the retained (top-ρ JSD) states: `loss.drop_rejected`.
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("opd_tiny.py"))
  c.loss.name = "s2d_opd"
  c.loss.drop_rejected = True
  c.sampler.behavior_topk = 16
  c.distill.ref_teacher = "sft"
  c.distill.ref_teacher_d_model = c.distill.teacher_d_model
  c.distill.ref_teacher_n_layers = c.distill.teacher_n_layers
  c.distill.ref_teacher_sft_steps = 50
  return c
