"""Llama/Qwen-style decoder as pure functions over a nested-dict parameter pytree.

Parameter layout (layers stacked on a leading L axis so one compiled body is scanned):

  embed [V, D]
  layers/ attn_norm [L, D]
          wq [L, D, H, hd]   wk, wv [L, D, K, hd]   wo [L, H, hd, D]
          bq [L, H, hd]      bk, bv [L, K, hd]        (only when cfg.attn_bias, Qwen2)
          q_norm, k_norm [L, hd]                      (only when cfg.qk_norm, Qwen3)
          mlp_norm [L, D]
          w_gate, w_up [L, D, F]   w_down [L, F, D]      (dense MLP, cfg.num_experts == 0)
          router [L, D, E]                            (MoE, cfg.num_experts == E > 0, instead:)
          w_gate, w_up [L, E, D, F]   w_down [L, E, F, D]
  final_norm [D]
  lm_head [D, V]                                      (absent when cfg.tie_embeddings)

Segment ids: equal ids attend to each other (causally); 0 marks padding. Positions are the RoPE
positions, so left-padded prompts (positions counted from the first real token) and packed rows
(positions restarting per segment) are both expressed by (positions_BT, segment_ids_BT).

MoE routing: `hidden_with_routing` also returns the expert ids each (token, layer) used,
`routes_BTLk`, and the load-balancing loss; passing `routes_BTLk` replays recorded ids (R3) instead
of routing natively. The cached path records the ids in the cache (`routes_LBSk`), so a sampler gets
the routes of every token it fed through the model.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models import cache as cache_lib
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models import moe as moe_lib
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import OutIn, attention, decode_attention, project, rms_norm, rope, swiglu

Array = jax.Array


class _Spec(NamedTuple):
  shape: tuple
  axes: tuple  # logical axis names, later mapped to mesh axes by sharding rules
  init: str  # "normal" | "ones" | "zeros"


def _param_specs(cfg: ModelConfig) -> dict:
  """Shape, logical axes and initialiser of every parameter: the single source of the layout."""
  V, D, L, H, K, hd, F = (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                          cfg.head_dim, cfg.d_ff)
  layers = {
      "attn_norm": _Spec((L, D), ("layers", "embed"), "ones"),
      "wq": _Spec((L, D, H, hd), ("layers", "embed", "heads", "head_dim"), "normal"),
      "wk": _Spec((L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "wv": _Spec((L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "wo": _Spec((L, H, hd, D), ("layers", "heads", "head_dim", "embed"), "normal"),
      "mlp_norm": _Spec((L, D), ("layers", "embed"), "ones"),
  }
  if cfg.is_moe:
    E = cfg.num_experts
    layers["router"] = _Spec((L, D, E), ("layers", "embed", "experts"), "normal")
    layers["w_gate"] = _Spec((L, E, D, F), ("layers", "experts", "embed", "mlp"), "normal")
    layers["w_up"] = _Spec((L, E, D, F), ("layers", "experts", "embed", "mlp"), "normal")
    layers["w_down"] = _Spec((L, E, F, D), ("layers", "experts", "mlp", "embed"), "normal")
  else:
    layers["w_gate"] = _Spec((L, D, F), ("layers", "embed", "mlp"), "normal")
    layers["w_up"] = _Spec((L, D, F), ("layers", "embed", "mlp"), "normal")
    layers["w_down"] = _Spec((L, F, D), ("layers", "mlp", "embed"), "normal")
  if cfg.attn_bias:
    layers["bq"] = _Spec((L, H, hd), ("layers", "heads", "head_dim"), "zeros")
    layers["bk"] = _Spec((L, K, hd), ("layers", "kv_heads", "head_dim"), "zeros")
    layers["bv"] = _Spec((L, K, hd), ("layers", "kv_heads", "head_dim"), "zeros")
  if cfg.qk_norm:
    layers["q_norm"] = _Spec((L, hd), ("layers", "head_dim"), "ones")
    layers["k_norm"] = _Spec((L, hd), ("layers", "head_dim"), "ones")
  specs = {
      "embed": _Spec((V, D), ("vocab", "embed"), "normal"),
      "layers": layers,
      "final_norm": _Spec((D,), ("embed",), "ones"),
  }
  if not cfg.tie_embeddings:
    specs["lm_head"] = _Spec((D, V), ("embed", "vocab"), "normal")
  return specs


def _is_spec(x) -> bool:
  return isinstance(x, _Spec)


def param_axes(cfg: ModelConfig) -> dict:
  """Pytree shaped like the params whose leaves are tuples of logical axis names."""
  return jax.tree.map(lambda s: s.axes, _param_specs(cfg), is_leaf=_is_spec)


def param_shapes(cfg: ModelConfig) -> dict:
  """Pytree shaped like the params whose leaves are `jax.ShapeDtypeStruct`s (no allocation)."""
  dtype = jnp.dtype(cfg.param_dtype)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), _param_specs(cfg), is_leaf=_is_spec)


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: ModelConfig, key: Array) -> dict:
  """Random parameters: normal(init_std) matrices, ones for norms, zeros for biases.

  All normal leaves are slices of one draw, in pytree order: one random-number program compiles
  several times faster than one per leaf. `jax.eval_shape(init_params, cfg, key)` (or
  `param_shapes`) gives the layout without allocating.
  """
  dtype = jnp.dtype(cfg.param_dtype)
  specs, treedef = jax.tree.flatten(_param_specs(cfg), is_leaf=_is_spec)
  sizes = [math.prod(s.shape) if s.init == "normal" else 0 for s in specs]
  draw = cfg.init_std * jax.random.normal(key, (sum(sizes),), jnp.float32)
  offsets = itertools.accumulate(sizes, initial=0)
  leaves = []
  for spec, size, offset in zip(specs, sizes, offsets):
    if spec.init == "normal":
      leaves.append(draw[offset:offset + size].reshape(spec.shape).astype(dtype))
    else:
      leaves.append((jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, dtype))
  return jax.tree.unflatten(treedef, leaves)


def init_params_per_leaf(cfg: ModelConfig, key: Array) -> dict:
  """Random parameters like `init_params`, but leaf i is drawn from `fold_in(key, i)` (pytree order).

  Each leaf is its own (counter-based, partitionable) random program, so under
  `jax.jit(..., out_shardings=...)` every device generates only its shard: this is the sharded
  init (`jaxrl_llm.sharding.init_params_sharded`). Its values are the same on every mesh, but
  differ from `init_params` (one draw sliced into leaves, which the partitioner must replicate).
  """
  dtype = jnp.dtype(cfg.param_dtype)
  specs, treedef = jax.tree.flatten(_param_specs(cfg), is_leaf=_is_spec)
  leaves = []
  for i, spec in enumerate(specs):
    if spec.init == "normal":
      draw = cfg.init_std * jax.random.normal(jax.random.fold_in(key, i), spec.shape, jnp.float32)
      leaves.append(draw.astype(dtype))
    else:
      leaves.append((jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, dtype))
  return jax.tree.unflatten(treedef, leaves)


def lm_head_weights(params: dict, cfg: ModelConfig) -> Array:
  """The [D, V] output projection in compute dtype (the transposed embedding when tied)."""
  w_DV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  return w_DV.astype(cfg.compute_dtype)


# Rows (B·T) for which a decode view multiplies its vocabulary head output-major: at 4-48 rows w_VD @ x_DM ran
# about 2-2.5x faster than x_MD @ w_DV on XLA:CPU, at 1 and 64 rows no faster (`bench/decode_matmul.py --head`).
HEAD_OUT_MAJOR_ROWS = (2, 48)


def logits_from_hidden(params: dict, h_BTD: Array, cfg: ModelConfig) -> Array:
  """float32 logits [B, T, V] from final-normed hidden states (matmul accumulated in float32); a decode view's
  output-major head (`unstack_layers`) for `HEAD_OUT_MAJOR_ROWS` rows."""
  h_BTD = h_BTD.astype(cfg.compute_dtype)
  head, (lo, hi) = params.get("head_out_major"), HEAD_OUT_MAJOR_ROWS
  if head is not None and lo <= math.prod(h_BTD.shape[:-1]) <= hi:
    return project(h_BTD, head, preferred_element_type=jnp.float32)
  return project(h_BTD, lm_head_weights(params, cfg), preferred_element_type=jnp.float32)


def _qkv(x_BTD: Array, p: dict, positions_BT: Array, cfg: ModelConfig, q0: int = 0) -> tuple[Array, Array, Array]:
  """Projects normed inputs to RoPE-rotated queries (of positions >= q0 only) and keys/values (all)."""
  q_BTHd = project(x_BTD[:, q0:], p["wq"])
  k_BTKd, v_BTKd = project(x_BTD, p["wk"]), project(x_BTD, p["wv"])
  if cfg.attn_bias:
    q_BTHd, k_BTKd, v_BTKd = q_BTHd + p["bq"][None, None], k_BTKd + p["bk"][None, None], v_BTKd + p["bv"][None, None]
  if cfg.qk_norm:
    q_BTHd = rms_norm(q_BTHd, p["q_norm"], cfg.rms_eps)
    k_BTKd = rms_norm(k_BTKd, p["k_norm"], cfg.rms_eps)
  return rope(q_BTHd, positions_BT[:, q0:], cfg.rope_theta), rope(k_BTKd, positions_BT, cfg.rope_theta), v_BTKd


def _mlp(x_BTD: Array, p: dict, cfg: ModelConfig, forced_ids_BTk: Array | None,
         real_BT: Array) -> tuple[Array, dict]:
  """The MLP block: dense SwiGLU, or MoE returning its routing ({"ids_BTk", "aux"})."""
  if not cfg.is_moe:
    return swiglu(x_BTD, p["w_gate"], p["w_up"], p["w_down"]), {}
  y_BTD, ids_BTk, aux = moe_lib.moe_mlp(x_BTD, p, k=cfg.experts_per_token, capacity_factor=cfg.capacity_factor,
                                        forced_ids_BTk=forced_ids_BTk, real_BT=real_BT)
  return y_BTD, {"ids_BTk": ids_BTk, "aux": aux}


def _finish_layer(h_BTD: Array, attn_BTHd: Array, p: dict, cfg: ModelConfig, forced_ids_BTk: Array | None = None,
                  real_BT: Array | None = None) -> tuple[Array, dict]:
  """Attention output projection + residual, then the MLP block + residual; returns (h, routing)."""
  B, T, H, hd = attn_BTHd.shape
  wo = p["wo"] if isinstance(p["wo"], OutIn) else p["wo"].reshape(H * hd, -1)  # the decode view's is output-major
  h_BTD = h_BTD + project(attn_BTHd.reshape(B, T, H * hd), wo)
  x_BTD = rms_norm(h_BTD, p["mlp_norm"], cfg.rms_eps)
  y_BTD, routing = _mlp(x_BTD, p, cfg, forced_ids_BTk, real_BT)
  return h_BTD + y_BTD, routing


def _remat(fn, cfg: ModelConfig):
  """Wraps a layer body per `cfg.remat`; replayed routes are scan inputs, so recompute reuses them."""
  if cfg.remat == "auto":
    raise ValueError("model.remat='auto' is decided by a run from its estimated step memory "
                     "(`policy_init.resolve_remat`); a model built directly needs False/'none', True/'full' or 'dots'")
  if cfg.remat in (True, "full"):
    return jax.checkpoint(fn)
  if cfg.remat == "dots":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.checkpoint_dots)
  return fn


def _layer_routes(routes_BTLk: Array | None) -> Array | None:
  """[B, T, L, k] -> [L, B, T, k] so the layer scan slices one layer's ids."""
  return None if routes_BTLk is None else jnp.moveaxis(routes_BTLk, 2, 0)


