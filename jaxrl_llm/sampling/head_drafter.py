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

A reduced draft vocabulary (`sampler.spec_head_vocab` = K > 0; EAGLE-3's `draft_vocab_size`, FR-Spec's
frequency-ranked subset): the head drafts over the K tokens the policy sampled most often so far (`with_vocab`, the
distillation's counts), through the K matching columns of the policy's head, so a draft reads D·K head weights
instead of D·V (at SmolLM2, 49,152 columns: 113 MB in float32 per drafted token). Its q is zero off the subset,
which speculative sampling handles exactly (a token outside is never drafted; the residual max(0, p − q) covers it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import project, rms_norm, swiglu
from jaxrl_llm.models.transformer import lm_head_weights, logits_from_hidden

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


def vocab(draft_params: dict) -> Array | None:
  """The head's draft vocabulary (sorted token ids `vocab_K`, `with_vocab`), or None: the whole vocabulary."""
  return draft_params.get("vocab_K")


def top_vocab(counts_V: Array, k: int) -> Array:
  """The ids of the `k` largest counts, sorted (ties: the lower id first, so no counts give ids 0 .. k-1)."""
  return jnp.sort(jax.lax.top_k(counts_V, k)[1]).astype(jnp.int32)


def with_vocab(draft_params: dict, counts_V: Array, k: int) -> dict:
  """The head as the sampler drafts with it: with k > 0, over the `top_vocab(counts_V, k)` token ids."""
  return {**draft_params, "vocab_K": top_vocab(counts_V, k)} if k else draft_params


def logits(policy_params: dict, feat_xD: Array, vocab_K: Array | None, model_cfg: ModelConfig) -> Array:
  """float32 logits of predicted features through the policy's head: over the whole vocabulary [..., V] (None), or
  over `vocab_K`'s columns only [..., K]."""
  if vocab_K is None:
    return logits_from_hidden(policy_params, feat_xD, model_cfg)
  w_DK = jnp.take(lm_head_weights(policy_params, model_cfg), vocab_K, axis=1)
  return project(feat_xD.astype(model_cfg.compute_dtype), w_DK, preferred_element_type=jnp.float32)
