"""Hugging Face checkpoint import/export for Llama, Qwen2 and Qwen3 decoders.

A checkpoint folder holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Tensors are read with the `safetensors` numpy backend (no torch).

HF stores torch `Linear` weights as `[out, in]`; jaxrl_llm keeps `[in, out]` with heads split out,
and stacks layers on a leading L axis:

  model.embed_tokens.weight            [V, D]        -> embed        [V, D]
  model.layers.{i}.self_attn.q_proj    [H*hd, D]     -> wq        [L, D, H, hd]   (k/v: K heads)
  model.layers.{i}.self_attn.o_proj    [D, H*hd]     -> wo        [L, H, hd, D]
  model.layers.{i}.self_attn.q_proj.bias [H*hd]      -> bq        [L, H, hd]      (Qwen2)
  model.layers.{i}.self_attn.q_norm    [hd]          -> q_norm    [L, hd]         (Qwen3)
  model.layers.{i}.mlp.gate_proj       [F, D]        -> w_gate    [L, D, F]       (down: [F, D])
  lm_head.weight                       [V, D]        -> lm_head      [D, V]       (absent if tied)

HF RoPE uses rotate_half on the stored q/k layout, as `transformer.forward` does, so no
permutation of q/k rows is needed (unlike Meta's original Llama checkpoints).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import param_shapes


@dataclasses.dataclass(frozen=True)
class Family:
  """What distinguishes one supported HF architecture from another."""

  name: str  # `family=` argument of `save_hf`.
  architecture: str  # config.json "architectures"[0].
  model_type: str  # config.json "model_type".
  attn_bias: bool  # q/k/v projections carry biases.
  qk_norm: bool  # per-head RMSNorm on q and k before RoPE.
  free_head_dim: bool  # config.json `head_dim` may differ from hidden_size / num_attention_heads.


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", attn_bias=False, qk_norm=False, free_head_dim=True),
        # transformers 4.x Qwen2 ignores `head_dim`, so exports keep it derived.
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", attn_bias=True, qk_norm=False, free_head_dim=False),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", attn_bias=False, qk_norm=True, free_head_dim=True),
    )
}
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}


@dataclasses.dataclass(frozen=True)
class _Map:
  """Layout change for one tensor; `s` is the jaxrl_llm shape of one layer's slice."""

  hf_shape: Callable[[tuple], tuple]
  to_jax: Callable[[np.ndarray, tuple], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


_SAME = _Map(lambda s: s, lambda w, s: w, lambda x: x)
_T = _Map(lambda s: s[::-1], lambda w, s: w.T, lambda x: x.T)
# [N*hd, D] <-> [D, N, hd]: an input projection whose output is split into heads.
_HEADS_IN = _Map(
    lambda s: (s[1] * s[2], s[0]), lambda w, s: w.T.reshape(s), lambda x: x.reshape(x.shape[0], -1).T
)
# [D, H*hd] <-> [H, hd, D]: the output projection, heads merged on its input side.
_HEADS_OUT = _Map(
    lambda s: (s[2], s[0] * s[1]), lambda w, s: w.T.reshape(s), lambda x: x.reshape(-1, x.shape[-1]).T
)
_HEADS_BIAS = _Map(lambda s: (s[0] * s[1],), lambda w, s: w.reshape(s), lambda x: x.reshape(-1))

_TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", _SAME),
    "final_norm": ("model.norm.weight", _SAME),
    "lm_head": ("lm_head.weight", _T),
}
_ATTN = "model.layers.{i}.self_attn."
_LAYER_NAMES = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", _SAME),
    "wq": (_ATTN + "q_proj.weight", _HEADS_IN),
    "wk": (_ATTN + "k_proj.weight", _HEADS_IN),
    "wv": (_ATTN + "v_proj.weight", _HEADS_IN),
    "wo": (_ATTN + "o_proj.weight", _HEADS_OUT),
    "bq": (_ATTN + "q_proj.bias", _HEADS_BIAS),
    "bk": (_ATTN + "k_proj.bias", _HEADS_BIAS),
    "bv": (_ATTN + "v_proj.bias", _HEADS_BIAS),
    "q_norm": (_ATTN + "q_norm.weight", _SAME),
    "k_norm": (_ATTN + "k_norm.weight", _SAME),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", _SAME),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", _T),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", _T),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", _T),
}
# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- config.json


