"""On-policy distillation on real weights: SmolLM2-135M-Instruct (30 layers) teaches its own first 8 layers.

Prepare both folders once (`make smollm2` does both):
      python -m jaxrl_llm.models.gguf                      # the teacher: ~/.cache/jaxrl_llm/SmolLM2-135M-Instruct
      python -m jaxrl_llm.models.truncate --layers 8       # the student: ...SmolLM2-135M-Instruct-first8
Run:  python -m jaxrl_llm --config=configs/smollm2_opd.py --workdir=runs/smollm2_opd

A delta over configs/smollm2_grpo.py (same chat-templated arithmetic, same memory settings) with the
OPD section of configs/opd_default.py: the student (`model.init_from`) is a layer-truncated copy of the
teacher (`distill.teacher`), so both share the tokenizer and chat template; the student samples, the
frozen teacher scores every sampled token, and the loss is the sampled-token reverse KL
(`loss.name=opd_reverse_kl`; other OPD losses as in configs/opd_default.py). The task reward is still
computed and logged as accuracy, and greedy held-out accuracy is measured before and after.
Another depth: `python -m jaxrl_llm.models.truncate --layers N` and `--config.model.init_from=<its folder>`.
"""

import pathlib

from jaxrl_llm.config import load_file
from jaxrl_llm.models.gguf import default_cache_dir  # numpy-only module: no torch, no transformers
from jaxrl_llm.models.truncate import default_out

STUDENT_LAYERS = 8


def get_config():
  here = pathlib.Path(__file__).parent
  c = load_file(here / "smollm2_grpo.py")
  opd = load_file(here / "opd_default.py")
  teacher = default_cache_dir()
  c.model.init_from = str(default_out(teacher, STUDENT_LAYERS))
  c.loss = opd.loss
  c.distill = opd.distill
  c.distill.teacher = str(teacher)
  c.distill.topk = 16
  c.optim.lr = 1e-5
  c.rollout.prompts_per_step = 8  # no reward groups needed: every token gets the teacher's signal
  c.rollout.group_size = 4
  return c
