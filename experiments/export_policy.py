"""Exports the policy of a run's latest valid checkpoint as a Hugging Face folder with its tokenizer.

  python -m experiments.export_policy --config=configs/smollm2_grpo.py --workdir=runs/smollm2 --out=DIR

The config (and its overrides) must be the run's own: the checkpoint's stored config is checked as on
resume. The folder loads with `models.load_hf` and as `--config.model.init_from=DIR` (e.g. as the
teacher of an on-policy distillation run: `--config.distill.teacher=DIR`).
"""

from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags

from jaxrl_llm import config as config_lib
from jaxrl_llm import loop, run_state
from jaxrl_llm.rollout import sources
from jaxrl_llm.models import lora, save_hf

_CONFIG = config_flags.DEFINE_config_file("config", None, "the run's config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir (holds checkpoints/)")
_OUT = flags.DEFINE_string("out", None, "the Hugging Face folder to write")


def export(c, workdir: str, out: str) -> int:
  """Writes `out` from the latest valid checkpoint of `workdir`; returns its learner step."""
  import json
  config_lib.validate(c)
  r = loop.setup(c)
  store = loop.new_store(r)
  ckpt = run_state.open_checkpointer(c, workdir)
  try:
    restored = run_state.restore(ckpt, r, store, sources.retention(r.ctx.settings), json.loads(c.to_json_best_effort()))
  finally:
    ckpt.close()
  if restored is None:
    raise SystemExit(f"error: {workdir}: no valid checkpoint to export")
  step, state = restored[0], restored[1]
  save_hf(out, r.model_cfg, lora.effective(state.params))  # LoRA: the merged weights
  r.encoder.tokenizer.save(out)
  return step


def main(argv):
  del argv
  step = export(_CONFIG.value, _WORKDIR.value, _OUT.value)
  print(f"exported step {step} of {_WORKDIR.value} to {os.path.abspath(_OUT.value)}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir", "out"])
  app.run(main)
