"""LoRA GRPO from the real SmolLM2-135M-Instruct on 2-digit addition asked as a chat question (CPU-sized).

A delta over configs/smollm2_grpo.py (read it first: model import, task, sampler, memory): rank-16 adapters on
every attention and MLP projection of the frozen base (`jaxrl_llm.models.lora`), scale alpha / r = 2. Only the
adapters (about 4.9 M parameters, 3.6% of the model) get gradients and AdamW moments, checkpoints hold them and the
base's sha256, and each publish sends the adapters to the sampler, which merges them into its copy of the base.

Prepare the model once:  make smollm2
Run:     python -m jaxrl_llm --config=configs/smollm2_lora.py --workdir=runs/smollm2_lora
QLoRA:   add --config.model.lora.base_quantize=int8 (the frozen base through the int8 weight-only round trip)
Export:  python -m experiments.export_policy --config=configs/smollm2_lora.py --workdir=runs/smollm2_lora \
           --out=DIR --lora=peft      (or without --lora: merged Hugging Face weights)
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("smollm2_grpo.py"))
  c.model.lora.rank = 16
  c.model.lora.alpha = 32.0
  c.model.lora.targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
  c.optim.lr = 2e-4  # adapters start at B = 0 and move through scale·BA: LoRA takes about 10x full fine-tuning's lr
  c.optim.warmup_steps = 0
  c.checkpoint.every = 10  # adapter checkpoints are small (no base weights, moments of the adapters only)
  c.checkpoint.keep = 2
  return c