def _routing_out(routing_L: dict) -> dict:
  """Per-layer routing stacked by the scan -> {"routes_BTLk", "router_aux_loss" (mean over layers)}."""
  if not routing_L:
    return {}
  return {"routes_BTLk": jnp.moveaxis(routing_L["ids_BTk"], 0, 2), "router_aux_loss": jnp.mean(routing_L["aux"])}


def _embed(params: dict, tokens_BT: Array) -> Array:
  return jnp.take(params["embed"], tokens_BT, axis=0)


def _cast(params: dict, cfg: ModelConfig) -> dict:
  """The params in compute dtype; a policy with LoRA adapters carries them along the layer scan, where each layer
  body merges its own (`lora.scan_view`, `lora.merge_layer`)."""
  if lora_lib.has_adapters(params):
    return lora_lib.scan_view(params, cfg.compute_dtype)
  return jax.tree.map(lambda x: x.astype(cfg.compute_dtype), params)


def _defaults(tokens_BT: Array, positions_BT, segment_ids_BT) -> tuple[Array, Array]:
  B, T = tokens_BT.shape
  if positions_BT is None:
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  if segment_ids_BT is None:
    segment_ids_BT = jnp.ones((B, T), jnp.int32)
  return positions_BT, segment_ids_BT


def hidden_with_routing(params: dict, tokens_BT: Array, cfg: ModelConfig, *, positions_BT: Array | None = None,
                        segment_ids_BT: Array | None = None, perturb: tuple[Array, Array] | None = None,
                        routes_BTLk: Array | None = None, mask_BTT: Array | None = None,
                        query_start: int = 0) -> tuple[Array, dict]:
  """Final-normed hidden states [B, T, D] in compute dtype, and the MoE routing.

  Args:
    params: parameter pytree (any dtype; cast to cfg.dtype here).
    tokens_BT: int token ids.
    cfg: model config (static).
    positions_BT: RoPE positions; default arange(T) in every row.
    segment_ids_BT: attention segments (0 = padding); default all ones.
    perturb: optional ALP noise `(log_sigma_L, key)`: before layer l's input norm the residual stream
      gets `exp(log_sigma_L[l]) * normal(fold_in(key, l))`, differentiable in log_sigma_L.
    routes_BTLk: MoE only: int expert ids to replay (R3) for every token and layer; None = route
      natively. Gates are the current router's softmax at these ids (the router keeps its gradient).
    mask_BTT: optional explicit attention mask (True = query t may attend to key s) replacing the
      causal segment mask, e.g. the block masks of packed tree replays (distill/memory_walker.py);
      every row must allow at least its own position.
    query_start: static; only positions >= query_start need hidden states (e.g. the completion of a
      scored rollout). A dense model's last layer then keeps keys and values of every position but
      computes queries, attention output and MLP only from there on (the others feed nothing). The
      result is the same as slicing the full output; MoE models compute everything and slice.

  Returns:
    (h_BTD, routing): h for positions query_start..T-1; routing is {} for a dense model, else
    {"routes_BTLk": ids used (int32, all T positions), "router_aux_loss": Switch load-balancing loss
    over non-padding tokens, mean over layers}.
  """
  positions_BT, segment_ids_BT = _defaults(tokens_BT, positions_BT, segment_ids_BT)
  p = _cast(params, cfg)
  if mask_BTT is None:
    mask_BTT = cache_lib.attention_mask(segment_ids_BT, segment_ids_BT)
  real_BT = segment_ids_BT > 0

  def layer(h_BTD, xs, q0=0):
    """One layer; with q0 > 0 only positions >= q0 get outputs (keys/values still cover all)."""
    p_l, l, forced_ids_BTk = xs
    p_l = lora_lib.merge_layer(p_l, cfg.compute_dtype)
    if perturb is not None:
      log_sigma_L, key = perturb
      noise_BTD = jax.random.normal(jax.random.fold_in(key, l), h_BTD.shape, jnp.float32)
      h_BTD = h_BTD + (jnp.exp(log_sigma_L[l]) * noise_BTD).astype(h_BTD.dtype)
    q_BTHd, k_BTKd, v_BTKd = _qkv(rms_norm(h_BTD, p_l["attn_norm"], cfg.rms_eps), p_l, positions_BT, cfg, q0)
    attn_BTHd = attention(q_BTHd, k_BTKd, v_BTKd, mask_BTT[:, q0:])
    return _finish_layer(h_BTD[:, q0:], attn_BTHd, p_l, cfg, forced_ids_BTk, real_BT[:, q0:])

  xs = (p["layers"], jnp.arange(cfg.n_layers), _layer_routes(routes_BTLk))
  h_BTD = _embed(p, tokens_BT)
  if query_start and not cfg.is_moe:  # the last layer separately, outputs from query_start on
    # The other layers index the stacked weights inside the scan. As the scan's inputs, `x[:-1]` of each stacked
    # weight was a copy of all but one layer at every call (0.41 GiB of XLA temps for SmolLM2-135M's scoring).
    at = lambda l: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, l, keepdims=False), xs)
    if cfg.n_layers > 1:
      h_BTD, _ = jax.lax.scan(_remat(lambda h, l: layer(h, at(l)), cfg), h_BTD, jnp.arange(cfg.n_layers - 1),
                              unroll=min(cfg.layer_unroll, cfg.n_layers - 1))
    h_BTD, _ = _remat(functools.partial(layer, q0=query_start), cfg)(h_BTD, jax.tree.map(lambda x: x[-1], xs))
    return rms_norm(h_BTD, p["final_norm"], cfg.rms_eps), {}
  h_BTD, routing_L = jax.lax.scan(_remat(layer, cfg), h_BTD, xs, unroll=cfg.layer_unroll)
  return rms_norm(h_BTD[:, query_start:], p["final_norm"], cfg.rms_eps), _routing_out(routing_L)


