"""Smallest end-to-end on-policy distillation run (about a minute on 2 cores, teacher training included).

Run:  python -m jaxrl_llm --config=configs/opd_tiny.py --workdir=/tmp/opd_tiny
      python -m jaxrl_llm --config=configs/opd_tiny.py --workdir=/tmp/opd_tiny_fkl --config.loss.name=opd_forward_kl

A delta over configs/tiny.py with the distill section of configs/opd_default.py (documented there):
a 1-layer width-32 student with 10 SFT steps, a 2-layer width-64 teacher with 150 SFT steps.
"""

import importlib.util
import pathlib


def _load(name):
  # Loaded by path so the config works from any working directory (config_flags loads files by path).
  spec = importlib.util.spec_from_file_location(f"_jaxrl_{name}_config", pathlib.Path(__file__).with_name(f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


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
