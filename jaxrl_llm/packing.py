"""The packed learner: the real tokens of several sequences share one row, so no FLOP is spent on padding.

A learner batch is B rows of T = P + N columns (left-padded prompt, response, then padding after EOS). With
`optim.pack_width = W > 0` the host packs each row's real span (its columns from the first to the last real
token, `segment_ids_BT > 0`) into rows of width W, first-fit-decreasing by length. Inside a packed row each
sequence's segments get the row's next segment ids (one segment, or an evicted episode's several: its row is
already a packing of contexts), so attention never crosses sequences nor, within one, segments
(`models.transformer`: equal ids attend causally, 0 = padding); positions are copied from the padded batch, so
each sequence sees exactly the context and RoPE phases it had there. The forward scores every packed position
once (`packed_logprobs`) and gathers the per-token outputs back into the padded [B, N] layout on device, so
losses, advantages (group structure untouched: rows keep their order and index) and metrics read the same
`LossInputs` as the padded path.

Static shapes: the number of packed rows R is rounded up to a multiple of ceil(Bc / 8) (Bc rows per chunk), so
a run compiles at most 8 shapes per step function. Micro-batches and minibatches (`optim.grad_accum`,
`optim.minibatches`) cut the batch into contiguous chunks along B; each chunk is packed on its own into R rows
(`Packing.rows`), so the learner's reshape into chunks cuts the packed arrays along the same boundaries.

Evicted episodes (`rollout.evict`): each later segment of a row opens with a copy of the first message. The
loop packs with `prompt_len=P`, which leaves such a copy out but for its last token (`shared_copies`: only where
its tokens, positions and replayed routes equal the first message's) and lets the segment attend to the first
message written once in segment 1 (`attention_mask`, MemoryWalker's packed replay with a shared prompt): every
policy token keeps exactly its context, and each eviction costs one first-message token instead of all of them
(`learner_copies_skipped` in the metrics). `col_BT` maps each padded column to its packed one for the gather back.

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
  col_BT: Array | None = None  # int32 packed column of each padded column in the sequence's row (-1: not packed)
  routes_RWLk: Array | None = None  # MoE: the sampler's expert ids of every packed token (routing replay)
  # the first message shared by an evicted episode's segments (`pack(prompt_len=)`; None when no copy was dropped):
  share_RW: Array | None = None  # int32 packed id of the sequence's first segment, on tokens of a segment whose
  shared_RW: Array | None = None  # copy was dropped (else 0); bool: a first-message token those segments attend to
  rows: int = struct.field(pytree_node=False, default=1)  # packed rows per chunk


def _spans(segment_ids_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(first column, length) of each row's real span (all its segments: an evicted episode's row holds several)."""
  real_BT = segment_ids_BT > 0
  any_B = real_BT.any(1)
  T = real_BT.shape[1]
  first_B = np.where(any_B, real_BT.argmax(1), 0)
  last_B = np.where(any_B, T - 1 - real_BT[:, ::-1].argmax(1), -1)
  return first_B.astype(np.int32), (last_B - first_B + 1).clip(0).astype(np.int32)


def shared_copies(sequence_T: np.ndarray, positions_T: np.ndarray, segment_ids_T: np.ndarray, P: int,
                  routes_T: np.ndarray | None = None) -> np.ndarray:
  """Bool [T]: the columns of one row that the packed learner leaves out because they repeat its first message.

  An evicted episode's segments 2, 3, ... each open with a copy of the first message (`rollout.evict`). A copy
  whose tokens, positions (and replayed MoE routes) equal the first message's is left out but for its last token:
  that token (same position, same id) then attends to the first message's other tokens, written once in segment
  1, and to itself, which is exactly the context it had, so it goes on scoring the segment's next token. A copy
  that differs in anything (a re-rendered context) is kept whole. The first message is the real prompt columns."""
  drop = np.zeros(len(segment_ids_T), bool)
  pc = np.flatnonzero(segment_ids_T[:P] > 0)
  n = len(pc)
  if n < 2:
    return drop
  seg = segment_ids_T
  starts = np.flatnonzero((seg > 1) & (seg != np.r_[0, seg[:-1]]))
  for c in starts:
    ok = (c + n <= len(seg) and (seg[c:c + n] == seg[c]).all() and (sequence_T[c:c + n] == sequence_T[pc]).all()
          and (positions_T[c:c + n] == positions_T[pc]).all()
          and (routes_T is None or (routes_T[c:c + n] == routes_T[pc]).all()))
    if ok:
      drop[c:c + n - 1] = True
  return drop


