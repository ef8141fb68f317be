"""Speculative decoding in rollouts (ReSpec): a cheap drafter proposes γ tokens, the policy verifies them in one call.

Every verification call feeds the last emitted token and the γ drafted ones through the policy's KV cache
(`forward_with_cache` with T = γ + 1) and keeps a prefix of them by exact rejection sampling: drafted token d_i
(drawn from the drafter's q_i) is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
the row draws its next token from norm(max(0, p_i − q_i)) instead; when all γ pass, one bonus token comes from
p_γ. p and q are the distributions `sample.sample_token` draws from (temperature, then top-k / top-p
renormalised; greedy: one-hot at the argmax), so every emitted token is a sample of the policy's own sampling
distribution, and its behaviour log-prob μ is read off the verification call's logits with `sample_token`'s
convention: `behavior_logp` equals what the learner computes, exactly as for `sampler.generate`.

Rows of a batch accept different numbers of tokens, while the KV cache has one write index for every row
(`models.cache`: slot order is time order). Two layouts (`generate_speculative(layout=...)`):
- "min" (the default): every row emits the **common minimum** m = min over live rows of (accepted + 1) per call;
  rows that accepted more keep only their first m tokens (drafts they accepted), and both caches roll back to
  index + m. Exact (each emitted token is still drawn from p given its prefix; where a row stops depends on the
  other rows' independent draws only), the caches need only P + N + γ + 1 slots and every row writes the same
  columns. The cost: the batch advances at its worst row's pace, so the gain vanishes as the batch grows.
- "rows": every row keeps all it accepted (per-row columns and RoPE positions); the index advances γ + 1 slots
  per call and the verified slots a row did not keep become holes (segment 0, invisible to every query). The
  caches need P + N·(γ + 1) slots, and attention reads the holes' slots too.
Either way the output layout is `sampler.generate`'s (the learner never sees the holes).

Drafters: `generate` takes the drafter's parameters explicitly, a model of the policy's architecture cut to k
layers: the "layers" drafter (`layers_drafter`: a view of the policy's first k layers sharing its embedding, final
norm and head, so always exactly as fresh as the policy) or a drafter with its own weights (`distill.drafter`:
initialised as that view, then distilled on recent rollouts, ReSpec) or a head made for drafting (`head_drafter`:
EAGLE-style, on the policy's last hidden states, distilled the same way; it keeps one feature per row instead of a
cache: `init_drafter_state`, `roll_back`). `generate_speculative` takes any model of the same vocabulary
(`draft_params`, `draft_cfg`) or a head. Whatever the drafter, the tokens are the policy's samples and μ its
log-probs: only the acceptance rate depends on it. Fresh is not good: an untrained early exit drafts poorly
(SmolLM2-135M, 30 layers, temperature 1: acceptance 2-6 % with k = 8, 33 % with k = 28; `bench/speculative.py`),
hence the distilled drafter.

Every feature of the plain loop is a property of the verify step here too:
- the KV cache format (`sampler.kv_cache`): the policy's cache is int8 or sinks + window exactly as in `generate`
  (the window is over RoPE positions, so the "rows" layout's holes do not move it); μ and the acceptance test use
  that cache's policy, and "window" returns `kv_window_B2` for the learner's shadow mask. The drafter keeps a full
  cache: it only proposes, so its cache changes the acceptance rate, never the distribution.
- μ's records (`sampler.behavior_topk`, `mc_samples`): every emitted token's records come from the verify call's
  logits at its position (`behavior.record`, the candidates from the call's own key), the first column's from
  the prefill as in `generate`.
- MoE routes (routing replay, R3): each completion column's routes are those of the slot where the policy fed it
  (`slot_BN`; under "rows" a column's slot is not P + column), gathered into `generate`'s `routes_BTLk`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp

from jaxrl_llm.models.cache import init_cache, kv_bits, take_rows, window_record
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import (decode_view, forward_with_cache, hidden_with_cache, logits_from_hidden,
                                          stack_cache)
from jaxrl_llm.sampling import behavior, head_drafter
from jaxrl_llm.sampling.config import SamplerConfig
from jaxrl_llm.sampling.continuation import appended_layout
from jaxrl_llm.sampling.sample import first_argmax, is_row_keys, truncate
from jaxrl_llm.sampling.sampler import decode_carry, emit_token, is_stop, prefill_prompts

Array = jax.Array

# γ by batch size for `spec_gamma="auto"` (ReSpec: speculation pays less as the batch grows, because a larger
# batch is already closer to compute bound): (largest batch, γ), first match wins; larger batches get 0 (off).
AUTO_GAMMA = ((1, 4), (4, 4), (16, 2), (64, 1))


def auto_gamma(batch: int) -> int:
  """γ for a batch of `batch` rows from `AUTO_GAMMA` (0: speculation off)."""
  for rows, gamma in AUTO_GAMMA:
    if batch <= rows:
      return gamma
  return 0


GAMMAS = (0, 1, 2, 4)  # what `GammaTuner` chooses from (0: plain decoding)


class GammaTuner:
  """ReSpec's adaptive speculative decoding (spec B9, mechanism 1): γ for the next sampler call from what the calls
  so far measured, per batch size, instead of the fixed `AUTO_GAMMA` table.

  The measure is seconds per emitted token of a whole call (`observe`): it folds in the acceptance rate (tokens per
  verification), the verification's cost at this batch size (large batches are closer to compute bound) and the
  drafter's own cost, which is what ReSpec's "step cost" trades against acceptance. `choose(B)`:
  1. the first call at B uses `auto_gamma(B)` (the table, as a prior);
  2. then every candidate of `GAMMAS` not yet measured at B is tried, in order of distance from the prior; a
     candidate's first call at B compiles its program, so it is ignored (warm-up) and the candidate tried again;
  3. then the candidate with the lowest measured cost (an EMA with `decay`); every `retry_every` calls at B the
     least recently measured other candidate is re-measured once, so a drafter that distils (acceptance rises) or
     a policy that drifts (it falls) moves the choice.
  Host-side and thread-safe (async workers may share one); `state()` is plain data for inspection.
  """

  def __init__(self, candidates=GAMMAS, decay: float = 0.5, retry_every: int = 16):
    if not candidates or any(g < 0 for g in candidates):
      raise ValueError(f"GammaTuner candidates={candidates!r}: non-empty, each >= 0")
    self.candidates, self.decay, self.retry_every = tuple(candidates), float(decay), int(retry_every)
    self._cost: dict[tuple[int, int], float] = {}  # (B, γ) -> EMA seconds per emitted token
    self._seen: dict[tuple[int, int], int] = {}  # (B, γ) -> calls observed (the first is the compile)
    self._last: dict[tuple[int, int], int] = {}  # (B, γ) -> call count at B when last observed
    self._calls: dict[int, int] = {}  # B -> calls chosen
    self._lock = threading.Lock()

  def choose(self, batch: int) -> int:
    with self._lock:
      n = self._calls.get(batch, 0)
      self._calls[batch] = n + 1
      prior = auto_gamma(batch)
      order = sorted(set(self.candidates) | {prior}, key=lambda g: (abs(g - prior), g))
      todo = [g for g in order if (batch, g) not in self._cost]
      if todo:
        return todo[0]
      best = min(order, key=lambda g: (self._cost[(batch, g)], g))
      if self.retry_every and n % self.retry_every == self.retry_every - 1:
        others = [g for g in order if g != best]
        if others:
          return min(others, key=lambda g: self._last.get((batch, g), -1))
      return best

  def observe(self, batch: int, gamma: int, seconds: float, tokens: float) -> None:
    """One call at `batch` rows with `gamma` took `seconds` for `tokens` emitted tokens."""
    with self._lock:
      key = (batch, gamma)
      self._seen[key] = self._seen.get(key, 0) + 1
      self._last[key] = self._calls.get(batch, 0)
      if self._seen[key] == 1 or tokens <= 0:  # the compile, or nothing emitted: no measure
        return
      x = seconds / tokens
      self._cost[key] = x if key not in self._cost else self.decay * self._cost[key] + (1 - self.decay) * x

  def state(self) -> dict:
    with self._lock:
      return {f"{b}x{g}": c for (b, g), c in sorted(self._cost.items())}


def draft_from_layers(params: dict, model_cfg: ModelConfig, n_layers: int) -> tuple[dict, ModelConfig]:
  """(params, config) of the drafter made of the policy's first `n_layers` decoder layers, sharing its
  embedding, final norm and head (the arrays themselves: no copy, always the policy's current weights)."""
  if not 1 <= n_layers <= model_cfg.n_layers:
    raise ValueError(f"sampler.spec_draft_layers={n_layers} must be in [1, {model_cfg.n_layers}] (the policy's layers)")
  layers = jax.tree.map(lambda x: x[:n_layers], params["layers"])
  return {**params, "layers": layers}, dataclasses.replace(model_cfg, n_layers=n_layers)


def sampling_logp(logits_BTV: Array, cfg: SamplerConfig) -> Array:
  """log of the distribution `sample.sample_token` draws from, over the whole vocabulary (-inf off its support):
  log_softmax(logits / temperature), restricted and renormalised to the top-k / top-p candidates when truncated;
  greedy (temperature 0): 0 at the first argmax, -inf elsewhere."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  V = logits_BTV.shape[-1]
  if cfg.temperature == 0:
    return jnp.where(jax.nn.one_hot(first_argmax(logits_BTV), V, dtype=bool), 0.0, -jnp.inf)
  scaled_BTV = logits_BTV / cfg.temperature
  if cfg.truncated:
    vals_BTK, ids_BTK = truncate(scaled_BTV, cfg)
    rows = vals_BTK.reshape(-1, vals_BTK.shape[-1]), ids_BTK.reshape(-1, ids_BTK.shape[-1])
    R = rows[0].shape[0]
    kept_RV = jnp.full((R, V), -jnp.inf, jnp.float32).at[jnp.arange(R)[:, None], rows[1]].set(rows[0])
    scaled_BTV = kept_RV.reshape(scaled_BTV.shape)
  return jax.nn.log_softmax(scaled_BTV, axis=-1)


def behavior_logp(logits_BTV: Array, logp_BTV: Array, tokens_BT: Array, cfg: SamplerConfig) -> Array:
  """μ of `tokens_BT` with `sample_token`'s convention: the sampling distribution's log-prob (`logp_BTV`), or
  log_softmax(logits) at temperature 1 when greedy."""
  src_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1) if cfg.temperature == 0 else logp_BTV
  return jnp.take_along_axis(src_BTV, tokens_BT[..., None], axis=-1)[..., 0]


def fold(key: Array, i) -> Array:
  """`fold_in(key, i)` of one key, or of each key of one key per row (`sample.is_row_keys`)."""
  return jax.vmap(lambda k: jax.random.fold_in(k, i))(key) if is_row_keys(key) else jax.random.fold_in(key, i)


def _draw(fn, key: Array, shape: tuple[int, ...]) -> Array:
  """`fn(key, shape)` for the batch, or with one key per row each row's own `fn(key[b], shape[1:])` (the slot
  engine: a request's draws depend on its key, not on its slot)."""
  return jax.vmap(lambda k: fn(k, shape[1:]))(key) if is_row_keys(key) else fn(key, shape)


def _categorical(key: Array, logp_BTV: Array) -> Array:
  """One draw per row of `logp` (Gumbel-max; -inf entries are never drawn)."""
  g_BTV = _draw(lambda k, s: jax.random.gumbel(k, s, jnp.float32), key, logp_BTV.shape)
  return first_argmax(jnp.where(jnp.isneginf(logp_BTV), -jnp.inf, logp_BTV + g_BTV))


def verify(p_logp_BGV: Array, q_logp_BgV: Array, draft_Bg: Array, key: Array) -> tuple[Array, Array]:
  """Exact rejection sampling of γ drafted tokens against the policy: (n_B accepted drafts, block_BG).

  p_logp_BGV: the policy's sampling log-probs at the G = γ + 1 verified positions; q_logp_BgV: the drafter's at
  the γ drafted ones; draft_Bg: the drafted tokens (drawn from q). block_BG: the row's candidate tokens, its
  first n_B + 1 being what it emits: the accepted drafts, then the draw from norm(max(0, p_n − q_n)) (or, with
  every draft accepted, from p_γ: the residual against q = 0). `key`: one key, or one key per row.
  """
  B, g = draft_Bg.shape
  k_acc, k_fix = (fold(key, 0), fold(key, 1)) if is_row_keys(key) else jax.random.split(key)
  p_d_Bg = jnp.exp(jnp.take_along_axis(p_logp_BGV[:, :g], draft_Bg[..., None], axis=-1)[..., 0])
  q_d_Bg = jnp.exp(jnp.take_along_axis(q_logp_BgV, draft_Bg[..., None], axis=-1)[..., 0])
  accept_Bg = _draw(jax.random.uniform, k_acc, (B, g)) * q_d_Bg < p_d_Bg  # u < p/q without dividing
  n_B = jnp.sum(jnp.cumprod(accept_Bg.astype(jnp.int32), axis=1), axis=1)
  q_BGV = jnp.concatenate([jnp.exp(q_logp_BgV), jnp.zeros_like(p_logp_BGV[:, :1])], axis=1)
  p_BGV = jnp.exp(p_logp_BGV)
  resid_BGV = jnp.maximum(p_BGV - q_BGV, 0.0)
  # p == q up to rounding leaves no residual mass (and then a rejection has probability ~0): draw from p
  resid_BGV = jnp.where(jnp.sum(resid_BGV, axis=-1, keepdims=True) > 0, resid_BGV, p_BGV)
  fix_BG = _categorical(k_fix, jnp.log(resid_BGV))
  col_G = jnp.arange(g + 1)
  drafts_BG = jnp.concatenate([draft_Bg, jnp.zeros((B, 1), draft_Bg.dtype)], axis=1)
  return n_B, jnp.where(col_G[None, :] < n_B[:, None], drafts_BG, fix_BG).astype(jnp.int32)


def draft(d_params: dict, cache: dict, last_B: Array, pos0_B: Array, live_B1: Array, key: Array,
          d_cfg: ModelConfig, sampler_cfg: SamplerConfig, gamma: int) -> tuple[Array, Array, dict]:
  """The drafter's γ proposals after `last_B` (at positions pos0_B + 1 ...): (draft_Bg, q_logp_BgV, cache). It
  feeds γ + 1 tokens (the last draft too, head skipped) so that its cache holds every token the policy may keep.
  `key`: one key, or one key per row."""
  tok_B1, drafts, qs = last_B[:, None], [], []
  for i in range(gamma):
    logits_B1V, cache = forward_with_cache(d_params, tok_B1, cache, d_cfg, positions_BT=(pos0_B + i)[:, None],
                                           segment_ids_BT=live_B1)
    q_B1V = sampling_logp(logits_B1V, sampler_cfg)
    tok_B1 = _categorical(fold(key, i), q_B1V)
    drafts.append(tok_B1)
    qs.append(q_B1V)
  _, cache = hidden_with_cache(d_params, tok_B1, cache, d_cfg, positions_BT=(pos0_B + gamma)[:, None],
                               segment_ids_BT=live_B1)
  return jnp.concatenate(drafts, axis=1), jnp.concatenate(qs, axis=1), cache


def draft_head(head: dict, v_params: dict, dstate: dict, last_B: Array, key: Array, model_cfg: ModelConfig,
               sampler_cfg: SamplerConfig, gamma: int) -> tuple[Array, Array]:
  """A head drafter's (`head_drafter`) γ proposals after `last_B`: (draft_Bg, q_logp_BgV), chaining its predicted
  features from the state's `feat_BD` (the policy's feature at the token before `last_B`) through the policy's
  embedding and head (`v_params`); over the head's draft vocabulary when it has one (`head_drafter.vocab`: drawn
  among its K tokens, q zero elsewhere). `key`: one key, or one key per row."""
  feat_BD, tok_B1, drafts, qs = dstate["feat_BD"], last_B[:, None], [], []
  vocab_K = head_drafter.vocab(head)
  for i in range(gamma):
    feat_BD = head_drafter.predict(head, feat_BD, head_drafter.embed(v_params, tok_B1[:, 0], model_cfg), model_cfg)
    q_B1x = sampling_logp(head_drafter.logits(v_params, feat_BD[:, None], vocab_K, model_cfg), sampler_cfg)
    tok_B1 = _categorical(fold(key, i), q_B1x)
    if vocab_K is not None:  # back to token ids, and q over the whole vocabulary for the verification
      tok_B1 = jnp.take(vocab_K, tok_B1)
      q_B1x = jnp.full((*q_B1x.shape[:-1], model_cfg.vocab_size), -jnp.inf, q_B1x.dtype).at[..., vocab_K].set(q_B1x)
    drafts.append(tok_B1)
    qs.append(q_B1x)
  return jnp.concatenate(drafts, axis=1), jnp.concatenate(qs, axis=1)


def init_drafter_state(draft_params: dict, draft_cfg: ModelConfig, model_cfg: ModelConfig, batch: int,
                       slots: int) -> dict:
  """What the drafter keeps between calls: a head's feature of each row (zero: no feature yet, `head_drafter`) or
  a layers drafter's KV cache of `slots` slots."""
  if head_drafter.is_head(draft_params):
    return {"feat_BD": jnp.zeros((batch, model_cfg.d_model), model_cfg.compute_dtype)}
  return init_cache(draft_cfg, batch, slots)


def roll_back(state: dict, start: Array, emit_B: Array, layout: str, width: int) -> dict:
  """A cache (the policy's or a layers drafter's) or a head's state after a draft-and-verify call that fed `width`
  slots `start ...` and of which each row keeps its first `emit_B` tokens: under "min" (every row's `emit_B` equal) the
  write index moves back to start + emit; under "rows" the slots not kept become holes. A head keeps the policy's
  feature at its last kept token (the call's `h_BGD`; rows that keep nothing keep their feature)."""
  if is_head_state(state):
    h_BGD = state["h_BGD"]
    at_BD = jnp.take_along_axis(h_BGD, jnp.maximum(emit_B - 1, 0)[:, None, None], axis=1)[:, 0]
    return {"feat_BD": jnp.where(emit_B[:, None] > 0, at_BD, state["feat_BD"]).astype(state["feat_BD"].dtype)}
  if layout == "min":
    return {**state, "index": start + emit_B[0]}
  return _mark_holes(state, start, jnp.arange(width)[None, :] < emit_B[:, None])


def draft_and_verify(v_params: dict, vd_params: dict, cache: dict, dcache: dict, last_B: Array, pos0_B: Array,
                     fed_B: Array, live_B: Array, key: Array, model_cfg: ModelConfig, d_cfg: ModelConfig,
                     sampler_cfg: SamplerConfig, gamma: int) -> tuple[Array, Array, Array, dict, dict, dict]:
  """The draft-and-verify step of every speculative path (static batches, partial chunks and kept turns through
  `decode_calls`, the slot engine's `continuous.speculate_chunk`): the drafter proposes γ tokens after each row's
  `last_B` (at position `pos0_B`), the policy scores `last_B` and the drafts in one call, and exact rejection
  sampling picks each row's block. `fed_B`: rows whose `last_B` is a real token (the rest feed padding); `live_B`:
  rows whose drafts are (a subset of fed_B). `key`: one key, or one key per row; its folds 0, 1, 2 draw the drafts,
  the verification and μ's records. The drafter: a layers drafter (`vd_params` a model, `dcache` its cache) or a
  head (`head_drafter`; `dcache` its state, returned with the call's policy features `h_BGD`). The caller rolls
  the caches back to what it keeps (`roll_back`). Returns (n_B accepted drafts, block_BG, mu_BG: μ of each block
  token, records (`record_block`, {} unless asked), cache, dcache)."""
  i_G = jnp.arange(gamma + 1, dtype=jnp.int32)
  if head_drafter.is_head(vd_params):
    drafts_Bg, q_logp_BgV = draft_head(vd_params, v_params, dcache, last_B, fold(key, 0), model_cfg, sampler_cfg,
                                       gamma)
  else:
    drafts_Bg, q_logp_BgV, dcache = draft(vd_params, dcache, last_B, pos0_B, live_B[:, None].astype(jnp.int32),
                                          fold(key, 0), d_cfg, sampler_cfg, gamma)
  seg_BG = jnp.where(i_G[None, :] == 0, fed_B[:, None], live_B[:, None]).astype(jnp.int32)
  h_BGD, cache = hidden_with_cache(v_params, jnp.concatenate([last_B[:, None], drafts_Bg], axis=1), cache,
                                   model_cfg, positions_BT=pos0_B[:, None] + i_G[None, :],
                                   segment_ids_BT=seg_BG, kv_window=sampler_cfg.kv_window_arg)
  logits_BGV = logits_from_hidden(v_params, h_BGD, model_cfg)
  if head_drafter.is_head(vd_params):
    dcache = {**dcache, "h_BGD": h_BGD}
  p_logp_BGV = sampling_logp(logits_BGV, sampler_cfg)
  n_B, block_BG = verify(p_logp_BGV, q_logp_BgV, drafts_Bg, fold(key, 1))
  mu_BG = behavior_logp(logits_BGV, p_logp_BGV, block_BG, sampler_cfg)
  recs = record_block(logits_BGV, block_BG, mu_BG, fold(key, 2), sampler_cfg) if sampler_cfg.records else {}
  return n_B, block_BG, mu_BG, recs, cache, dcache


def record_block(logits_BGV: Array, block_BG: Array, mu_BG: Array, key: Array, sampler_cfg: SamplerConfig) -> dict:
  """μ's records (`behavior.record`) at each of the G verified positions, [B, G, k|J] each: the block's token
  there and its μ, one key for the call (the candidates of different rows and positions are independent draws),
  or one key per row (each row's records from its own)."""
  if is_row_keys(key):
    one = lambda l_GV, t_G, m_G, k: behavior.record(l_GV, t_G, m_G, k, sampler_cfg)
    return jax.vmap(one)(logits_BGV, block_BG, mu_BG, key)
  B, G, V = logits_BGV.shape
  recs = behavior.record(logits_BGV.reshape(B * G, V), block_BG.reshape(-1), mu_BG.reshape(-1), key, sampler_cfg)
  return {name: x.reshape(B, G, -1) for name, x in recs.items()}


def _write_block(carry: dict, block_BG: Array, mu_BG: Array, emit_B: Array, active_B: Array,
                 sampler_cfg: SamplerConfig, recs: dict, version: Array | None = None) -> dict:
  """Writes the first `emit_B` tokens of each active row's block (and their `recs`, `record_block`) at its
  columns `col_B ...` and advances `col_B` by `emit_B`; a row is live at a column until the column after its
  first stop id. Later columns of the block get pad (nothing real lies past a row's `col_B`), and writes past the
  buffer are dropped."""
  B, G = block_BG.shape
  stop_BG = is_stop(block_BG, sampler_cfg.stop_ids)
  stopped_before_BG = jnp.cumsum(stop_BG, axis=1) - stop_BG > 0
  live_BG = active_B[:, None] & ~stopped_before_BG & (jnp.arange(G)[None, :] < emit_B[:, None])
  rows_B1, cols_BG = jnp.arange(B)[:, None], carry["col_B"][:, None] + jnp.arange(G)[None, :]
  put = lambda buf, x_BG: buf.at[rows_B1, cols_BG].set(x_BG.astype(buf.dtype), mode="drop")
  for name, x_BG_ in recs.items():  # pad ids / zero log-probs where the row is not live (`behavior.write_column`)
    fill = sampler_cfg.pad_id if name.endswith(("ids_BNk", "ids_BNJ")) else 0.0
    carry = {**carry, name: put(carry[name], jnp.where(live_BG[..., None], x_BG_, fill))}
  if version is not None:  # partial rollouts: the version that sampled each column
    carry = {**carry, "versions_BN": put(carry["versions_BN"], jnp.where(live_BG, version, 0))}
  return {
      **carry,
      "col_B": carry["col_B"] + emit_B,
      "tokens_BN": put(carry["tokens_BN"], jnp.where(live_BG, block_BG, sampler_cfg.pad_id)),
      "logp_BN": put(carry["logp_BN"], jnp.where(live_BG, mu_BG, 0.0)),
      "mask_BN": put(carry["mask_BN"], live_BG.astype(jnp.float32)),
      "done_B": carry["done_B"] | jnp.any(live_BG & stop_BG, axis=1),
  }


def _mark_holes(cache: dict, start: Array, keep_BG: Array) -> dict:
  """Segment 0 (invisible to every later query) on the verified slots `start ...` a row did not keep."""
  seg_BS = jax.lax.dynamic_update_slice_in_dim(cache["segment_ids_BS"], keep_BG.astype(jnp.int32), start, axis=1)
  return {**cache, "segment_ids_BS": seg_BS}


LAYOUTS = ("min", "rows")


def _check(model_cfg: ModelConfig, draft_cfg: ModelConfig, gamma: int, layout: str) -> None:
  if gamma < 1:
    raise ValueError(f"generate_speculative: gamma must be >= 1, got {gamma}")
  if layout not in LAYOUTS:
    raise ValueError(f"generate_speculative: layout must be one of {LAYOUTS}, got {layout!r}")
  if draft_cfg.vocab_size != model_cfg.vocab_size:
    raise ValueError(f"the drafter's vocabulary ({draft_cfg.vocab_size}) must be the policy's ({model_cfg.vocab_size})")


def _start(params: dict, draft_params: dict, prompt_tokens_BP: Array, prompt_len_B: Array, key: Array,
           model_cfg: ModelConfig, draft_cfg: ModelConfig, sampler_cfg: SamplerConfig, gamma: int, layout: str,
           version: Array | None = None) -> dict:
  """Both caches prefilled with the prompts and column 0 drawn (as `generate` draws it): the loop's carry (stacked
  caches). `version` (partial rollouts): also record the version of every column (`versions_BN`). `draft_params`
  None: the policy's first `draft_cfg.n_layers` layers."""
  _check(model_cfg, draft_cfg, gamma, layout)
  draft_params, _ = resolve_drafter(params, draft_params, model_cfg, draft_cfg.n_layers)
  B, P = prompt_tokens_BP.shape
  N, G = sampler_cfg.max_new_tokens, gamma + 1
  # min: the last call starts at slot P + N - 2 and writes G; rows: at most N - 1 calls of G slots each
  new_slots = N + G if layout == "min" else N * G
  prompt_BP, positions_BP, segment_ids_BP, cache, first_logits_BV = prefill_prompts(
      params, prompt_tokens_BP, prompt_len_B, model_cfg, dataclasses.replace(sampler_cfg, max_new_tokens=new_slots))
  dcache = init_drafter_state(draft_params, draft_cfg, model_cfg, B, P + new_slots)
  if not head_drafter.is_head(draft_params):
    _, dcache = hidden_with_cache(draft_params, prompt_BP, dcache, draft_cfg, positions_BT=positions_BP,
                                  segment_ids_BT=segment_ids_BP)
  carry = emit_token(decode_carry(cache, B, N + G, sampler_cfg), first_logits_BV, jax.random.fold_in(key, 0),
                     sampler_cfg)
  carry = {**_loop_carry(carry, dcache, prompt_len_B), "prompt_BP": prompt_BP, "positions_BP": positions_BP,
           "segment_ids_BP": segment_ids_BP}
  if model_cfg.is_moe:  # the slot where each completion column was fed (-1: never fed), for its routes
    carry["slot_BN"] = jnp.full((B, N + G), -1, jnp.int32)
  if version is not None:
    carry["versions_BN"] = jnp.zeros((B, N + G), jnp.int32).at[:, 0].set(jnp.asarray(version, jnp.int32))
  return _with_step(carry, N)


def _with_step(carry: dict, N: int) -> dict:
  """`step`: the smallest column a row still decoding writes next (N when none is): under "min" every row's, which
  is what `partial.reprefill_cache` needs (slots before P + step - 1 are fed)."""
  going_B = ~carry["done_B"] & (carry["col_B"] < N)
  return {**carry, "step": jnp.min(jnp.where(going_B, carry["col_B"], N)).astype(jnp.int32)}


def decode_calls(params: dict, draft_params: dict, carry: dict, key: Array, stop: Array, version: Array | None,
            model_cfg: ModelConfig, draft_cfg: ModelConfig, sampler_cfg: SamplerConfig, gamma: int,
            layout: str) -> dict:
  """Draft-and-verify calls while a row is still decoding below column `stop` (a row may pass it by up to γ
  columns in its last call): the one loop of `generate_speculative` and of speculating partial rollouts."""
  draft_params, _ = resolve_drafter(params, draft_params, model_cfg, draft_cfg.n_layers)
  B, N, G = carry["col_B"].shape[0], sampler_cfg.max_new_tokens, gamma + 1
  prompt_len_B = carry["prompt_len_B"]
  v_params, cache = decode_view(params, carry["cache"], model_cfg)
  vd_params, dcache = drafter_view(draft_params, carry["dcache"], draft_cfg)
  active = lambda c: ~c["done_B"] & (c["col_B"] < jnp.minimum(stop, N))

  def call(carry: dict) -> dict:
    """One draft-and-verify round: emits >= 1 token for every active row."""
    col_B, active_B = carry["col_B"], active(carry)
    k_call = jax.random.fold_in(jax.random.fold_in(key, 1), carry["calls"])
    last_B = jnp.take_along_axis(carry["tokens_BN"], (col_B - 1)[:, None], axis=1)[:, 0]
    pos0_B = (prompt_len_B + col_B - 1).astype(jnp.int32)
    start = carry["cache"]["index"]
    n_B, block_BG, mu_BG, recs, cache, dcache = draft_and_verify(
        v_params, vd_params, carry["cache"], carry["dcache"], last_B, pos0_B, active_B, active_B, k_call, model_cfg,
        draft_cfg, sampler_cfg, gamma)
    if layout == "min":  # the caches keep `last` and the m - 1 drafts every row emitted
      emit_B = jnp.full((B,), jnp.min(jnp.where(active_B, n_B + 1, G)), jnp.int32)
    else:  # each row keeps `last` and its accepted drafts
      emit_B = jnp.where(active_B, n_B + 1, 0).astype(jnp.int32)
    cache, dcache = roll_back(cache, start, emit_B, layout, G), roll_back(dcache, start, emit_B, layout, G)
    counted_B = jnp.where(active_B, jnp.minimum(emit_B, N - col_B), 0)
    carry = {**carry, "cache": cache, "dcache": dcache, "calls": carry["calls"] + 1,
             "accepted": carry["accepted"] + jnp.sum(jnp.where(active_B, n_B, 0)),
             "proposed": carry["proposed"] + gamma * jnp.sum(active_B),
             "emitted": carry["emitted"] + jnp.sum(counted_B), "row_calls": carry["row_calls"] + jnp.sum(active_B)}
    if "slot_BN" in carry:  # this call fed columns col_B - 1 ... at slots start ...; the first emit_B are kept
      i_G = jnp.arange(G)
      cols_BG = jnp.where(i_G[None, :] < emit_B[:, None], col_B[:, None] - 1 + i_G[None, :], N + G)  # N+G: dropped
      carry["slot_BN"] = carry["slot_BN"].at[jnp.arange(B)[:, None], cols_BG].set(
          jnp.broadcast_to(start + i_G, (B, G)), mode="drop")
    return _write_block(carry, block_BG, mu_BG, emit_B, active_B, sampler_cfg, recs, version)

  carry = jax.lax.while_loop(lambda c: jnp.any(active(c)), call, {**carry, "cache": cache, "dcache": dcache})
  return _with_step({**carry, "cache": stack_cache(carry["cache"]), "dcache": drafter_stack(carry["dcache"])}, N)


def drafter_view(draft_params: dict, dcache: dict, draft_cfg: ModelConfig) -> tuple[dict, dict]:
  """`decode_view` of a layers drafter and its cache; a head and its state as they are."""
  if head_drafter.is_head(draft_params):
    return draft_params, dcache
  return decode_view(draft_params, dcache, draft_cfg)


def drafter_stack(dcache: dict) -> dict:
  """`stack_cache` of a layers drafter's cache; a head's state as it is."""
  return dcache if is_head_state(dcache) else stack_cache(dcache)


def is_head_state(dcache: dict) -> bool:
  """Whether a drafter's state is a head's (`init_drafter_state`), not a KV cache."""
  return "feat_BD" in dcache


def drafter_rows(dcache: dict, rows_b: Array) -> dict:
  """The drafter's state of rows `rows_b` (`cache.take_rows` for a layers drafter's cache)."""
  if is_head_state(dcache):
    return {"feat_BD": jnp.take(dcache["feat_BD"], rows_b, axis=0)}
  return take_rows(dcache, rows_b)


def _finish(carry: dict, model_cfg: ModelConfig, sampler_cfg: SamplerConfig) -> dict:
  """`generate`'s outputs of a finished carry, the spec_* metrics, and `versions_BN` when recorded."""
  N = sampler_cfg.max_new_tokens
  prompt_BP, positions_BP, segment_ids_BP = carry["prompt_BP"], carry["positions_BP"], carry["segment_ids_BP"]
  B, P = prompt_BP.shape
  tokens_BN, mask_BN = carry["tokens_BN"][:, :N], carry["mask_BN"][:, :N]
  positions_BN = (carry["prompt_len_B"][:, None] + jnp.arange(N)[None, :]).astype(jnp.int32)
  extra = {**{k: carry[k][:, :N] for k in behavior.TOPK_FIELDS + behavior.MC_FIELDS + ("versions_BN",) if k in carry},
           **window_record(sampler_cfg.kv_window_arg, B)}
  if model_cfg.is_moe:
    extra["routes_BTLk"] = _routes(carry["cache"]["routes_LBSk"], carry["slot_BN"][:, :N], P)
  return {
      **extra,
      "tokens_BN": tokens_BN,
      "mask_BN": mask_BN,
      "behavior_logp_BN": carry["logp_BN"][:, :N],
      "lengths_B": jnp.sum(mask_BN, axis=1).astype(jnp.int32),
      "finished_B": jnp.any(is_stop(tokens_BN, sampler_cfg.stop_ids) & (mask_BN > 0), axis=1),
      "sequence_BT": jnp.concatenate([prompt_BP, tokens_BN], axis=1),
      "positions_BT": jnp.concatenate([positions_BP, positions_BN], axis=1),
      "segment_ids_BT": jnp.concatenate([segment_ids_BP, mask_BN.astype(jnp.int32)], axis=1),
      "completion_mask_BT": jnp.concatenate([jnp.zeros((B, P), jnp.float32), mask_BN], axis=1),
      "gen_kv_bits": jnp.float32(kv_bits(carry["cache"])),
      **_spec_stats(carry),
  }


def _spec_stats(carry: dict) -> dict:
  """spec_calls, spec_accept_rate and spec_tokens_per_call of a finished carry (`generate_speculative`)."""
  return {"spec_calls": carry["calls"],
          "spec_accept_rate": carry["accepted"] / jnp.maximum(carry["proposed"], 1.0),
          "spec_tokens_per_call": carry["emitted"] / jnp.maximum(carry["row_calls"], 1.0)}


def _loop_carry(carry: dict, dcache: dict, start_pos_B: Array) -> dict:
  """A carry whose column 0 is drawn, plus the loop's own state: both caches, counters, each row's position of
  column 0 (`prompt_len_B`)."""
  zero = jnp.zeros((), jnp.float32)
  return {**carry, "col_B": jnp.ones_like(start_pos_B, jnp.int32), "dcache": dcache,
          "calls": jnp.zeros((), jnp.int32), "accepted": zero, "proposed": zero, "emitted": zero, "row_calls": zero,
          "prompt_len_B": start_pos_B.astype(jnp.int32)}


_STATIC = ("model_cfg", "draft_cfg", "sampler_cfg", "gamma", "layout")


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate_speculative(params: dict, draft_params: dict, prompt_tokens_BP: Array, prompt_len_B: Array, key: Array,
                         model_cfg: ModelConfig, draft_cfg: ModelConfig, sampler_cfg: SamplerConfig,
                         gamma: int, layout: str = "min") -> dict:
  """`sampler.generate`'s contract (same conventions and output fields) with speculative decoding: the drafter
  (`draft_params`, `draft_cfg`, same vocabulary) proposes `gamma` tokens per policy call (module docstring).

  The tokens follow the policy's sampling distribution exactly (not the same bits as `generate` for a key:
  the draws differ); greedy (temperature 0) emits `generate`'s tokens up to rounding between a T = 1 and a
  T = γ + 1 forward. Column 0 is drawn like `generate`'s (from the prefill's logits).
  `layout`: how rows that accept different numbers of drafts share the caches' one write index:
    "min": every row emits the common minimum m per call and both caches roll back to it (P + N + γ + 1 slots);
    "rows": every row keeps all it accepted; the index advances γ + 1 slots per call and the slots a row rejected
      become holes (segment 0), so the caches need P + N·(γ + 1) slots and attention reads them all.
  Also returns the scalars spec_calls (verification calls), spec_accept_rate (accepted / proposed drafts over
  active rows, before any common minimum) and spec_tokens_per_call (tokens a row emits per verification call,
  averaged over the calls of rows still decoding).
  Like `generate` it also returns the μ records `sampler_cfg` asks for, `kv_window_B2` with a "window" cache and,
  for MoE models, `routes_BTLk` (module docstring).
  """
  carry = _start(params, draft_params, prompt_tokens_BP, prompt_len_B, key, model_cfg, draft_cfg, sampler_cfg, gamma,
                 layout)
  carry = decode_calls(params, draft_params, carry, key, jnp.asarray(sampler_cfg.max_new_tokens, jnp.int32), None,
                  model_cfg, draft_cfg, sampler_cfg, gamma, layout)
  return _finish(carry, model_cfg, sampler_cfg)


# Partial rollouts' pieces (`sampling.partial.generate_partial` with `spec_gamma`): the same start, loop and finish,
# jitted apart so that the driver can switch versions (and re-prefill the policy's cache) between chunks.
start_partial = jax.jit(_start, static_argnames=_STATIC)
decode_until = jax.jit(decode_calls, static_argnames=_STATIC, donate_argnames=("carry",))
finish_partial = jax.jit(_finish, static_argnames=("model_cfg", "sampler_cfg"))


# Episode turns from kept caches (`rollout.turn_sampler.CachedTurns` with speculation): the drafter keeps a cache of
# its own beside the policy's, prefilled and extended with the same tokens; a turn is the same draft-and-verify loop.
@functools.partial(jax.jit, static_argnames=("model_cfg", "n_layers", "slots"))
def prefill_drafter(params: dict, draft_params: dict | None, tokens_BW: Array, positions_BW: Array,
                    segment_ids_BW: Array, model_cfg: ModelConfig, n_layers: int, slots: int) -> dict:
  """The drafter's cache (`slots` slots, full format: the drafter only proposes) holding the given contexts (the
  drafter `resolve_drafter` picks: `draft_params`, or the policy's first `n_layers` layers). A head's state: no
  feature yet (`init_drafter_state`)."""
  if head_drafter.is_head(draft_params):
    return init_drafter_state(draft_params, model_cfg, model_cfg, tokens_BW.shape[0], slots)
  d_params, d_cfg = resolve_drafter(params, draft_params, model_cfg, n_layers)
  dcache = init_cache(d_cfg, tokens_BW.shape[0], slots)
  return hidden_with_cache(d_params, tokens_BW, dcache, d_cfg, positions_BT=positions_BW,
                           segment_ids_BT=segment_ids_BW)[1]


@functools.partial(jax.jit, static_argnames=("model_cfg", "n_layers"))
def extend_drafter(params: dict, draft_params: dict | None, dcache: dict, tokens_BE: Array, len_B: Array,
                   start_pos_B: Array, model_cfg: ModelConfig, n_layers: int) -> dict:
  """`continuation.extend` for the drafter's cache: row b's first `len_B[b]` tokens at positions `start_pos_B[b]`,
  ... (no logits: the drafter's are computed by its next proposal). A head's state goes back to no feature: the
  one before the turn's first drafted token is not computed (as at a request's start)."""
  if head_drafter.is_head(draft_params):
    return {"feat_BD": jnp.zeros_like(dcache["feat_BD"])}
  d_params, d_cfg = resolve_drafter(params, draft_params, model_cfg, n_layers)
  positions_BE, segment_ids_BE = appended_layout(len_B, start_pos_B, tokens_BE.shape[1])
  return hidden_with_cache(d_params, tokens_BE.astype(jnp.int32), dcache, d_cfg, positions_BT=positions_BE,
                           segment_ids_BT=segment_ids_BE)[1]


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg", "gamma"))
def decode_turn(params: dict, draft_params: dict | None, cache: dict, dcache: dict, first_logits_BV: Array,
                start_pos_B: Array, key: Array, model_cfg: ModelConfig, sampler_cfg: SamplerConfig,
                gamma: int) -> tuple[dict, dict, dict, Array]:
  """`continuation.decode_turn` by draft-and-verify calls: one more turn of up to N = `max_new_tokens` tokens per
  row from the kept caches (the policy's `cache`, the drafter's `dcache`: both hold the episode so far), column 0
  drawn from `first_logits_BV` at positions `start_pos_B`. The drafter: `draft_params`, or None for the policy's
  first `sampler_cfg.spec_draft_layers` layers; the layout `sampler_cfg.spec_layout`. Keys as `generate_speculative`
  uses them, so the turn draws what a speculative re-prefill of the whole context draws (tokens equal, μ up to
  rounding): not `continuation.decode_turn`'s bits.

  A kept cache must hold exactly the turn: the slots of tokens the loop fed past a row's end (drafts a common
  minimum kept after its stop id, columns past N) become holes (segment 0), and each row's last token is fed once
  more at the caches' write index for the logits after it (its earlier slot, if any, a hole too). Needs
  `turn_writes` free slots. Returns (outputs: `continuation.decode_turn`'s
  and the spec_* metrics, cache, dcache, last_logits_BV)."""
  B, N, G = first_logits_BV.shape[0], sampler_cfg.max_new_tokens, gamma + 1
  d_params, draft_cfg = resolve_drafter(params, draft_params, model_cfg, sampler_cfg.spec_draft_layers)
  carry = emit_token(decode_carry(cache, B, N + G, sampler_cfg), first_logits_BV, jax.random.fold_in(key, 0),
                     sampler_cfg)
  carry = {**_loop_carry(carry, dcache, start_pos_B), "slot_BN": jnp.full((B, N + G), -1, jnp.int32)}
  carry = decode_calls(params, d_params, _with_step(carry, N), key, jnp.asarray(N, jnp.int32), None, model_cfg,
                       draft_cfg, sampler_cfg, gamma, sampler_cfg.spec_layout)
  mask_BN = carry["mask_BN"][:, :N]
  last_B = jnp.maximum(jnp.sum(mask_BN, axis=1).astype(jnp.int32) - 1, 0)
  slot_BN = carry["slot_BN"]
  drop_BN = (slot_BN >= 0) & (jnp.arange(N + G)[None, :] >= last_B[:, None])
  holes = lambda c: {**c, "segment_ids_BS": c["segment_ids_BS"].at[
      jnp.arange(B)[:, None], jnp.where(drop_BN, slot_BN, c["segment_ids_BS"].shape[1])].set(0, mode="drop")}
  token_B1 = jnp.take_along_axis(carry["tokens_BN"], last_B[:, None], axis=1)
  at = dict(positions_BT=(start_pos_B + last_B)[:, None].astype(jnp.int32), segment_ids_BT=jnp.ones_like(token_B1))
  logits_B1V, cache = forward_with_cache(params, token_B1, holes(carry["cache"]), model_cfg,
                                         kv_window=sampler_cfg.kv_window_arg, **at)
  if head_drafter.is_head(d_params):  # no cache to fix; the next turn's `extend_drafter` resets the feature
    dcache = carry["dcache"]
  else:
    _, dcache = hidden_with_cache(d_params, token_B1, holes(carry["dcache"]), draft_cfg, **at)
  out = {"tokens_BN": carry["tokens_BN"][:, :N], "mask_BN": mask_BN, "behavior_logp_BN": carry["logp_BN"][:, :N],
         "lengths_B": jnp.sum(mask_BN, axis=1).astype(jnp.int32), **_spec_stats(carry),
         **{k: carry[k][:, :N] for k in behavior.TOPK_FIELDS + behavior.MC_FIELDS if k in carry}}
  return out, cache, dcache, logits_B1V[:, 0]


def turn_writes(sampler_cfg: SamplerConfig, gamma: int) -> int:
  """Slots a `decode_turn` of `gamma` > 0 writes at most: the loop's (N + γ + 1 under "min": the last call starts
  before column N - 1 and writes γ + 1; N·(γ + 1) under "rows": at most N calls of γ + 1 each) and the last token's
  second feed."""
  N, G = sampler_cfg.max_new_tokens, gamma + 1
  return (N + G if sampler_cfg.spec_layout == "min" else N * G) + 1


def gamma_of(sampler_cfg: SamplerConfig, batch: int) -> int:
  """γ of a sampler call of `batch` rows: `spec_gamma`, or `auto_gamma(batch)` for "auto" (0: no speculation)."""
  g = sampler_cfg.spec_gamma
  return auto_gamma(batch) if g == "auto" else int(g)


def _routes(routes_LBSk: Array, slot_BN: Array, P: int) -> Array:
  """`generate`'s routes_BTLk [B, P + N, L, k]: the prompt's slots, then each completion column's routes at the slot
  it was fed in (`slot_BN`); a column never fed (the last one, or past a row's end) holds experts 0..k-1 as
  `generate`'s unwritten slots do."""
  k = routes_LBSk.shape[-1]
  idx_LBN1 = jnp.maximum(slot_BN, 0)[None, :, :, None]
  fed_LBNk = jnp.take_along_axis(routes_LBSk, idx_LBN1, axis=2)
  fed_LBNk = jnp.where((slot_BN >= 0)[None, :, :, None], fed_LBNk, jnp.arange(k, dtype=routes_LBSk.dtype))
  return jnp.moveaxis(jnp.concatenate([routes_LBSk[:, :, :P], fed_LBNk], axis=2), 0, 2)


def layers_drafter(params: dict, model_cfg: ModelConfig, n_layers: int) -> dict:
  """The "layers" drafter's parameters for `generate`: a view of the policy's first `n_layers` layers, sharing its
  embedding, final norm and head (`draft_from_layers`)."""
  return draft_from_layers(params, model_cfg, n_layers)[0]


def drafter_depth(draft_params: dict) -> int:
  """k, the number of decoder layers a drafter's (stacked) parameters hold (static: a shape)."""
  return int(jax.tree.leaves(draft_params["layers"])[0].shape[0])


def resolve_drafter(params: dict, draft_params: dict | None, model_cfg: ModelConfig,
                    n_layers: int) -> tuple[dict, ModelConfig]:
  """(drafter parameters, drafter config) of `sampler.spec_draft_layers` = `n_layers`: `draft_params` (a distilled
  drafter; ValueError when it has another depth), or None for the policy's first layers (`layers_drafter`; inside
  a jitted function, so no copy of them is made per call). A head (`head_drafter`) has no depth: it comes back
  with the policy's config."""
  if head_drafter.is_head(draft_params):
    return draft_params, model_cfg
  if draft_params is None:
    draft_params = layers_drafter(params, model_cfg, n_layers)
  elif drafter_depth(draft_params) != n_layers:
    raise ValueError(f"the drafter has {drafter_depth(draft_params)} layers, sampler.spec_draft_layers={n_layers}")
  return draft_params, dataclasses.replace(model_cfg, n_layers=n_layers)


def generate(params: dict, draft_params: dict, prompt_tokens_BP: Array, prompt_len_B: Array, key: Array,
             model_cfg: ModelConfig, sampler_cfg: SamplerConfig, gamma: int, layout: str = "min") -> dict:
  """`generate_speculative` with a drafter of the policy's architecture cut to k layers: `draft_params` holds the
  embedding, k stacked layers, the final norm and the head (`layers_drafter`: a view of the policy's own; or a
  distilled drafter's, `distill.drafter`), k read off its shapes; or a head (`head_drafter`)."""
  draft_cfg = model_cfg if head_drafter.is_head(draft_params) else dataclasses.replace(
      model_cfg, n_layers=drafter_depth(draft_params))
  return generate_speculative(params, draft_params, prompt_tokens_BP, prompt_len_B, key, model_cfg, draft_cfg,
                              sampler_cfg, gamma, layout)
