"""On-policy distillation demo: a small student distils a larger SFT-trained teacher on 2-digit addition.

Run:  python -m jaxrl_llm --config=configs/opd_default.py --workdir=runs/opd
      python -m jaxrl_llm --config=configs/opd_default.py --workdir=runs/opd_fkl --config.loss.name=opd_forward_kl

A delta over configs/default.py: the student (the default model) gets only a short SFT warm start,
the teacher (wider and deeper) a long one; every rollout is then scored by the frozen teacher at
rollout time (`jaxrl_llm.distill.opd.make_batch_extras`) and the student is trained on an OPD loss
instead of a reward. The reward is still computed and logged (accuracy), but OPD losses ignore it.

Section `distill`: the comment on each field below (docs/config.md lists them). An "sft" teacher is trained
once per (task, seed, size, SFT settings) with sft.batch_size and sft.lr, cached under teacher_cache_dir as a
Hugging Face folder and reused; a folder teacher must have the task's vocabulary. The learner scores the student
at sampler.temperature, so `temperature` 0 compares both at the same T. The reference teacher ("sft": the
teacher's family and initialisation after ref_teacher_sft_steps) is scored at the student's top-K candidates.

Runnable OPD losses with this teacher (`loss.name`): opd_reverse_kl (sampled-token reverse KL,
advantage form; `loss.hparams.online_advantage=True` is AsyncOPD's recompute fix), opd_forward_kl,
opd_reverse_kl_full, gkd_jsd (dense over the tiny vocabulary), opd_topk_kl (top-k cache), f_opd
(supervision drift 0 for a frozen teacher). With more switched on: opd_reverse_kl_mc
(sampler.mc_samples > 0: configs/opd_mc_tiny.py), s2d_opd (sampler.behavior_topk > 0 and
distill.ref_teacher: configs/opd_s2d_tiny.py). sdcc runs on episodes with context eviction
(configs/sdcc_tiny.py), not with this teacher.
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def _base():
  return load_file(pathlib.Path(__file__).with_name("default.py"))


def get_config():
  c = _base()
  c.num_steps = 200
  c.sft.steps = 60  # a weak student: it has seen the format, not yet the arithmetic
  c.loss.name = "opd_reverse_kl"
  c.loss.agg_mode = "token-mean"  # OPD convention: masked token mean over the batch
  c.optim.lr = 3e-4
  c.distill = ml_collections.ConfigDict({
      "teacher": "sft",  # "sft" (trained on the task, cached) | a Hugging Face folder | "mopd" (distill.teachers)
      "teacher_d_model": 256,  # "sft" teacher's width (d_ff and heads scale with it; head_dim is the student's)
      "teacher_n_layers": 4,  # "sft" teacher's depth
      "teacher_sft_steps": 1500,  # "sft" teacher's SFT steps (batch size and lr: sft.batch_size, sft.lr)
      "teacher_cache_dir": "",  # cache of "sft" teachers; "" = ~/.cache/jaxrl_llm/teachers
      "teacher_demo_player": "",  # with env.name: the scripted player the "sft" teacher imitates; "" = sft.demo_player
      "topk": 16,  # K of the teacher's top-k scores (ids, log-probs, residual log-mass)
      "temperature": 0.0,  # teacher scoring temperature; 0 = sampler.temperature
      "ref_teacher": "",  # S²D / Direct-OPD reference (pre-RL) teacher: "" = off | "sft" | a folder
      "ref_teacher_d_model": 256,  # "sft" reference teacher's width
      "ref_teacher_n_layers": 4,  # "sft" reference teacher's depth
      "ref_teacher_sft_steps": 500,  # "sft" reference teacher's SFT steps
  })
  return c
