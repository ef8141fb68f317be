"""The packed learner: the real tokens of several sequences share one row, so no FLOP is spent on padding.

A learner batch is B rows of T = P + N columns (left-padded prompt, response, then padding after EOS). With
`optim.pack_width = W > 0` the host packs each row's real span (its columns from the first to the last real
token, `segment_ids_BT > 0`) into rows of width W, first-fit-decreasing by length. Inside a packed row each
sequence's segments get the row's next segment ids (one segment, or an evicted episode's several: its row is
already a packing of contexts), so attention never crosses sequences nor, within one, segments
(`models.transformer`: equal ids attend causally, 0 = padding); positions are copied from the padded batch, so
each sequence sees exactly the context and RoPE phases it had there. The forward scores every packed position once (`packed_logprobs`) and gathers
the per-token outputs back into the padded [B, N] layout on device, so losses, advantages (group structure
untouched: rows keep their order and index) and metrics read the same `LossInputs` as the padded path.

Static shapes: the number of packed rows R is rounded up to a multiple of ceil(Bc / 8) (Bc rows per chunk), so
a run compiles at most 8 shapes per step function. Micro-batches and minibatches (`optim.grad_accum`,
`optim.minibatches`) cut the batch into contiguous chunks along B; each chunk is packed on its own into R rows
(`Packing.rows`), so the learner's reshape into chunks cuts the packed arrays along the same boundaries.

On a mesh the packed rows are split over the batch axes like the padded rows (`pack(shards=...)` pads the row
count to a multiple of the shard count); the per-sequence fields go with their sequences.

MoE: the sampler's routes (routing replay) are packed with their tokens and replayed on the packed rows; the
load-balancing loss covers the same real tokens (its value differs from the padded path's only in which
row-final tokens the shifted forward leaves out). Not supported (refused by `config.validate` with a ConfigError
naming `optim.pack_width`): MoE with a capacity limit (token drops depend on how many tokens share a call), ALP's
per-row noise and the SMD shadow forward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_llm.models import ModelConfig, token_logprobs

Array = jax.Array
BUCKETS = 8  # distinct packed row counts per chunk size: bounds the recompilations


@struct.dataclass
class Packing:
  """B sequences packed into `chunks · rows` rows of width W, and where each sequence went.

  Per-sequence fields lead with B so the learner's micro-batch reshape cuts them with the padded fields."""
  tokens_RW: Array  # int32 token ids of the packed rows (0 on padding)
  positions_RW: Array  # int32 positions, copied from the padded batch
  segment_ids_RW: Array  # int32 1..k per packed row, 0 on padding
  row_B: Array  # int32 packed row of each sequence, counted within its chunk
  start_B: Array  # int32 column where the sequence's span starts in that row
  first_B: Array  # int32 padded column of the span's first token
  len_B: Array  # int32 span length (0: an empty row, placed nowhere)
  routes_RWLk: Array | None = None  # MoE: the sampler's expert ids of every packed token (routing replay)
  rows: int = struct.field(pytree_node=False, default=1)  # packed rows per chunk


def _spans(segment_ids_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(first column, length) of each row's real span (all its segments: an evicted episode's row holds several)."""
  real_BT = segment_ids_BT > 0
  any_B = real_BT.any(1)
  T = real_BT.shape[1]
  first_B = np.where(any_B, real_BT.argmax(1), 0)
  last_B = np.where(any_B, T - 1 - real_BT[:, ::-1].argmax(1), -1)
  return first_B.astype(np.int32), (last_B - first_B + 1).clip(0).astype(np.int32)


def first_fit_decreasing(len_B: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(row_B, start_B, rows used): sequences of lengths `len_B` placed into rows of `width`, longest first,
  each into the first row with room (ties by index, so the packing is deterministic)."""
  order = sorted(range(len(len_B)), key=lambda b: (-int(len_B[b]), b))
  fill: list[int] = []
  row_B = np.zeros(len(len_B), np.int32)
  start_B = np.zeros(len(len_B), np.int32)
  for b in order:
    n = int(len_B[b])
    if n == 0:
      continue
    if n > width:
      raise ValueError(f"config.optim.pack_width={width}: a sequence has {n} real tokens; the width must hold "
                       "the longest prompt + completion")
    r = next((i for i, f in enumerate(fill) if f + n <= width), len(fill))
    if r == len(fill):
      fill.append(0)
    row_B[b], start_B[b] = r, fill[r]
    fill[r] += n
  return row_B, start_B, len(fill)