def _rope_theta(hf: dict) -> float:
  """RoPE base from transformers>=5 `rope_parameters` or the older top-level `rope_theta`."""
  return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


def _unsupported(hf: dict, family: Family) -> list[str]:
  """Config features the model cannot represent; loading them silently would change the model."""
  # transformers>=5 writes `rope_parameters`, 4.x `rope_scaling`; either may carry a scaling type.
  ropes = [hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}]
  rope_types = sorted({r.get("rope_type", r.get("type", "default")) for r in ropes} - {"default"})
  layer_types = set(hf.get("layer_types") or ["full_attention"])
  problems = {
      f"rope scaling {rope_types} (only plain RoPE is implemented)": bool(rope_types),
      f"hidden_act={hf.get('hidden_act')!r} (only 'silu' SwiGLU)": hf.get("hidden_act", "silu") != "silu",
      # Llama/Qwen3 `attention_bias` also adds an o_proj bias, which the model does not have.
      "attention_bias=true": bool(hf.get("attention_bias")) and not family.attn_bias,
      "mlp_bias=true": bool(hf.get("mlp_bias")),
      "sliding-window attention": bool(hf.get("use_sliding_window")) or layer_types != {"full_attention"},
  }
  return [msg for msg, bad in problems.items() if bad]


def family_of(hf: dict) -> Family:
  """The supported `Family` named by a parsed config.json, or a ValueError naming `architectures`."""
  archs = hf.get("architectures") or []
  family = _BY_ARCHITECTURE.get(archs[0]) if len(archs) == 1 else None
  if family is None:
    raise ValueError(
        f"unsupported checkpoint: config.json has architectures={archs!r}; "
        f"supported: {sorted(_BY_ARCHITECTURE)}"
    )
  return family


def config_from_hf(hf: dict, *, param_dtype: str | None = None) -> ModelConfig:
  """Translate a parsed HF config.json into a `ModelConfig`.

  Args:
    hf: the parsed config.json.
    param_dtype: parameter dtype; defaults to the checkpoint's `dtype`/`torch_dtype`, else float32.
  Raises:
    ValueError: unknown architecture or a feature the model does not implement.
  """
  family = family_of(hf)
  problems = _unsupported(hf, family)
  if problems:
    raise ValueError(f"unsupported {family.architecture} checkpoint: {'; '.join(problems)}")
  n_heads = hf["num_attention_heads"]
  return ModelConfig(
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"],
      n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
      d_ff=hf["intermediate_size"],
      rope_theta=_rope_theta(hf),
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qk_norm=family.qk_norm,
      attn_bias=family.attn_bias,
      param_dtype=param_dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32",
      max_seq_len=hf.get("max_position_embeddings", 2048),
      init_std=float(hf.get("initializer_range", 0.02)),
      family=family.name,
  )


def family_for(cfg: ModelConfig) -> str:
  """The family to save `cfg` as: the one it was loaded from, else the one that has its features
  (q/k/v biases: qwen2; q/k norms: qwen3; neither: llama)."""
  if cfg.family is not None:
    return cfg.family
  return "qwen2" if cfg.attn_bias else "qwen3" if cfg.qk_norm else "llama"


