"""LoRA adapters over the parameter pytree (pure functions; PEFT's tensor layout).

A target weight W of one layer is viewed as a matrix [in, out] (its leading axes are the input features,
e.g. wq [D, H, hd] -> [D, H*hd], wo [H, hd, D] -> [H*hd, D]: the transpose of the Hugging Face [out, in]
weight that `models.hf` maps it to, rows in the same order). Its adapter is PEFT's pair

  lora_A [L, r, in]  (kaiming-uniform, PEFT's default: U(-1/sqrt(in), 1/sqrt(in)))
  lora_B [L, out, r] (zeros: the adapted model equals the base at step 0)

stacked on L like the base, fp32, and the effective weight is W + scale · (B A)ᵀ with scale = alpha / r,
i.e. the Hugging Face weight W_hf + scale · B A exactly as PEFT merges it. An MoE model's MLP targets are its
experts' stacked weights [L, E, in, out]: each expert gets its own pair, lora_A [L, E, r, in] and lora_B
[L, E, out, r] (as PEFT adapts every expert's `gate_proj` / `up_proj` / `down_proj` Linear of a Mixtral- or
Qwen-MoE-style model); the router and the attention projections are dense as above.

A policy with adapters is the base pytree plus one entry, `params["lora"]`: an `Adapters` node holding the
A/B arrays (its leaves) and the scale (static). Every forward takes such a pytree as it takes a plain one
(the sampler, scorers and evaluation need nothing else): the layer scan carries the adapters along and merges
each layer's weights in its body (`scan_view`, `merge_layer`), so one layer's merged weight exists at a time;
a decode loop merges once before it (`effective`). The gradient of the loss w.r.t. A and B is the LoRA gradient
(dL/dB = scale · G Aᵀ, dL/dA = scale · Bᵀ G with G = dL/dW_hf) while the base gets none: the learner
differentiates `params["lora"]` only. The sampler takes merged weights per publish (`rollout.param_store`).

Names: targets are given by their PEFT / Hugging Face module names (`TARGETS`).
"""

from __future__ import annotations

import dataclasses
import math
import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm import model_fields
from jaxrl_llm.models.config import ModelConfig

Array = jax.Array

