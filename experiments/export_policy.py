"""Exports the policy of a run's latest valid checkpoint as a Hugging Face folder with its tokenizer.

  python -m experiments.export_policy --config=configs/smollm2_grpo.py --workdir=runs/smollm2 --out=DIR
  python -m experiments.export_policy --config=configs/smollm2_lora.py --workdir=runs/lora --out=DIR --lora=peft

The config (and its overrides) must be the run's own: the checkpoint's stored config is checked as on
resume. The folder loads with `models.load_hf` and as `--config.model.init_from=DIR` (e.g. as the
teacher of an on-policy distillation run: `--config.distill.teacher=DIR`).

A LoRA run (`model.lora.rank` > 0) exports its merged weights by default (`--lora=merged`, the same HF folder), or
its adapter alone as a PEFT folder (`--lora=peft`: adapter_config.json + adapter_model.safetensors, loaded with
`peft.PeftModel.from_pretrained` over the base `model.init_from`) with the tokenizer. QLoRA adapters
(`model.lora.base_quantize="int8"`) were trained over the int8 round trip of that base: the merged export holds
exactly the run's policy, the PEFT folder over the full-precision base a close neighbour of it.
"""

from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags

from jaxrl_llm import config as config_lib
from jaxrl_llm import loop, run_state
from jaxrl_llm.rollout import sources
from jaxrl_llm.models import lora, save_hf
from jaxrl_llm.models.hf import save_peft

_CONFIG = config_flags.DEFINE_config_file("config", None, "the run's config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir (holds checkpoints/)")
_OUT = flags.DEFINE_string("out", None, "the Hugging Face folder to write")
_LORA = flags.DEFINE_enum("lora", "merged", ["merged", "peft"], "a LoRA run: merged HF weights, or the PEFT adapter")


def export(c, workdir: str, out: str, lora_format: str = "merged") -> int:
  """Writes `out` from the latest valid checkpoint of `workdir` (a LoRA run's adapter as a PEFT folder when
  `lora_format` is "peft"); returns its learner step."""
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
  if lora_format == "peft":
    if not lora.has_adapters(state.params):
      raise SystemExit(f"error: --lora=peft: the run in {workdir} has no LoRA adapters (model.lora.rank is 0)")
    save_peft(out, state.params["lora"], os.path.abspath(c.model.init_from) if c.model.init_from else "")
  else:
    save_hf(out, r.model_cfg, lora.effective(state.params))  # LoRA: the merged weights
  r.encoder.tokenizer.save(out)
  return step


def main(argv):
  del argv
  step = export(_CONFIG.value, _WORKDIR.value, _OUT.value, _LORA.value)
  print(f"exported step {step} of {_WORKDIR.value} to {os.path.abspath(_OUT.value)}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir", "out"])
  app.run(main)