def hidden_shared_prefix(params: dict, tokens_BT: Array, cfg: ModelConfig, *, prefix_len: int, group_size: int,
                         positions_BT: Array | None = None, segment_ids_BT: Array | None = None) -> Array:
  """`hidden_with_routing(..., query_start=prefix_len - 1)[0]` when rows g·G .. g·G+G-1 share their
  first `prefix_len` columns (tokens, positions, segments): the prefix runs once per group.

  Why: the G completions of a GRPO group share one prompt, so its keys and values are the same for
  each of them. Each layer computes the prefix of B/G rows and the suffix (columns prefix_len..T-1)
  of B rows; suffix queries attend to their group's prefix keys/values (segment rule as usual) and
  causally to their own. Dense models only (MoE routing has its own per-call capacity). The caller
  guarantees the shared layout (see `logprobs.token_logprobs_shared`, which checks it on device);
  differentiable: the prefix's gradient sums over the G rows that read it.

  Returns the final-normed hidden states [B, T - prefix_len + 1, D] of positions prefix_len-1 .. T-1.
  """
  if cfg.is_moe:
    raise ValueError("hidden_shared_prefix: dense models only (MoE capacity depends on the call's tokens)")
  B, T = tokens_BT.shape
  G, Pp = group_size, prefix_len
  if B % G or not 0 < Pp < T:
    raise ValueError(f"hidden_shared_prefix: group_size={G} must divide B={B} and 0 < prefix_len={Pp} < T={T}")
  positions_BT, segment_ids_BT = _defaults(tokens_BT, positions_BT, segment_ids_BT)
  p = _cast(params, cfg)
  pos_bP, seg_bP = positions_BT[::G, :Pp], segment_ids_BT[::G, :Pp]
  pos_BN, seg_BN = positions_BT[:, Pp:], segment_ids_BT[:, Pp:]
  mask_bPP = cache_lib.attention_mask(seg_bP, seg_bP)
  # Response queries: their group's prompt prefix (no causal limit: it precedes them), then causally their own columns.
  to_prefix_BNP = seg_BN[:, :, None] == jnp.repeat(seg_bP, G, axis=0)[:, None, :]
  mask_BNS = jnp.concatenate([to_prefix_BNP, cache_lib.attention_mask(seg_BN, seg_BN)], axis=2)

  def layer(h, p_l):
    h_bPD, h_BND = h
    p_l = lora_lib.merge_layer(p_l, cfg.compute_dtype)
    q_bPHd, k_bPKd, v_bPKd = _qkv(rms_norm(h_bPD, p_l["attn_norm"], cfg.rms_eps), p_l, pos_bP, cfg)
    q_BNHd, k_BNKd, v_BNKd = _qkv(rms_norm(h_BND, p_l["attn_norm"], cfg.rms_eps), p_l, pos_BN, cfg)
    k_BSKd = jnp.concatenate([jnp.repeat(k_bPKd, G, axis=0), k_BNKd], axis=1)
    v_BSKd = jnp.concatenate([jnp.repeat(v_bPKd, G, axis=0), v_BNKd], axis=1)
    h_bPD, _ = _finish_layer(h_bPD, attention(q_bPHd, k_bPKd, v_bPKd, mask_bPP), p_l, cfg)
    h_BND, _ = _finish_layer(h_BND, attention(q_BNHd, k_BSKd, v_BSKd, mask_BNS), p_l, cfg)
    return (h_bPD, h_BND), None

  h0 = (_embed(p, tokens_BT[::G, :Pp]), _embed(p, tokens_BT[:, Pp:]))
  (h_bPD, h_BND), _ = jax.lax.scan(_remat(layer, cfg), h0, p["layers"], unroll=cfg.layer_unroll)
  # The last prompt position (its output scores the first response token), then the response positions.
  return rms_norm(jnp.concatenate([jnp.repeat(h_bPD[:, -1:], G, axis=0), h_BND], axis=1), p["final_norm"], cfg.rms_eps)


