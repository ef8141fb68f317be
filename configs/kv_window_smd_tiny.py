"""SMD (`smd`, Shadow Mask Distillation) on the tiny model with a KV-compressed sampler: attention sinks +
a sliding window (`sampler.kv_cache="window"`) while the learner scores the full context.

Run:  python -m jaxrl_llm --config=configs/kv_window_smd_tiny.py --workdir=/tmp/kv_window_smd

A delta over configs/tiny.py. The sampler keeps the first 2 positions and the last 6 (its own included) of
each row's context, so the later answer digits are drawn without the middle of the prompt: μ differs from the
dense learner (`experiments/kv_compression.py` measures how much). The sampler records (sinks, window) per row
(`kv_window_B2`); the learner rebuilds the mask and runs the shadow forward. Compare `--config.loss.name=tis`
(IS on the dense learner) and `ppo_clip` (no correction).
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("tiny.py"))
  c.loss.name = "smd"
  c.sampler.kv_cache = "window"
  c.sampler.kv_sinks = 2
  c.sampler.kv_window = 6
  return c
