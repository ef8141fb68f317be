"""Smallest end-to-end on-policy distillation run (about a minute on 2 cores, teacher training included).

Run:  python -m jaxrl_llm --config=configs/opd_tiny.py --workdir=/tmp/opd_tiny
      python -m jaxrl_llm --config=configs/opd_tiny.py --workdir=/tmp/opd_tiny_fkl --config.loss.name=opd_forward_kl

A delta over configs/tiny.py with the distill section of configs/opd_default.py (documented there):
a 1-layer width-32 student with 10 SFT steps, a 2-layer width-64 teacher with 150 SFT steps.
"""

import pathlib

from jaxrl_llm.config import load_file


def _load(name):
  return load_file(pathlib.Path(__file__).with_name(f"{name}.py"))


def get_config():
  c = _load("tiny")
  opd = _load("opd_default")
  c.loss = opd.loss
  c.optim.lr = opd.optim.lr
  c.distill = opd.distill
  c.distill.teacher_d_model = 64
  c.distill.teacher_n_layers = 2
  c.distill.teacher_sft_steps = 150
  return c