def hidden(params: dict, tokens_BT: Array, cfg: ModelConfig, *, positions_BT: Array | None = None,
           segment_ids_BT: Array | None = None, perturb: tuple[Array, Array] | None = None,
           routes_BTLk: Array | None = None, mask_BTT: Array | None = None) -> Array:
  """Final-normed hidden states [B, T, D] in compute dtype (what the lm-head consumes).

  Same arguments as `hidden_with_routing`, which also returns the MoE routing.
  """
  return hidden_with_routing(params, tokens_BT, cfg, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                             perturb=perturb, routes_BTLk=routes_BTLk, mask_BTT=mask_BTT)[0]


def forward(params: dict, tokens_BT: Array, cfg: ModelConfig, *, positions_BT: Array | None = None,
            segment_ids_BT: Array | None = None, perturb: tuple[Array, Array] | None = None,
            routes_BTLk: Array | None = None) -> Array:
  """Full-vocabulary float32 logits [B, T, V]; same arguments as `hidden`.

  This materialises [B, T, V]: training uses `token_logprobs` (chunked lm-head) instead.
  """
  h_BTD = hidden(params, tokens_BT, cfg, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                 perturb=perturb, routes_BTLk=routes_BTLk)
  return logits_from_hidden(params, h_BTD, cfg)


