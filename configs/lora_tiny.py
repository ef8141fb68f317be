"""LoRA on the smallest end-to-end run (configs/tiny.py): rank-4 adapters on every projection, base frozen.

Here without an SFT warm start (`sft.steps = 0`): the tiny random-init base is the one its seed draws, recorded in
every checkpoint instead of the weights. With `--config.sft.steps=150` the adapters train over the run's own warm
start instead (repeated on resume, its checksum in every checkpoint). Used by tests/test_lora.py.

Run:  python -m jaxrl_llm --config=configs/lora_tiny.py --workdir=/tmp/lora_tiny
QLoRA (the frozen base through the int8 weight-only round trip): add --config.model.lora.base_quantize=int8
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("tiny.py"))
  c.model.lora.rank = 4
  c.model.lora.alpha = 8.0
  c.sft.steps = 0
  c.optim.lr = 1e-2  # adapters start at B = 0: a larger step than full fine-tuning moves the policy visibly
  c.optim.warmup_steps = 0
  return c