def bucket_rows(n: int, chunk_rows: int) -> int:
  """`n` rounded up to a multiple of ceil(chunk_rows / BUCKETS), at least 1 and at most chunk_rows."""
  step = max(1, math.ceil(chunk_rows / BUCKETS))
  return max(1, min(chunk_rows, math.ceil(max(n, 1) / step) * step))


def pack(sequence_BT, positions_BT, segment_ids_BT, width: int, chunks: int = 1, shards: int = 1,
         routes_BTLk=None) -> Packing:
  """Host-side packing of a padded batch (numpy in, numpy out): see the module docstring. `shards`: the packed
  rows are laid out over that many devices (the mesh's batch axes), so each chunk's R rows are rounded up until
  `shards` divides the chunks' R · chunks rows (the extra rows are padding)."""
  seq, pos, seg = (np.asarray(x) for x in (sequence_BT, positions_BT, segment_ids_BT))
  B = seq.shape[0]
  if B % chunks:
    raise ValueError(f"config.optim.pack_width: {chunks} chunks must divide the batch of {B} rows")
  Bc = B // chunks
  first_B, len_B = _spans(seg)
  placed = [first_fit_decreasing(len_B[c * Bc:(c + 1) * Bc], width) for c in range(chunks)]
  R = bucket_rows(max(p[2] for p in placed), Bc)
  q = shards // math.gcd(shards, chunks)  # R must be a multiple of q for `shards` to divide chunks · R
  R = math.ceil(R / q) * q
  row_B = np.concatenate([p[0] for p in placed])
  start_B = np.concatenate([p[1] for p in placed])
  tokens, positions, segments = (np.zeros((chunks * R, width), np.int32) for _ in range(3))
  routes = None if routes_BTLk is None else np.asarray(routes_BTLk)
  routes_out = None if routes is None else np.zeros((chunks * R, width) + routes.shape[2:], np.int32)
  counts = np.zeros(chunks * R, np.int32)
  for b in range(B):
    n = int(len_B[b])
    if n == 0:
      continue
    r, s, f = (b // Bc) * R + int(row_B[b]), int(start_B[b]), int(first_B[b])
    tokens[r, s:s + n] = seq[b, f:f + n]
    positions[r, s:s + n] = pos[b, f:f + n]
    # the row's own segments (one, or an evicted episode's several) get the packed row's next ids, so equal ids
    # stay equal and distinct ones distinct; padding inside a span stays padding
    span = seg[b, f:f + n]
    ids = np.unique(span[span > 0])
    segments[r, s:s + n] = np.where(span > 0, counts[r] + 1 + np.searchsorted(ids, span), 0)
    counts[r] += len(ids)
    if routes_out is not None:  # routes are per token: they travel with their tokens
      routes_out[r, s:s + n] = routes[b, f:f + n]
  return Packing(tokens_RW=tokens, positions_RW=positions, segment_ids_RW=segments, row_B=row_B, start_B=start_B,
                 first_B=first_B, len_B=len_B, routes_RWLk=routes_out, rows=R)


def unpack(p: Packing, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(sequence_BT, positions_BT, real_BT) rebuilt from a packing at padded width T (host; the inverse of `pack`
  on real tokens: padding columns come back as 0 / False)."""
  B = len(p.len_B)
  chunks = p.tokens_RW.shape[0] // p.rows
  seq, pos, real = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32), np.zeros((B, T), bool)
  for b in range(B):
    n, f, s = int(p.len_B[b]), int(p.first_B[b]), int(p.start_B[b])
    r = (b // (B // chunks)) * p.rows + int(p.row_B[b])
    seq[b, f:f + n], pos[b, f:f + n] = p.tokens_RW[r, s:s + n], p.positions_RW[r, s:s + n]
    real[b, f:f + n] = p.segment_ids_RW[r, s:s + n] > 0
  return seq, pos, real


def source_index(p: Packing, T: int, n_new: int) -> tuple[Array, Array]:
  """(idx_BN, valid_BN) on device: completion position j of sequence b (the padded column T - n_new + j) is
  scored by the packed output at flat index idx into [R_total · (W - 1)] (logits at the previous column);
  valid where both columns lie in the sequence's span."""
  B = p.len_B.shape[0]
  R_tot, W = p.tokens_RW.shape
  Bc = B // (R_tot // p.rows)
  col_BN = (T - n_new) + jnp.arange(n_new)[None, :]  # padded column of the scored token
  rel_BN = col_BN - 1 - p.first_B[:, None]  # its context's last column, relative to the span
  valid_BN = (rel_BN >= 0) & (rel_BN + 1 < p.len_B[:, None])
  row_B = (jnp.arange(B) // Bc) * p.rows + p.row_B
  idx_BN = row_B[:, None] * (W - 1) + p.start_B[:, None] + rel_BN
  return jnp.where(valid_BN, idx_BN, 0).astype(jnp.int32), valid_BN


def packed_logprobs(params, p: Packing, T: int, n_new: int, cfg: ModelConfig, temperature: float,
                    with_entropy: bool = False, gather_ids_BNk=None, return_hidden: bool = False, topk: int = 0) -> dict:
  """`learner.completion_logprobs` of the padded batch (T columns, last `n_new` scored), computed on the packed
  rows and returned in the padded [B, n_new] layout ("logp_BT", optionally "entropy_BT", "gathered_logp_BTk",
  "hidden_BTD", and with `topk` > 0 "topk_logp_BTk", "topk_ids_BTk", "topk_residual_logp_BT" as in
  `models.token_logprobs`). Positions no sequence token is scored at (padding) hold 0. Differentiable."""
  R_tot, W = p.tokens_RW.shape
  idx_BN, valid_BN = source_index(p, T, n_new)
  gather_RWk = None
  if gather_ids_BNk is not None:  # the id sets to gather, moved to the packed positions that score them
    k = gather_ids_BNk.shape[-1]
    dest = jnp.where(valid_BN, idx_BN, R_tot * (W - 1)).reshape(-1)
    flat = jnp.full((R_tot * (W - 1), k), -1, jnp.int32).at[dest].set(
        jnp.asarray(gather_ids_BNk, jnp.int32).reshape(-1, k), mode="drop")
    gather_RWk = flat.reshape(R_tot, W - 1, k)
  routes = None if p.routes_RWLk is None else p.routes_RWLk[:, :-1]
  out = token_logprobs(params, p.tokens_RW[:, :-1], p.tokens_RW[:, 1:], cfg, positions_BT=p.positions_RW[:, :-1],
                       segment_ids_BT=p.segment_ids_RW[:, :-1], temperature=temperature, with_entropy=with_entropy,
                       gather_ids_BTk=gather_RWk, return_hidden=return_hidden, topk=topk, routes_BTLk=routes)

  def back(x):  # [R_tot, W-1, ...] -> [B, n_new, ...], 0 where nothing is scored
    got = x.reshape(R_tot * (W - 1), *x.shape[2:])[idx_BN]
    return jnp.where(valid_BN.reshape(*valid_BN.shape, *(1,) * (got.ndim - 2)), got, jnp.zeros((), got.dtype))

  got = {k: back(v) for k, v in out.items() if k in ("logp_BT", "entropy_BT", "gathered_logp_BTk", "hidden_BTD",
                                                    "topk_logp_BTk", "topk_ids_BTk", "topk_residual_logp_BT")}
  if "router_aux_loss" in out:  # MoE: the load-balancing loss over the packed rows' real tokens (a scalar)
    got["router_aux_loss"] = out["router_aux_loss"]
  return got


def pad_frac(segment_ids: np.ndarray) -> float:
  """Fraction of token slots that are padding (segment id 0): the padded batch's or the packed rows'."""
  seg = np.asarray(segment_ids)
  return float(1.0 - (seg > 0).sum() / max(seg.size, 1))


def packing_scorer(score, width: int):
  """A `learner.make_score_fn` scorer with the plain signature `(params, sequence_BT, positions_BT, segment_ids_BT,
  mask_BN, routes_BTLk=None)` that packs on the host and scores the packed rows (π_old recompute, at generation
  and in async workers)."""

  def packed_score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, routes_BTLk=None):
    pk = jax.tree.map(jnp.asarray, pack(sequence_BT, positions_BT, segment_ids_BT, width, routes_BTLk=routes_BTLk))
    return score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, pack=pk)

  packed_score._cache_size = score._cache_size  # the loop reports the scorer's compiles
  return packed_score
