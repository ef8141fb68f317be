"""What the sampler records about μ beyond the sampled token: its top-k and Monte-Carlo candidates.

μ is the distribution each token was actually drawn from (`sample.sample_token`): the tempered softmax,
renormalised over the top-k / top-p candidates when the sampler truncates (tokens it drops have log μ =
-inf), and the temperature-1 softmax when greedy (the convention `behavior_logp` follows there). Both
records are optional (`SamplerConfig.behavior_topk`, `SamplerConfig.mc_samples`) and written column by
column in the decode loop next to the token (`sampler.emit_token`):

  behavior_topk_ids_BNk, behavior_topk_logp_BNk   μ's k most likely ids, descending (ties: lower id
      first, `lax.top_k`), and log μ of them. DPPO's top-k divergence (Stable-RL records vLLM's top-20
      logprobs of the sampling distribution), S²D-OPD's student candidate set V_K(s_t).
  mc_ids_BNJ, mc_behavior_logp_BNJ   J candidates: column 0 the sampled token (its log μ is
      `behavior_logp` itself), columns 1..J-1 drawn i.i.d. from μ with replacement (duplicates kept, as
      AsyncOPD's `multi_sample_policy_gradient_kl` expects), and log μ of each.

The candidates draw from their own key, `fold_in(step key, MC_STREAM)`, candidate j from
`fold_in(that, j)`: recording never changes the sampled tokens, and equal keys give equal candidates. With one
key per row (continuous batching) the step key is the row's, `fold_in(row key, column)` (`record_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.sampling.config import SamplerConfig
from jaxrl_llm.sampling.sample import truncate

Array = jax.Array

MC_STREAM = 0x4D43  # folded into a decode step's key for its Monte-Carlo candidates ("MC")

# Output / carry names of the records, by option.
TOPK_FIELDS = ("behavior_topk_ids_BNk", "behavior_topk_logp_BNk")
MC_FIELDS = ("mc_ids_BNJ", "mc_behavior_logp_BNJ")


def behavior_logprobs(logits_BV: Array, cfg: SamplerConfig) -> Array:
  """[B, V] float32 log μ over the whole vocabulary (-inf outside a truncated draw's candidates)."""
  logits_BV = logits_BV.astype(jnp.float32)
  if cfg.temperature == 0:
    return jax.nn.log_softmax(logits_BV, axis=-1)
  scaled_BV = logits_BV / cfg.temperature
  if not cfg.truncated:
    return jax.nn.log_softmax(scaled_BV, axis=-1)
  vals_BK, ids_BK = truncate(scaled_BV, cfg)
  rows_B1 = jnp.arange(scaled_BV.shape[0])[:, None]
  return jnp.full(scaled_BV.shape, -jnp.inf, jnp.float32).at[rows_B1, ids_BK].set(jax.nn.log_softmax(vals_BK, axis=-1))


def draw_candidates(key: Array, logmu_BV: Array, count: int) -> Array:
  """[B, count] int32 ids drawn i.i.d. from exp(logmu_BV) with replacement; draw j uses `fold_in(key, j + 1)`
  (column j + 1 of `mc_ids_BNJ`). One [B, V] Gumbel draw at a time: no [count, B, V] array."""
  draw = lambda j: jax.random.categorical(jax.random.fold_in(key, j), logmu_BV, axis=-1)
  return jnp.moveaxis(jax.lax.map(draw, jnp.arange(1, count + 1)), 0, 1).astype(jnp.int32)


def record(logits_BV: Array, token_B: Array, logp_B: Array, key: Array, cfg: SamplerConfig) -> dict:
  """The records of one decode column (names in `TOPK_FIELDS` / `MC_FIELDS`, each [B, k|J]).

  `token_B`, `logp_B`: what `sample_token` returned for these logits; `key`: the column's step key.
  """
  logmu_BV = behavior_logprobs(logits_BV, cfg)
  at = lambda ids_B_: jnp.take_along_axis(logmu_BV, ids_B_, axis=-1)
  out = {}
  if cfg.behavior_topk:
    V = logits_BV.shape[-1]
    if cfg.behavior_topk > V:
      raise ValueError(f"sampler.behavior_topk={cfg.behavior_topk}: more than the vocabulary of {V} tokens")
    # Sorted by tempered logit (the order `truncate` ranks candidates in) = by μ; tokens a truncated draw
    # drops follow in logit order with log μ = -inf.
    scaled_BV = logits_BV.astype(jnp.float32) / (cfg.temperature or 1.0)
    _, ids_Bk = jax.lax.top_k(scaled_BV, cfg.behavior_topk)
    out["behavior_topk_ids_BNk"] = ids_Bk.astype(jnp.int32)
    out["behavior_topk_logp_BNk"] = at(ids_Bk)
  if cfg.mc_samples:
    J = cfg.mc_samples
    drawn_B_ = draw_candidates(jax.random.fold_in(key, MC_STREAM), logmu_BV, J - 1)
    out["mc_ids_BNJ"] = jnp.concatenate([token_B[:, None].astype(jnp.int32), drawn_B_], axis=1)
    out["mc_behavior_logp_BNJ"] = jnp.concatenate([logp_B[:, None], at(drawn_B_)], axis=1)
  return out


def record_rows(logits_BV: Array, token_B: Array, logp_B: Array, keys_B: Array, steps_B: Array,
                cfg: SamplerConfig) -> dict:
  """`record` with one key per row (`sample.is_row_keys`): row b's records are `record` of that row alone with
  the step key `fold_in(keys_B[b], steps_B[b])`, so they depend on its own key and column only (continuous
  batching refills rows; `generate` with per-row keys records the same)."""
  one = lambda l_V, t, lp, k, n: jax.tree.map(lambda x: x[0], record(l_V[None], t[None], lp[None],
                                                                      jax.random.fold_in(k, n), cfg))
  return jax.vmap(one)(logits_BV, token_B, logp_B, keys_B, steps_B)


def init_records(B: int, N: int, cfg: SamplerConfig) -> dict:
  """The decode carry's empty records: ids pad_id, log-probs 0 (what unwritten / finished columns keep)."""
  out = {}
  if cfg.behavior_topk:
    out["behavior_topk_ids_BNk"] = jnp.full((B, N, cfg.behavior_topk), cfg.pad_id, jnp.int32)
    out["behavior_topk_logp_BNk"] = jnp.zeros((B, N, cfg.behavior_topk), jnp.float32)
  if cfg.mc_samples:
    out["mc_ids_BNJ"] = jnp.full((B, N, cfg.mc_samples), cfg.pad_id, jnp.int32)
    out["mc_behavior_logp_BNJ"] = jnp.zeros((B, N, cfg.mc_samples), jnp.float32)
  return out


def write_column(carry: dict, recs: dict, step: Array, live_B: Array, pad_id: int) -> dict:
  """The carry's records with column `step` set to `recs` on live rows (pad_id ids / 0 log-probs on finished ones)."""
  out = {}
  for name, x_B_ in recs.items():
    fill = pad_id if name.endswith(("ids_BNk", "ids_BNJ")) else 0.0
    out[name] = carry[name].at[:, step].set(jnp.where(live_B[:, None], x_B_, fill).astype(carry[name].dtype))
  return out
