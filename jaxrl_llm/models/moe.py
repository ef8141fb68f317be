"""Mixture-of-experts SwiGLU MLP: top-k router, capacity dispatch, load-balancing loss, routing replay.

Routing. Router logits are float32 `x @ router` ([B, T, E]). The k experts of a token are its top-k
logits, or, under routing replay (R3, methods-rl §8), the recorded `forced_ids_BTk`. Gating weights
are the softmax of the router logits *gathered at the selected ids* (renormalised over the k chosen
experts, Mixtral / Qwen3-MoE `norm_topk_prob`), so with replayed ids the router still gets gradients.

Capacity policy. Tokens are dispatched per batch row (one row = one group) with GShard-style one-hot
dispatch/combine einsums, which GSPMD partitions over the `expert` mesh axis (the expert weights are
sharded on E; each shard computes only its experts, and the combine reduces over E).
  - `capacity_factor == 0` (default): **dropless**. Capacity X = T, the most tokens of one row an
    expert can receive (a token picks an expert at most once), so no assignment is ever dropped and a
    token's output does not depend on the other tokens of its row: decode (T = 1) and the learner's
    full-sequence forward compute the same function. Cost: an O(T·E·X) dispatch tensor per row.
  - `capacity_factor > 0`: X = min(T, ceil(capacity_factor · T · k / E)). Slots are filled in
    choice-major order (every token's first choice before any second choice, then by position);
    assignments past X are dropped: they contribute 0 and the remaining gates are *not*
    renormalised (the residual stream carries the token). Drops depend on the other tokens in the
    row, so a sampler decoding one token at a time and a learner scoring the whole row can disagree:
    keep the dropless default for RL unless memory forces otherwise.

Load balancing (Switch Transformer): aux = E · Σ_e f_e · P_e over real tokens, with f_e the fraction of
(token, choice) assignments sent to expert e and P_e the mean router probability of e. It equals 1
for perfectly uniform routing and is differentiable through P_e only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def router_logits(x_BTD: Array, router_DE: Array) -> Array:
  """float32 router logits [B, T, E] (matmul in x's dtype, accumulated in float32)."""
  return jnp.einsum("btd,de->bte", x_BTD, router_DE.astype(x_BTD.dtype), preferred_element_type=jnp.float32)


def select_experts(logits_BTE: Array, k: int, forced_ids_BTk: Array | None = None) -> tuple[Array, Array]:
  """(ids_BTk int32, gates_BTk float32): top-k (or replayed) experts and their renormalised gates.

  The gates are softmax over the k logits gathered at the ids, i.e. the full softmax restricted to
  the chosen experts and renormalised; gradients reach the router through the gathered logits.
  """
  if forced_ids_BTk is None:
    _, ids_BTk = jax.lax.top_k(logits_BTE, k)
  else:
    ids_BTk = forced_ids_BTk
  ids_BTk = ids_BTk.astype(jnp.int32)
  gates_BTk = jax.nn.softmax(jnp.take_along_axis(logits_BTE, ids_BTk, axis=-1), axis=-1)
  return ids_BTk, gates_BTk


def capacity(T: int, k: int, E: int, capacity_factor: float) -> int:
  """Slots per expert per row: T when dropless (factor 0), else min(T, ceil(factor·T·k/E))."""
  if capacity_factor <= 0:
    return T
  return max(1, min(T, math.ceil(capacity_factor * T * k / E)))


def dispatch_masks(ids_BTk: Array, gates_BTk: Array, E: int, X: int) -> tuple[Array, Array]:
  """(dispatch_BTEX in {0,1}, combine_BTEX = gate at the token's slot) under capacity X.

  Slot of an assignment = how many earlier assignments (choice-major, then position) went to the
  same expert in this row; slots >= X are dropped.
  """
  B, T, k = ids_BTk.shape
  onehot_BkTE = jax.nn.one_hot(ids_BTk.swapaxes(1, 2), E, dtype=jnp.int32)  # choice-major order
  # Running count per expert over the assignments flattened choice-major ((k, T) -> k·T), minus one.
  slot_BkTE = (jnp.cumsum(onehot_BkTE.reshape(B, k * T, E), axis=1) - 1).reshape(B, k, T, E)
  slot_BkT = jnp.sum(slot_BkTE * onehot_BkTE, axis=-1)
  kept_BkT = slot_BkT < X
  slot_onehot_BkTX = jax.nn.one_hot(jnp.where(kept_BkT, slot_BkT, X), X, dtype=jnp.float32)  # dropped: all 0
  dispatch_BkTEX = onehot_BkTE.astype(jnp.float32)[..., None] * slot_onehot_BkTX[:, :, :, None, :]
  dispatch_BTEX = jnp.sum(dispatch_BkTEX, axis=1)
  combine_BTEX = jnp.einsum("bktex,bkt->btex", dispatch_BkTEX, gates_BTk.swapaxes(1, 2))
  return dispatch_BTEX, combine_BTEX


def load_balance_stats(logits_BTE: Array, ids_BTk: Array, real_BT: Array) -> tuple[Array, Array]:
  """(count_E, prob_sum_E) over real tokens: assignments per expert and summed router probabilities."""
  E = logits_BTE.shape[-1]
  real_BT = real_BT.astype(jnp.float32)
  count_E = jnp.einsum("btke,bt->e", jax.nn.one_hot(ids_BTk, E, dtype=jnp.float32), real_BT)
  prob_sum_E = jnp.einsum("bte,bt->e", jax.nn.softmax(logits_BTE, axis=-1), real_BT)
  return count_E, prob_sum_E


def load_balance_loss(count_E: Array, prob_sum_E: Array, k: int) -> Array:
  """Switch aux loss E · Σ_e f_e · P_e from `load_balance_stats` (1 when routing is uniform)."""
  E = count_E.shape[-1]
  n_tokens = jnp.maximum(jnp.sum(count_E) / k, 1.0)
  f_E = jax.lax.stop_gradient(count_E) / (n_tokens * k)
  return E * jnp.sum(f_E * prob_sum_E / n_tokens)


def moe_mlp(x_BTD: Array, p: dict, *, k: int, capacity_factor: float = 0.0, forced_ids_BTk: Array | None = None,
            real_BT: Array | None = None) -> tuple[Array, Array, Array]:
  """MoE SwiGLU block of one layer.

  Args:
    x_BTD: normed inputs (compute dtype).
    p: one layer's params with "router" [D, E], "w_gate"/"w_up" [E, D, F], "w_down" [E, F, D].
    k: experts per token.
    capacity_factor: 0 = dropless (see module docstring).
    forced_ids_BTk: replayed expert ids (R3); None = route natively.
    real_BT: 1 on tokens that count in the load-balancing statistics (default all).

  Returns:
    (y_BTD, ids_BTk, aux_loss): the block output, the expert ids used, the Switch aux loss.
  """
  B, T, _ = x_BTD.shape
  E = p["router"].shape[-1]
  logits_BTE = router_logits(x_BTD, p["router"])
  ids_BTk, gates_BTk = select_experts(logits_BTE, k, forced_ids_BTk)
  X = capacity(T, k, E, capacity_factor)
  dispatch_BTEX, combine_BTEX = dispatch_masks(ids_BTk, gates_BTk, E, X)
  dt = x_BTD.dtype
  xin_BEXD = jnp.einsum("btex,btd->bexd", dispatch_BTEX.astype(dt), x_BTD)
  gate_BEXF = jnp.einsum("bexd,edf->bexf", xin_BEXD, p["w_gate"])
  up_BEXF = jnp.einsum("bexd,edf->bexf", xin_BEXD, p["w_up"])
  out_BEXD = jnp.einsum("bexf,efd->bexd", jax.nn.silu(gate_BEXF) * up_BEXF, p["w_down"])
  y_BTD = jnp.einsum("btex,bexd->btd", combine_BTEX.astype(dt), out_BEXD)
  if real_BT is None:
    real_BT = jnp.ones((B, T), jnp.float32)
  aux = load_balance_loss(*load_balance_stats(logits_BTE, ids_BTk, real_BT), k)
  return y_BTD, ids_BTk, aux