def unstack_layers(params: dict, cfg: ModelConfig) -> dict:
  """A decode-loop view of the params: compute dtype, `layers` a tuple of per-layer dicts.

  Why: the layer scan slices each layer's weights out of the stacked arrays, and inside a decode
  loop XLA:CPU copied those slices again at every step; built once before the loop, every step
  reads the weights in place. `hidden_with_cache` accepts either layout; the math is the same. The
  dense projections and the vocabulary head ("head_out_major", `logits_from_hidden`) are also held
  output-major (`layers.OutIn`).
  """
  p = _cast(lora_lib.effective(params), cfg)  # LoRA: merged once, before the loop
  layers = tuple(_output_major(jax.tree.map(lambda x, l=l: x[l], p["layers"]), cfg) for l in range(cfg.n_layers))
  # the head output-major too: the tied embedding as it is ([V, D]), an untied head transposed once per call
  head = OutIn(p["embed"], p["embed"].shape[:1]) if cfg.tie_embeddings else OutIn.of(p["lm_head"])
  return {**p, "layers": layers, "head_out_major": head}


# The dense projections of a layer and how many leading axes of each are its input.
_DENSE_IN_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2}
_MLP_IN_AXES = {"w_gate": 1, "w_up": 1, "w_down": 1}


def _out_major_axes(cfg: ModelConfig) -> dict:
  return _DENSE_IN_AXES if cfg.is_moe else {**_DENSE_IN_AXES, **_MLP_IN_AXES}