TARGETS = model_fields.LORA_TARGETS  # PEFT / Hugging Face module name -> our weight
BASE_QUANTIZE = model_fields.LORA_BASE_QUANTIZE


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank r, alpha (scale = alpha / r), target module names (PEFT's), base quantisation of the frozen base."""
  rank: int
  alpha: float
  targets: tuple[str, ...]
  base_quantize: str = "none"

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def weights(self) -> tuple[str, ...]:
    """Our names of the target weights, in `targets` order."""
    return tuple(TARGETS[t] for t in self.targets)


@struct.dataclass
class Adapters:
  """The adapters of a policy: {weight name: {"lora_A": [L, r, in], "lora_B": [L, out, r]}}; `scale` is static."""
  weights: dict
  scale: float = struct.field(pytree_node=False, default=1.0)


parse_targets = model_fields.parse_lora_targets


def dims(cfg: ModelConfig, weight: str) -> tuple[int, int]:
  """(in, out) features of one layer's `weight` viewed as a matrix."""
  return model_fields.lora_dims(dataclasses.asdict(cfg), weight)


def check(cfg: ModelConfig | None, rank, alpha, targets, dropout=0.0, base_quantize="none"):
  """The first bad `model.lora.*` field as (field, value, why), None when all hold (`model_fields.check_lora`);
  `cfg` None skips the rules that need the architecture."""
  shape = None if cfg is None else {**dataclasses.asdict(cfg)}
  return model_fields.check_lora(shape, rank, alpha, targets, dropout, base_quantize)


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # an MoE model's experts: one adapter pair per expert


def init_adapters(cfg: ModelConfig, lc: LoraConfig, key: Array) -> Adapters:
  """Fresh fp32 adapters: A kaiming-uniform per weight (key folded with the target's index), B zeros; an MoE
  model's expert weights get one pair per expert (a leading E axis after L)."""
  weights = {}
  for i, w in enumerate(lc.weights):
    n_in, n_out = dims(cfg, w)
    lead = (cfg.n_layers, cfg.num_experts) if cfg.num_experts and w in EXPERT_WEIGHTS else (cfg.n_layers,)
    bound = 1.0 / math.sqrt(n_in)  # kaiming_uniform(a=sqrt(5)) of an [r, in] matrix, as PEFT initialises lora_A
    a = jax.random.uniform(jax.random.fold_in(key, i), lead + (lc.rank, n_in), jnp.float32, -bound, bound)
    weights[w] = {"lora_A": a, "lora_B": jnp.zeros(lead + (n_out, lc.rank), jnp.float32)}
  return Adapters(weights, lc.scale)


def _delta_io(ab: dict, scale: float) -> Array:
  """scale · (B A)ᵀ over any leading axes (layers, experts): [..., in, out], float32."""
  return scale * jnp.einsum("...ri,...or->...io", ab["lora_A"], ab["lora_B"], preferred_element_type=jnp.float32)


def delta(w_L: Array, ab: dict, scale: float) -> Array:
  """scale · (B A)ᵀ of every layer (and expert), shaped like the stacked weight `w_L` [L, (E,) in..., out...],
  float32."""
  return _delta_io(ab, scale).reshape(w_L.shape)


def merge(base: dict, adapters: Adapters) -> dict:
  """The effective parameters: each target weight W + scale · (B A)ᵀ (summed in float32, stored in W's dtype)."""
  layers = dict(base["layers"])
  for w, ab in adapters.weights.items():
    layers[w] = (layers[w].astype(jnp.float32) + delta(layers[w], ab, adapters.scale)).astype(layers[w].dtype)
  return {**base, "layers": layers}


def scan_view(params: dict, dtype) -> dict:
  """A policy with adapters as a layer scan reads it: every leaf in compute `dtype` except the target weights,
  and the adapters riding along as `layers["lora"]` (sliced per layer by the scan, merged by `merge_layer`).

  Why: merging per layer inside the scan body keeps one layer's merged weight (and, in the backward pass, its
  gradient) alive at a time instead of a second copy of every target weight of the model.
  """
  base, adapters = split(params)
  layers = {k: v if k in adapters.weights else v.astype(dtype) for k, v in base["layers"].items()}
  rest = jax.tree.map(lambda x: x.astype(dtype), {k: v for k, v in base.items() if k != "layers"})
  return {**rest, "layers": {**layers, "lora": adapters}}


def merge_layer(p_l: dict, dtype) -> dict:
  """One layer's weights (a slice of `scan_view`'s layers) with its adapters merged, in compute `dtype`; a layer
  without adapters is returned as is. Same values as `merge` followed by the cast."""
  adapters = p_l.get("lora") if isinstance(p_l, dict) else None
  if adapters is None:
    return p_l
  out = {k: v for k, v in p_l.items() if k != "lora"}
  for w, ab in adapters.weights.items():
    out[w] = (out[w].astype(jnp.float32) + _delta_io(ab, adapters.scale).reshape(out[w].shape)).astype(dtype)
  return out


def attach(base: dict, adapters: Adapters) -> dict:
  """A policy pytree: the base with its adapters under "lora"."""
  return {**base, "lora": adapters}


def has_adapters(params) -> bool:
  return isinstance(params, dict) and "lora" in params


def split(params: dict) -> tuple[dict, Adapters]:
  """(base, adapters) of a policy pytree with adapters."""
  return {k: v for k, v in params.items() if k != "lora"}, params["lora"]


def effective(params):
  """The plain parameters a forward computes with: merged when `params` carries adapters, else `params`."""
  return merge(*split(params)) if has_adapters(params) else params


def trainable(params):
  """What the learner differentiates and its optimiser holds: the adapters when there are any, else all."""
  return params["lora"] if has_adapters(params) else params


def with_trainable(params, new):
  """Inverse of `trainable`: `params` with its trainable part replaced by `new`."""
  return {**params, "lora": new} if has_adapters(params) else new


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
