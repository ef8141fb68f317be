"""On-policy distillation demo: a small student distils a larger SFT-trained teacher on 2-digit addition.

Run:  python -m jaxrl_llm --config=configs/opd_default.py --workdir=runs/opd
      python -m jaxrl_llm --config=configs/opd_default.py --workdir=runs/opd_fkl --config.loss.name=opd_forward_kl

A delta over configs/default.py: the student (the default model) gets only a short SFT warm start,
the teacher (wider and deeper) a long one; every rollout is then scored by the frozen teacher at
rollout time (`jaxrl_llm.distill.opd.make_batch_extras`) and the student is trained on an OPD loss
instead of a reward. The reward is still computed and logged (accuracy), but OPD losses ignore it.

Section `distill`:
  teacher            "sft": train a larger teacher on the task (trained once per (task, seed, size,
                     SFT settings), cached under teacher_cache_dir as a Hugging Face folder and reused);
                     or a path to a Hugging Face checkpoint folder with the task's vocabulary; "" = off
  teacher_d_model    teacher width (d_ff and heads scale with it; head_dim is the student's)   ["sft"]
  teacher_n_layers   teacher depth                                                            ["sft"]
  teacher_sft_steps  teacher SFT steps (batch size and lr: sft.batch_size, sft.lr)             ["sft"]
  teacher_cache_dir  cache of SFT teachers; "" = ~/.cache/jaxrl_llm/teachers
  topk               K of the teacher's top-k cache (ids, log-probs, residual log-mass)
  temperature        teacher scoring temperature; 0 = sampler.temperature. The learner scores the
                     student at sampler.temperature, so the default compares both at the same T.
  ref_teacher        S²D / Direct-OPD's reference (pre-RL) teacher: "" = off, "sft" (the teacher's
                     family and initialisation, trained ref_teacher_sft_steps steps, cached like the
                     teacher) or a Hugging Face folder; scored at the student's top-K candidates
  ref_teacher_d_model, ref_teacher_n_layers, ref_teacher_sft_steps   its size and SFT steps ["sft"]

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
      "teacher": "sft",
      "teacher_d_model": 256,
      "teacher_n_layers": 4,
      "teacher_sft_steps": 1500,
      "teacher_cache_dir": "",
      "topk": 16,
      "temperature": 0.0,
      "ref_teacher": "",
      "ref_teacher_d_model": 256,
      "ref_teacher_n_layers": 4,
      "ref_teacher_sft_steps": 500,
  })
  return c