def compact_width(sequence_BT, positions_BT, segment_ids_BT, P: int, routes_BTLk=None) -> int:
  """The row width at which the padded rows of T columns fit one each once their copies of the first message are
  left out (`shared_copies`): the longest such span, rounded up to a multiple of ceil(T / 8) (so a run compiles
  at most 8 widths); T when no copy is left out (nothing to gain)."""
  seq, pos, seg = (np.asarray(x) for x in (sequence_BT, positions_BT, segment_ids_BT))
  T = seg.shape[1]
  first_B, span_B = _spans(seg)
  routes = None if routes_BTLk is None else np.asarray(routes_BTLk)
  kept = [int(n) - int(shared_copies(seq[b], pos[b], seg[b], P, None if routes is None else routes[b]).sum())
          for b, n in enumerate(span_B)]
  if kept == [int(n) for n in span_B]:
    return T
  step = math.ceil(T / BUCKETS)
  return min(T, max(2, math.ceil(max(kept) / step) * step))


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
         routes_BTLk=None, prompt_len: int = 0, rows: int = 0) -> Packing:
  """Host-side packing of a padded batch (numpy in, numpy out): see the module docstring. `shards`: the packed
  rows are laid out over that many devices (the mesh's batch axes), so each chunk's R rows are rounded up until
  `shards` divides the chunks' R · chunks rows (the extra rows are padding). `prompt_len` P > 0 (the padded
  prompt width): an evicted episode's copies of its first message are left out (`shared_copies`) and its later
  segments attend to the first message written once (`share_RW`, `shared_RW`). `rows` > 0: that many packed rows
  per chunk (before the `shards` rounding) instead of the bucketed count."""
  seq, pos, seg = (np.asarray(x) for x in (sequence_BT, positions_BT, segment_ids_BT))
  B, T = seq.shape
  if B % chunks:
    raise ValueError(f"config.optim.pack_width: {chunks} chunks must divide the batch of {B} rows")
  Bc = B // chunks
  routes = None if routes_BTLk is None else np.asarray(routes_BTLk)
  first_B, span_B = _spans(seg)
  cols, drops = [], []  # the padded columns each sequence packs, in order: its span less the dropped copies
  for b in range(B):
    f, n = int(first_B[b]), int(span_B[b])
    drop = np.zeros(T, bool)
    if prompt_len and n:
      drop = shared_copies(seq[b], pos[b], seg[b], prompt_len, None if routes is None else routes[b])
    cols.append(f + np.flatnonzero(~drop[f:f + n]))
    drops.append(drop)
  len_B = np.asarray([len(x) for x in cols], np.int32)
  placed = [first_fit_decreasing(len_B[c * Bc:(c + 1) * Bc], width) for c in range(chunks)]
  R = rows or bucket_rows(max(p[2] for p in placed), Bc)
  q = shards // math.gcd(shards, chunks)  # R must be a multiple of q for `shards` to divide chunks · R
  R = math.ceil(R / q) * q
  row_B = np.concatenate([p[0] for p in placed])
  start_B = np.concatenate([p[1] for p in placed])
  tokens, positions, segments, share = (np.zeros((chunks * R, width), np.int32) for _ in range(4))
  shared = np.zeros((chunks * R, width), bool)
  col_BT = np.full((B, T), -1, np.int32)
  routes_out = None if routes is None else np.zeros((chunks * R, width) + routes.shape[2:], np.int32)
  counts = np.zeros(chunks * R, np.int32)
  for b in range(B):
    n = int(len_B[b])
    if n == 0:
      continue
    r, s, c = (b // Bc) * R + int(row_B[b]), int(start_B[b]), cols[b]
    tokens[r, s:s + n] = seq[b, c]
    positions[r, s:s + n] = pos[b, c]
    col_BT[b, c] = s + np.arange(n)
    # the row's own segments (one, or an evicted episode's several) get the packed row's next ids, so equal ids
    # stay equal and distinct ones distinct; padding inside a span stays padding
    span = seg[b, c]
    ids = np.unique(span[span > 0])
    segments[r, s:s + n] = np.where(span > 0, counts[r] + 1 + np.searchsorted(ids, span), 0)
    if n < span_B[b]:  # copies were dropped: their segments see the first message (all but its last token)
      first_id = counts[r] + 1 + np.searchsorted(ids, seg[b, prompt_len - 1])
      pc = np.flatnonzero(seg[b, :prompt_len] > 0)
      shared[r, col_BT[b, pc[:-1]]] = True
      opened = np.unique(seg[b][drops[b]])
      share[r, s:s + n] = np.where(np.isin(span, opened), first_id, 0)
    counts[r] += len(ids)
    if routes_out is not None:  # routes are per token: they travel with their tokens
      routes_out[r, s:s + n] = routes[b, c]
  dropped = bool((len_B < span_B).any())
  return Packing(tokens_RW=tokens, positions_RW=positions, segment_ids_RW=segments, row_B=row_B, start_B=start_B,
                 first_B=first_B, len_B=len_B, col_BT=col_BT, routes_RWLk=routes_out,
                 share_RW=share if dropped else None, shared_RW=shared if dropped else None, rows=R)


def unpack(p: Packing, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(sequence_BT, positions_BT, real_BT) rebuilt from a packing at padded width T (host; the inverse of `pack`
  on the packed tokens: padding and dropped copies come back as 0 / False)."""
  B = len(p.len_B)
  chunks = p.tokens_RW.shape[0] // p.rows
  seq, pos, real = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32), np.zeros((B, T), bool)
  col_BT = np.asarray(p.col_BT)
  for b in range(B):
    r = (b // (B // chunks)) * p.rows + int(p.row_B[b])
    c = np.flatnonzero(col_BT[b] >= 0)
    seq[b, c], pos[b, c] = p.tokens_RW[r, col_BT[b, c]], p.positions_RW[r, col_BT[b, c]]
    real[b, c] = p.segment_ids_RW[r, col_BT[b, c]] > 0
  return seq, pos, real


def source_index(p: Packing, T: int, n_new: int) -> tuple[Array, Array]:
  """(idx_BN, valid_BN) on device: completion position j of sequence b (the padded column T - n_new + j) is
  scored by the packed output at flat index idx into [R_total · (W - 1)] (logits at the previous packed column);
  valid where the token and the column before it were packed next to each other (not at a span's first token,
  nor where a dropped copy sat before it)."""
  B = p.len_B.shape[0]
  R_tot, W = p.tokens_RW.shape
  Bc = B // (R_tot // p.rows)
  cols = (T - n_new) + jnp.arange(n_new)  # padded columns of the scored tokens
  at_BN, before_BN = p.col_BT[:, cols], p.col_BT[:, cols - 1]
  valid_BN = (before_BN >= 0) & (at_BN == before_BN + 1)
  row_B = (jnp.arange(B) // Bc) * p.rows + p.row_B
  idx_BN = row_B[:, None] * (W - 1) + before_BN
  return jnp.where(valid_BN, idx_BN, 0).astype(jnp.int32), valid_BN


def attention_mask(p: Packing) -> Array | None:
  """The packed rows' [R, W, W] attention mask where a first message is shared (`pack(prompt_len=)`): the
  segment rule, plus a later segment's query seeing its sequence's shared first-message keys before it.
  None without sharing (the model's own segment mask)."""
  if p.share_RW is None:
    return None
  seg = p.segment_ids_RW
  W = seg.shape[1]
  causal = jnp.arange(W)[None, :] <= jnp.arange(W)[:, None]
  same = seg[:, :, None] == seg[:, None, :]
  shared = (p.share_RW[:, :, None] > 0) & (p.share_RW[:, :, None] == seg[:, None, :]) & p.shared_RW[:, None, :]
  return causal[None] & (same | shared)


def packed_logprobs(params, p: Packing, T: int, n_new: int, cfg: ModelConfig, temperature: float,
                    with_entropy: bool = False, gather_ids_BNk=None, return_hidden: bool = False, topk: int = 0,
                    keep_routes: bool = False) -> dict:
  """`learner.completion_logprobs` of the padded batch (T columns, last `n_new` scored), computed on the packed
  rows and returned in the padded [B, n_new] layout ("logp_BT", optionally "entropy_BT", "gathered_logp_BTk",
  "hidden_BTD", and with `topk` > 0 "topk_logp_BTk", "topk_ids_BTk", "topk_residual_logp_BT" as in
  `models.token_logprobs`). Positions no sequence token is scored at (padding) hold 0. Differentiable.
  `keep_routes` (MoE): also "routes_RWLk", the expert ids this forward used, in the packed layout (last column 0)."""
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
  mask = attention_mask(p)
  out = token_logprobs(params, p.tokens_RW[:, :-1], p.tokens_RW[:, 1:], cfg, positions_BT=p.positions_RW[:, :-1],
                       segment_ids_BT=p.segment_ids_RW[:, :-1], temperature=temperature, with_entropy=with_entropy,
                       gather_ids_BTk=gather_RWk, return_hidden=return_hidden, topk=topk, routes_BTLk=routes,
                       mask_BTT=None if mask is None else mask[:, :-1, :-1])

  def back(x):  # [R_tot, W-1, ...] -> [B, n_new, ...], 0 where nothing is scored
    got = x.reshape(R_tot * (W - 1), *x.shape[2:])[idx_BN]
    return jnp.where(valid_BN.reshape(*valid_BN.shape, *(1,) * (got.ndim - 2)), got, jnp.zeros((), got.dtype))

  got = {k: back(v) for k, v in out.items() if k in ("logp_BT", "entropy_BT", "gathered_logp_BTk", "hidden_BTD",
                                                    "topk_logp_BTk", "topk_ids_BTk", "topk_residual_logp_BT")}
  if "router_aux_loss" in out:  # MoE: the load-balancing loss over the packed rows' real tokens (a scalar)
    got["router_aux_loss"] = out["router_aux_loss"]
  if keep_routes and "routes_BTLk" in out:
    used = out["routes_BTLk"]
    got["routes_RWLk"] = jnp.pad(used, ((0, 0), (0, 1)) + ((0, 0),) * (used.ndim - 2))
  return got


def skipped_tokens(p: Packing, segment_ids_BT) -> int:
  """How many tokens of the padded rows' spans the packing left out (the dropped copies of first messages)."""
  return int(_spans(np.asarray(segment_ids_BT))[1].sum() - np.asarray(p.len_B).sum())


def pad_frac(segment_ids: np.ndarray) -> float:
  """Fraction of token slots that are padding (segment id 0): the padded batch's or the packed rows'."""
  seg = np.asarray(segment_ids)
  return float(1.0 - (seg > 0).sum() / max(seg.size, 1))


def packing_scorer(score, width: int):
  """A `learner.make_score_fn` scorer with the plain signature `(params, sequence_BT, positions_BT, segment_ids_BT,
  mask_BN, routes_BTLk=None)` that packs on the host and scores the packed rows (π_old recompute, at generation
  and in async workers)."""

  def packed_score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, routes_BTLk=None):
    P = np.shape(sequence_BT)[1] - np.shape(mask_BN)[1]
    pk = jax.tree.map(jnp.asarray, pack(sequence_BT, positions_BT, segment_ids_BT, width, routes_BTLk=routes_BTLk,
                                        prompt_len=P))
    return score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, pack=pk)

  packed_score._cache_size = score._cache_size  # the loop reports the scorer's compiles
  return packed_score