def config_to_hf(cfg: ModelConfig, family: str) -> dict:
  """The config.json that makes `transformers` build the same model as `cfg`.

  Raises:
    ValueError: `cfg` needs a feature `family` does not have (e.g. q/k/v biases in a Llama).
  """
  if family not in FAMILIES:
    raise ValueError(f"unknown family {family!r}; supported: {sorted(FAMILIES)}")
  fam = FAMILIES[family]
  mismatches = {
      "attn_bias": (cfg.attn_bias, fam.attn_bias),
      "qk_norm": (cfg.qk_norm, fam.qk_norm),
      "head_dim": (cfg.head_dim, cfg.head_dim if fam.free_head_dim else cfg.d_model // cfg.n_heads),
      "num_experts": (cfg.num_experts, 0),  # MoE export is not implemented (dense families only)
  }
  bad = [f"{k}={got} (family needs {want})" for k, (got, want) in mismatches.items() if got != want]
  if bad:
    raise ValueError(f"config cannot be saved as family={family!r}: {', '.join(bad)}")
  return {
      "architectures": [fam.architecture],
      "model_type": fam.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "initializer_range": cfg.init_std,
      "rms_norm_eps": cfg.rms_eps,
      # Both spellings: transformers>=5 reads `rope_parameters`, 4.x reads `rope_theta`.
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": fam.attn_bias,
      "mlp_bias": False,
      "use_sliding_window": False,
      "dtype": jnp.dtype(cfg.param_dtype).name,
      "use_cache": True,
  }


# ----------------------------------------------------------------------------- tensors


def _expected_shapes(cfg: ModelConfig) -> dict:
  """Parameter tree of shapes, from the model's own layout (its single source of truth)."""
  return jax.tree.map(lambda a: tuple(a.shape), param_shapes(cfg))


def _shard_files(path: pathlib.Path) -> list[pathlib.Path]:
  """The safetensors files of a checkpoint folder: the index's shards, else every *.safetensors."""
  index = path / "model.safetensors.index.json"
  if index.exists():
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [path / n for n in names]
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors file in {path}")
  return files


def _convert(name: str, w: np.ndarray, m: _Map, s: tuple, dtype: np.dtype) -> np.ndarray:
  if tuple(w.shape) != m.hf_shape(s):
    raise ValueError(f"{name}: shape {tuple(w.shape)} in checkpoint, config.json implies {m.hf_shape(s)}")
  return m.to_jax(w, s).astype(dtype, copy=False)


def _read_params(read: Callable[[str], np.ndarray], shapes: dict, dtype: np.dtype) -> tuple[dict, set]:
  """Build the parameter tree from HF tensors; returns it and the HF names used."""
  used = set()

  def get(name, m, s):
    used.add(name)
    return _convert(name, read(name), m, s, dtype)

  params = {k: get(*_TOP_NAMES[k], s) for k, s in shapes.items() if k != "layers"}
  layers = {}
  for k, (n_layers, *s) in shapes["layers"].items():
    template, m = _LAYER_NAMES[k]
    layers[k] = np.stack([get(template.format(i=i), m, tuple(s)) for i in range(n_layers)])
  return {**params, "layers": layers}, used


def load_hf(path, *, param_dtype: str | None = None, shardings: Any = None) -> tuple[ModelConfig, dict]:
  """Load a Llama / Qwen2 / Qwen3 Hugging Face checkpoint folder.

  Args:
    path: folder with config.json and model.safetensors (or shards + model.safetensors.index.json).
    param_dtype: cast every parameter to this dtype; default: the checkpoint's declared dtype.
    shardings: optional pytree of `jax.sharding.Sharding` matching the params, to place each array
      directly where it belongs; default: the default device.
  Returns:
    (config, params) with params in the layout of `jaxrl_llm.models.transformer`.
  Raises:
    FileNotFoundError: no config.json or no safetensors file.
    ValueError: unsupported architecture/feature, missing, unexpected or mis-shaped tensors.
  """
  path = pathlib.Path(path)
  config_file = path / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"no config.json in {path}")
  cfg = config_from_hf(json.loads(config_file.read_text()), param_dtype=param_dtype)
  shapes = _expected_shapes(cfg)
  unmapped = sorted(set(shapes) - set(_TOP_NAMES) - {"layers"}) + sorted(
      set(shapes["layers"]) - set(_LAYER_NAMES))
  if unmapped:
    raise ValueError(f"model parameters {unmapped} have no Hugging Face equivalent")
  with contextlib.ExitStack() as stack:
    handles = [stack.enter_context(safe_open(str(f), framework="np")) for f in _shard_files(path)]
    where = {name: h for h in handles for name in h.keys()}

    def read(name):
      if name not in where:
        raise ValueError(f"tensor {name!r} missing from checkpoint {path}")
      return where[name].get_tensor(name)

    params, used = _read_params(read, shapes, jnp.dtype(cfg.param_dtype))
  # A tied checkpoint may still store lm_head.weight (a copy of the embedding).
  ignored = {n for n in where if n.endswith(_IGNORED_SUFFIXES)} | (
      {"lm_head.weight"} if cfg.tie_embeddings else set())
  unexpected = sorted(set(where) - used - ignored)
  if unexpected:
    raise ValueError(f"checkpoint {path} has tensors the model does not use: {unexpected[:8]}")
  return cfg, jax.device_put(params, shardings)


