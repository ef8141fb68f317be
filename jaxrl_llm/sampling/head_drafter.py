"""A drafting head on the policy's last hidden states (EAGLE-style), for speculative decoding.

EAGLE (Li et al. 2024) drafts at the feature level: from the policy's final hidden state f_{t-1} at the token
before the last one and the embedding of the last token x_t, a small network predicts f_t, the policy's own
head turns it into the next-token distribution q_t, and the draft continues from (f̂_t, x̂_{t+1}). The head here is
that network without EAGLE's attention layer (so it keeps no KV cache and a request's state is one feature):

  x = W_fc · [f ; e(tok)]            W_fc [2D, D]
  f̂ = x + W_down · (silu(W_gate · n) ⊙ W_up · n),   n = rms_norm(x)

with the policy's embedding e and vocabulary head (read from the policy's parameters: not the drafter's, and
always the current policy's). f is the policy's final-normed hidden state, the one its head reads. The drafter's
parameters are `{"eagle": {...}}` (`is_head`): 2D² + 3·D·F + D, 3.3M at SmolLM2-135M's D = 576 with F = 1536.
Where it differs from EAGLE: no attention layer (the feature carries the context), and a request's first draft
call has no feature (the prefill returns logits, not hidden states), so it drafts from f = 0 and the token alone;
`distill.drafter.head_loss` trains that case as it runs. Whatever the head drafts, speculative decoding keeps the
policy's distribution (`sampling.speculative`): the head only sets the acceptance rate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import project, rms_norm, swiglu

Array = jax.Array


def init_head(model_cfg: ModelConfig, key: Array, d_ff: int | None = None) -> dict:
  """A fresh head of width D = `model_cfg.d_model` and MLP width F = `d_ff` (default the policy's `d_ff`):
  W_fc and the MLP's inputs normal with variance 1/fan-in, W_down zero (so at init f̂ = W_fc·[f; e]), float32."""
  D, F = model_cfg.d_model, d_ff or model_cfg.d_ff
  k_fc, k_gate, k_up = jax.random.split(key, 3)
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(shape[0])
  return {"eagle": {"fc_2DD": normal(k_fc, (2 * D, D)), "norm_D": jnp.ones((D,), jnp.float32),
                    "gate_DF": normal(k_gate, (D, F)), "up_DF": normal(k_up, (D, F)),
                    "down_FD": jnp.zeros((F, D), jnp.float32)}}


def is_head(draft_params) -> bool:
  """Whether a drafter's parameters are a head's (`init_head`), not a model of the policy's architecture."""
  return isinstance(draft_params, dict) and "eagle" in draft_params


def head_size(draft_params: dict) -> int:
  """The head's parameter count."""
  return sum(int(x.size) for x in jax.tree.leaves(draft_params["eagle"]))


def predict(draft_params: dict, feat_xD: Array, emb_xD: Array, model_cfg: ModelConfig) -> Array:
  """f̂ [..., D] from the previous feature `feat_xD` and the last token's embedding `emb_xD` (any leading axes)."""
  p = jax.tree.map(lambda w: w.astype(model_cfg.compute_dtype), draft_params["eagle"])
  x_xD = project(jnp.concatenate([feat_xD, emb_xD], axis=-1).astype(model_cfg.compute_dtype), p["fc_2DD"])
  return x_xD + swiglu(rms_norm(x_xD, p["norm_D"], model_cfg.rms_eps), p["gate_DF"], p["up_DF"], p["down_FD"])


def embed(policy_params: dict, tokens: Array, model_cfg: ModelConfig) -> Array:
  """The policy's embedding of `tokens`, in compute dtype."""
  return jnp.take(policy_params["embed"], tokens, axis=0).astype(model_cfg.compute_dtype)
