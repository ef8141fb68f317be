"""The policy a run starts from: its architecture (config fields or a Hugging Face checkpoint), initial
parameters (random init or the checkpoint's weights) and the tokenizer the checkpoint was saved with.

Used by the loop for the student and by `distill.teacher` for an SFT teacher; imports no run wiring.
`model.remat="auto"` stays in the built config until `resolve_remat` decides it (`jaxrl_llm.memory`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Any

import ml_collections

from jaxrl_llm import config as config_lib
from jaxrl_llm import memory, model_fields
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.tasks import tokenizer as tok


def tokenizer_for_checkpoint(folder: str | os.PathLike) -> tok.Tokenizer:
  """The tokenizer a checkpoint folder was saved with: its Hugging Face tokenizer files, or the marker
  `char_tokenizer.json` written when a char-tokenizer model is exported (`sft.save_to`, SFT teachers).

  Raises FileNotFoundError naming the folder when it holds neither, ValueError for unusable tokenizer files.
  """
  from jaxrl_llm.models import tokenizer as hf_tok  # local: transformers loads only for checkpoints
  path = pathlib.Path(folder)
  if hf_tok.has_tokenizer_files(path):
    return hf_tok.load_checkpoint_tokenizer(path)
  if (path / tok.CHAR_TOKENIZER_FILE).is_file():
    return tok.CHAR_TOKENIZER
  raise FileNotFoundError(f"{path}: no tokenizer files (expected tokenizer.json + tokenizer_config.json of a "
                          f"Hugging Face checkpoint, or {tok.CHAR_TOKENIZER_FILE} of a jaxrl_llm export)")


def checkpoint_config(c: ml_collections.ConfigDict) -> ModelConfig | None:
  """The architecture of `model.init_from` from its config.json (no weights read), None without one."""
  if not c.model.init_from:
    return None
  from jaxrl_llm.models.hf import config_from_hf
  path = os.path.join(c.model.init_from, "config.json")
  if not os.path.isfile(path):
    raise config_lib.ConfigError(f"config.model.init_from={c.model.init_from!r}: not a Hugging Face checkpoint "
                                 "folder (no config.json there)")
  try:
    with open(path) as f:
      return config_from_hf(json.load(f), param_dtype="float32")
  except (OSError, ValueError, KeyError) as e:
    raise config_lib.ConfigError(f"config.model.init_from={c.model.init_from!r}: cannot use {path}: "
                                 f"{type(e).__name__}: {str(e)[:200]}") from None


def model_config(c: ml_collections.ConfigDict, width: int, vocab_size: int = tok.vocab_size) -> ModelConfig:
  """The from-scratch model of the config's `model` fields, over the tokenizer's `vocab_size`."""
  m = c.model
  return ModelConfig(vocab_size=vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                     n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, d_ff=m.d_ff, rope_theta=m.rope_theta,
                     tie_embeddings=m.tie_embeddings, qk_norm=m.qk_norm, dtype=m.dtype, remat=m.remat,
                     layer_unroll=layer_unroll(c), decode_unroll=config_lib.read(c, "model.decode_unroll"),
                     num_experts=m.num_experts, experts_per_token=m.experts_per_token,
                     capacity_factor=m.capacity_factor,
                     # an episode (`env`) re-prefills its prompt bucket + token budget every turn; a served
                     # call (`serve`) pads its prompt to serve.max_context
                     max_seq_len=max(width + c.sampler.max_new_tokens, config_lib.env_length(c),
                                     config_lib.serve_length(c), config_lib.echo_length(c, width),
                                     config_lib.pats_length(c, width)))


def step_shape(c: ml_collections.ConfigDict, width: int) -> memory.StepShape:
  """The shapes of one training step of the run (`memory.StepShape`) for prompts of `width` tokens.

  Rows: `rollout.prompts_per_step × group_size`; the learner's micro-batch cuts them by `optim.grad_accum` and
  `optim.minibatches`. Row width: the prompt + completion, an episode's or a served call's context, or a packed
  row (`optim.pack_width`), whichever is widest."""
  B = c.rollout.prompts_per_step * c.rollout.group_size
  T = max(width + c.sampler.max_new_tokens, config_lib.env_length(c), config_lib.serve_length(c),
          config_lib.echo_length(c, width), config_lib.pats_length(c, width),
          config_lib.read(c, "optim.pack_width"))
  micro = math.ceil(B / (c.optim.grad_accum * config_lib.read(c, "optim.minibatches")))
  rank, weights = 0, ()
  if config_lib.lora_on(c):
    rank = c.model.lora.rank
    weights = tuple(model_fields.LORA_TARGETS[t] for t in model_fields.parse_lora_targets(c.model.lora.targets))
  copies = int(config_lib.uses_reference(c)) + int(config_lib.old_logp_strategy(c) == "ewma")
  return memory.StepShape(rows=B, prompt=width, new=T - width, micro_rows=micro, frozen_copies=copies,
                          lora_rank=rank, lora_weights=weights, sampler_dtype=c.sampler.dtype)


def resolve_remat(c: ml_collections.ConfigDict, cfg: ModelConfig,
                  width: int) -> tuple[ModelConfig, memory.RematChoice | None]:
  """`cfg` with `model.remat="auto"` decided for this run (`memory.choose_remat` on `step_shape` against
  `model.memory_budget_gb`, 0 = the machine's), and the decision; `cfg` as it is (and None) for any other value."""
  if not (isinstance(cfg.remat, str) and cfg.remat == "auto"):
    return cfg, None
  budget = memory.budget_bytes(config_lib.read(c, "model.memory_budget_gb"))
  choice = memory.choose_remat(cfg, step_shape(c, width), budget)
  return dataclasses.replace(cfg, remat=choice.remat), choice


def layer_unroll(c: ml_collections.ConfigDict, n_layers: int | None = None) -> int:
  """`model.layer_unroll` with 0 meaning every layer (a config stays valid when n_layers changes);
  `n_layers` defaults to the config's (a Hugging Face checkpoint brings its own)."""
  return c.model.layer_unroll or n_layers or c.model.n_layers


def checkpoint_model_config(c, model_cfg: ModelConfig, hf_cfg: ModelConfig, tokenizer_vocab: int) -> ModelConfig:
  """The checkpoint's architecture with the run's numerics; its embedding must cover the tokenizer's ids
  (a larger, padded vocabulary is fine)."""
  if hf_cfg.vocab_size < tokenizer_vocab:
    raise config_lib.ConfigError(
        f"config.model.init_from={c.model.init_from!r}: checkpoint vocab_size={hf_cfg.vocab_size} is smaller than "
        f"its tokenizer's vocab_size={tokenizer_vocab}")
  return dataclasses.replace(hf_cfg, dtype=model_cfg.dtype, remat=model_cfg.remat,
                             layer_unroll=layer_unroll(c, hf_cfg.n_layers), decode_unroll=model_cfg.decode_unroll,
                             max_seq_len=max(hf_cfg.max_seq_len, model_cfg.max_seq_len))


def initial_policy(c, model_cfg: ModelConfig, key, tokenizer_vocab: int | None = None) -> tuple[ModelConfig, Any]:
  """Random init, or a Hugging Face checkpoint folder (`model.init_from`) whose vocabulary covers the
  tokenizer's (`tokenizer_vocab`, default `model_cfg.vocab_size`)."""
  if not c.model.init_from:
    return model_cfg, init_params(model_cfg, key)
  from jaxrl_llm.models import load_hf
  path = c.model.init_from
  cfg_file = os.path.join(path, "config.json")
  try:
    with open(cfg_file) as f:
      json.load(f)
  except (OSError, ValueError) as e:
    raise config_lib.ConfigError(f"config.model.init_from={path!r}: cannot read {cfg_file}: "
                                 f"{type(e).__name__}: {str(e)[:200]}") from None
  try:
    hf_cfg, params = load_hf(path, param_dtype="float32")
  except Exception as e:  # noqa: BLE001 -- truncated / foreign safetensors raise many types; name the folder
    raise config_lib.ConfigError(f"config.model.init_from={path!r}: cannot load the checkpoint (its *.safetensors "
                                 f"or config.json): {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                                 ) from None
  return checkpoint_model_config(c, model_cfg, hf_cfg, tokenizer_vocab or model_cfg.vocab_size), params