def save_hf(path, cfg: ModelConfig, params: dict, family: str | None = None) -> None:
  """Write `params` as a Hugging Face checkpoint (config.json + model.safetensors).

  `transformers.AutoModelForCausalLM.from_pretrained(path)` then builds the same model, and
  `load_hf(path)` returns `params` bit for bit (dtype kept).

  Args:
    path: output folder (created if needed).
    cfg: the model config; must be expressible in `family`.
    params: parameter tree in the layout of `jaxrl_llm.models.transformer`.
    family: "llama", "qwen2" or "qwen3"; None: `family_for(cfg)` (the family `cfg` was loaded from).
  Raises:
    ValueError: unknown family, a config the family cannot express, or params not matching cfg.
  """
  hf_config = config_to_hf(cfg, family or family_for(cfg))
  shapes = _expected_shapes(cfg)
  got = jax.tree.map(lambda a: tuple(a.shape), params)
  if got != shapes:
    raise ValueError(f"params do not match the config: got shapes {got}, expected {shapes}")
  host = jax.device_get(params)
  # safetensors writes raw buffers, so transposed views must be made contiguous.
  tensors = {
      name: np.ascontiguousarray(m.to_hf(np.asarray(host[k])))
      for k, (name, m) in _TOP_NAMES.items()
      if k in host
  }
  for k, x_L in host["layers"].items():
    template, m = _LAYER_NAMES[k]
    tensors.update(
        {template.format(i=i): np.ascontiguousarray(m.to_hf(np.asarray(x_L[i]))) for i in range(cfg.n_layers)}
    )
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


# ----------------------------------------------------------------------------- LoRA adapters (PEFT)

PEFT_PREFIX = "base_model.model."  # PeftModel's path to the wrapped causal LM


def peft_name(weight: str, layer: int, part: str) -> str:
  """PEFT's tensor name of one layer's adapter half `part` ("lora_A" | "lora_B") of our `weight` (e.g. "wq" ->
  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight)."""
  module = _LAYER_NAMES[weight][0].format(i=layer).removesuffix(".weight")
  return f"{PEFT_PREFIX}{module}.{part}.weight"


def save_peft(path, adapters, base_model: str = "") -> None:
  """Writes LoRA adapters (`models.lora.Adapters`) as a PEFT folder: adapter_config.json + adapter_model.safetensors.

  Our lora_A [L, r, in] / lora_B [L, out, r] are PEFT's per-layer (r, in) / (out, r) with rows in the order of the
  Hugging Face weight `save_hf` writes, so `peft.PeftModel.from_pretrained(<base>, path)` computes the same
  W_hf + (alpha / r) · B A. `base_model` is recorded as base_model_name_or_path (the run's `model.init_from`).
  """
  from jaxrl_llm.models import lora
  host = jax.device_get(adapters.weights)
  experts = sorted(w for w, ab in host.items() if ab["lora_A"].ndim == 4)
  if experts:  # the MoE checkpoint itself has no Hugging Face export here (`save_hf`: dense families only)
    raise ValueError(f"save_peft: adapters of MoE experts ({', '.join(experts)}) have no PEFT export yet (MoE models "
                     "have no Hugging Face export here)")
  tensors, ranks = {}, set()
  for w, ab in host.items():
    ranks.add(ab["lora_A"].shape[1])
    for part in ("lora_A", "lora_B"):
      tensors.update({peft_name(w, i, part): np.ascontiguousarray(ab[part][i]) for i in range(ab[part].shape[0])})
  (r,) = ranks
  by_weight = {v: k for k, v in lora.TARGETS.items()}
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": int(r),
            "lora_alpha": float(adapters.scale * r), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True,
            "target_modules": sorted(by_weight[w] for w in host)}
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
  (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