def decode_view_copies(cfg: ModelConfig) -> tuple[str, ...]:
  """The layer weights `unstack_layers` copies output-major (its memory: `memory.decode_view_bytes`); an untied
  head ("lm_head") is copied too, a tied one is used as it is."""
  return tuple(_out_major_axes(cfg))


def _output_major(p_l: dict, cfg: ModelConfig) -> dict:
  """One layer of the decode view with its dense projections output-major (`layers.OutIn`: a decode step's
  few-row matmuls run faster so); an MoE layer's experts stay as they are."""
  axes = _out_major_axes(cfg)
  return {k: OutIn.of(w, axes[k]) if k in axes else w for k, w in p_l.items()}


# Per cache array: its permutation from the model's layout ([B, S, K, hd] per layer; scales [B, S, K]) to the decode
# loop's (keys [B, K, hd, S], values [B, K, S, hd], scales [B, K, S]), and its slot axis there.
_DECODE_LAYOUT = {"k": ((0, 2, 3, 1), 3), "v": ((0, 2, 1, 3), 2), "k_scale": ((0, 2, 1), 2), "v_scale": ((0, 2, 1), 2)}


def _to_decode_layout(name: str, x: Array) -> Array:
  return jnp.transpose(x, _DECODE_LAYOUT[name][0])


def unstack_cache(cache: dict, slots: int | None = None) -> dict:
  """The decode-loop view of a cache: `k`, `v` as tuples of per-layer arrays in the "decode" layout
  of `layers.decode_attention` (keys [B, K, hd, S], values [B, K, S, hd]); `slots`: widened to that many
  slots (`cache.widen`), each layer padded as it is transposed.

  Why: each layer's keys/values are their own loop-carried buffer, updated in place, and in the
  layout `layers.decode_attention` streams (each sum over the outer axis), so no decode step copies or
  transposes the cache.
  """
  slots = slots or cache["segment_ids_BS"].shape[1]
  return {**cache_lib.widen(cache, slots, kv=False),
          **{n: tuple(cache_lib.pad_slots(_to_decode_layout(n, x), _DECODE_LAYOUT[n][1], slots, cache_lib.EMPTY_SLOT[n])
                      for x in cache[n]) for n in _DECODE_LAYOUT if n in cache}}


def stack_cache(cache: dict) -> dict:
  """Inverse of `unstack_cache` (a no-op on a stacked cache)."""
  if not isinstance(cache["k"], tuple):
    return cache
  back = lambda n: tuple(_DECODE_LAYOUT[n][0].index(a) for a in range(len(_DECODE_LAYOUT[n][0])))  # the inverse
  return {**cache, **{n: jnp.stack([jnp.transpose(x, back(n)) for x in cache[n]])
                      for n in _DECODE_LAYOUT if n in cache}}


def decode_view(params: dict, cache: dict, cfg: ModelConfig, slots: int | None = None) -> tuple[dict, dict]:
  """(params, cache) for a decode loop: unstacked (`unstack_layers`, `unstack_cache`) with `cfg.decode_unroll`
  (the default, whatever `layer_unroll` says: a rolled scan's per-layer slices were copied at every step), else
  unchanged (the layer scan: one compiled layer body). `stack_cache` turns the cache back after the loop.
  `slots`: the cache widened to that many slots on the way (`cache.widen`)."""
  if not cfg.decode_unroll:
    return params, cache_lib.widen(cache, slots)
  return unstack_layers(params, cfg), unstack_cache(cache, slots)


def hidden_with_cache(params: dict, tokens_BT: Array, cache: dict, cfg: ModelConfig, *,
                      positions_BT: Array, segment_ids_BT: Array | None = None,
                      kv_window: tuple[int, int] | None = None,
                      kv_ring: tuple[int, int, int] | None = None) -> tuple[Array, dict]:
  """Appends T tokens at the cache's write index; returns their final-normed hidden states.

  The new tokens attend to every earlier slot of their segment and causally within the chunk
  (see `jaxrl_llm.models.cache`). Prefill is a call with the whole prompt, decode one with T=1.
  `params` and `cache` may be stacked (a layer scan) or unstacked (`unstack_layers` and
  `unstack_cache`, a Python loop over layers, for decode loops); the math is the same.
  Compressed caches (the sampler's `kv_cache`): an int8 cache (`init_cache(kv_dtype="int8")`, either
  layout) stores the new keys/values quantised and attends to the dequantised slots; `kv_window=(sinks,
  window)` (static) further restricts every query to the sinks and its sliding window
  (`cache.window_visible`), prefill included, so the learner's shadow forward with
  `cache.window_attention_mask` sees exactly the same keys. `kv_ring=(start, sinks, window)` (static, with that
  window): the cache is a ring buffer (`cache.ring_layout`): keys, values, positions and segments go to
  `cache.write_slot` (MoE routes stay in time order) and causality is by position (`cache.position_mask`).
  """
  _, segment_ids_BT = _defaults(tokens_BT, positions_BT, segment_ids_BT)
  p = _cast(params, cfg)
  index = cache["index"]
  slot = cache_lib.write_slot(index, kv_ring)
  cache = cache_lib.write_metadata(cache, positions_BT, segment_ids_BT, slot)
  if kv_ring is None:
    mask_BTS = cache_lib.attention_mask(segment_ids_BT, cache["segment_ids_BS"], q_offset=index)
  else:
    mask_BTS = cache_lib.position_mask(positions_BT, segment_ids_BT, cache["positions_BS"], cache["segment_ids_BS"])
  if kv_window is not None:
    sinks, window = kv_window
    mask_BTS = mask_BTS & cache_lib.window_visible(positions_BT[:, :, None], cache["positions_BS"][:, None, :],
                                                   sinks, window)

  unstacked = isinstance(p["layers"], tuple)
  quantized = "k_scale" in cache
  names = ("k", "v", "k_scale", "v_scale") if quantized else ("k", "v")

  def new_entries(h_BTD, p_l):
    """(the layer's merged weights, its queries, and what its new tokens add to the cache: keys and values [B, T,
    K, hd], int8 with their scales [B, T, K] for an int8 cache)."""
    p_l = lora_lib.merge_layer(p_l, cfg.compute_dtype)
    q_BTHd, k_BTKd, v_BTKd = _qkv(rms_norm(h_BTD, p_l["attn_norm"], cfg.rms_eps), p_l, positions_BT, cfg)
    if not quantized:
      return p_l, q_BTHd, {"k": k_BTKd, "v": v_BTKd}
    (kq_BTKd, ks_BTK), (vq_BTKd, vs_BTK) = cache_lib.quantize_kv(k_BTKd), cache_lib.quantize_kv(v_BTKd)
    return p_l, q_BTHd, {"k": kq_BTKd, "v": vq_BTKd, "k_scale": ks_BTK, "v_scale": vs_BTK}

  def finish(h_BTD, attn_BTHd, p_l):
    return _finish_layer(h_BTD, attn_BTHd, p_l, cfg, real_BT=segment_ids_BT > 0)

  h_BTD = _embed(p, tokens_BT)
  if unstacked:  # each layer's own buffers: keys [B, K, hd, S], values [B, K, S, hd], scales [B, K, S]
    written, ids = {n: [] for n in names}, []
    for l, p_l in enumerate(p["layers"]):
      p_l, q_BTHd, new = new_entries(h_BTD, p_l)
      buf = {n: jax.lax.dynamic_update_slice_in_dim(cache[n][l], _to_decode_layout(n, new[n]).astype(
          cache[n][l].dtype), slot, axis=_DECODE_LAYOUT[n][1]) for n in names}
      scales = (buf["k_scale"], buf["v_scale"], cfg.compute_dtype) if quantized else ()  # outside the sums
      h_BTD, routing = finish(h_BTD, decode_attention(q_BTHd, buf["k"], buf["v"], mask_BTS, *scales), p_l)
      for n in names:
        written[n].append(buf[n])
      ids.append(routing.get("ids_BTk"))
    kv = {n: tuple(written[n]) for n in names}
    ids_LBTk = None if ids[0] is None else jnp.stack(ids)
  else:
    # The stacked cache rides in the scan's carry and each layer writes its new slots in place. (As the scan's
    # outputs, the layers' caches were a second whole cache beside the input at every decode step.)
    def layer(carry, xs):
      h_BTD, kv = carry
      p_l, l = xs
      p_l, q_BTHd, new = new_entries(h_BTD, p_l)
      kv = {n: jax.lax.dynamic_update_slice(kv[n], new[n][None].astype(kv[n].dtype), (l, 0, slot) + (0,) * (
          kv[n].ndim - 3)) for n in names}
      at = {n: jax.lax.dynamic_index_in_dim(kv[n], l, keepdims=False) for n in names}
      if quantized:  # [B, S, K, hd] read back dequantised
        k_BSKd = cache_lib.dequantize_kv(at["k"], at["k_scale"], cfg.compute_dtype)
        v_BSKd = cache_lib.dequantize_kv(at["v"], at["v_scale"], cfg.compute_dtype)
      else:
        k_BSKd, v_BSKd = at["k"], at["v"]
      h_BTD, routing = finish(h_BTD, attention(q_BTHd, k_BSKd, v_BSKd, mask_BTS), p_l)
      return (h_BTD, kv), routing.get("ids_BTk")

    layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
    (h_BTD, kv), ids_LBTk = jax.lax.scan(layer, (h_BTD, {n: cache[n] for n in names}), (p["layers"], layer_ids),
                                         unroll=cfg.layer_unroll)
  cache = {**cache, **kv}
  if ids_LBTk is not None:  # MoE: record the routes of the new tokens (R3)
    cache["routes_LBSk"] = jax.lax.dynamic_update_slice_in_dim(cache["routes_LBSk"], ids_LBTk, index, axis=2)
  return rms_norm(h_BTD, p["final_norm"], cfg.rms_eps), cache


def forward_with_cache(params: dict, tokens_BT: Array, cache: dict, cfg: ModelConfig, *,
                       positions_BT: Array, segment_ids_BT: Array | None = None,
                       kv_window: tuple[int, int] | None = None,
                       kv_ring: tuple[int, int, int] | None = None) -> tuple[Array, dict]:
  """Like `hidden_with_cache` but returns float32 logits [B, T, V] and the updated cache."""
  h_BTD, cache = hidden_with_cache(params, tokens_BT, cache, cfg, positions_BT=positions_BT,
                                   segment_ids_BT=segment_ids_BT, kv_window=kv_window, kv_ring=kv_ring)
  return logits_from_hidden(params, h_BTD, cfg), cache
