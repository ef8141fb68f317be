"""Context compression in episodes (config `env.evict`), and the exact layout that trains it.

Eviction (`rollout.episodes`): before a turn, an episode whose live context (the ids the policy will be prompted
with) is longer than `env.context_budget` tokens is compressed:

- "drop_oldest": the oldest complete turns after the first message (policy tokens and the observation that
  answered them) are removed until the context fits, keeping at least `env.keep_last_turns` turns; nothing
  happens when only those are left.
- "summary": when appending an observation would take the context past the budget, the observation goes with a
  fixed instruction (`EnvSettings.summary_instruction`, one more user message) and the next turn is the policy's
  summary (policy tokens, trained like any others, never sent to the environment; it counts as a turn). The
  context then becomes the first message, the summary and the last observation again (re-rendered after the
  summary), and the following turn acts. There must be a turn left to act (none starts in the last two turns).

The record keeps one row per episode (GRPO groups and sequence-mean aggregation unchanged) and is exact with
respect to what the policy saw (MemoryWalker's LogitTree, spec A7, with its K+1 forwards packed in one row):
the row is the concatenation of the live contexts. Segment 1 is the left-padded first message and the turns
generated under it; each eviction opens a new segment in the response that starts with a copy of the compressed
context (positions restarting at 0, its own segment id, mask 0: copies are context, never trained), followed by
the tokens generated under it. Attention never crosses segments (the model's segment rule), so every policy token
is scored by the learner, π_old recompute and the reference under exactly the context it was sampled with. Copies
keep their original turn ids (-1 on the copied first message) and carry the version of the turn they open. The
learner packs such rows with the first message written once (`packing.pack(prompt_len=)`, MemoryWalker's packed
replay; `shared_prompt_layout` below is the same layout as a standalone dense mask, for checks and the bench).

SDCC (`losses.sdcc`, MemoryWalker): for the policy tokens of the first turn after each eviction, the teacher is
the same policy on the uncompressed context (the live context just before the eviction; for "summary", the context
before the instruction with the last observation appended plainly). `teacher_layout` packs
those teacher contexts (each followed by the turn's tokens) into one extra row per episode; `sdcc_extras` runs
the learner's parameters over it (stop-gradient) and returns the `teacher_head` and `eviction_mask_BN` the loss
reads. The student is the learner's ordinary forward over the compressed segment.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import ModelConfig, lm_head_weights
from jaxrl_llm.models.transformer import hidden
from jaxrl_llm.vocab_chunks import VocabHead

EVICT_POLICIES = ("none", "drop_oldest", "summary")
# Keys of `Rollout.extra` written by episodes with eviction (all lead with B; `sdcc_extras` consumes the layout).
TEACHER_KEYS = ("sdcc_teacher_seq_BU", "sdcc_teacher_pos_BU", "sdcc_teacher_seg_BU", "sdcc_teacher_src_BN")


def drop_oldest(turn_L: Sequence[int], budget: int, keep_last: int) -> np.ndarray | None:
  """Which tokens of a live context survive "drop_oldest" (bool [L]), or None when nothing is evicted.

  `turn_L`: the turn id of each live token, -1 on the first message (always kept; it leads the context);
  the turns after it are whole, in order. The oldest turns are dropped until at most `budget` tokens are
  left, but the last `keep_last` turns always stay.
  """
  turn_L = np.asarray(turn_L)
  if len(turn_L) <= budget:
    return None
  turns = list(dict.fromkeys(int(x) for x in turn_L if x >= 0))  # distinct turns in order
  keep = np.ones(len(turn_L), bool)
  for t in turns[:max(0, len(turns) - keep_last)]:
    if keep.sum() <= budget:
      break
    keep &= turn_L != t
  return None if keep.all() else keep


def segment_layout(positions_BT: np.ndarray, segment_ids_BT: np.ndarray, starts: Sequence[Sequence[int]],
                   used_B: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
  """`episodes.record_layout`'s (positions, segments) with the eviction segments of each row applied:
  `starts[b]` lists the response columns where row b's segments 2, 3, ... begin; each runs to the next start
  (or `used_B[b]`), gets id k and positions 0, 1, .... Rows without evictions are returned unchanged."""
  pos, seg = positions_BT.copy(), segment_ids_BT.copy()
  for b, st in enumerate(starts):
    ends = list(st[1:]) + [int(used_B[b])]
    for k, (a, e) in enumerate(zip(st, ends)):
      seg[b, P + a:P + e] = k + 2
      pos[b, P + a:P + e] = np.arange(e - a)
  return pos, seg


def shared_prompt_layout(sequence_BT: np.ndarray, positions_BT: np.ndarray, segment_ids_BT: np.ndarray,
                         plen_B: np.ndarray, P: int) -> dict:
  """The packed-4D-mask alternative to the segment row (MemoryWalker's packed replay, spec A7): the first message
  is written once and shared by every segment, so each segment's leading copy of it is removed.

  Returns the compacted `tokens_BS`, `positions_BS` (each token keeps its record position: a copy had the
  prompt's length, so positions are unchanged), the `mask_BSS` (query i sees key j ≤ i of its own segment or of
  the first message; a padded query sees itself) for `models.transformer.hidden(mask_BTT=)`, and `src_BS`, the
  record column of each kept token (-1 on padding). S = the longest compacted row. Exact only where every segment
  opens with a copy of the first message (`drop_oldest`, which always keeps it).
  """
  B, T = sequence_BT.shape
  keep_rows = []
  for b in range(B):
    seg = segment_ids_BT[b]
    first = np.r_[True, seg[1:] != seg[:-1]] & (seg > 1)
    drop = np.zeros(T, bool)
    for c in np.flatnonzero(first):
      drop[c:c + int(plen_B[b])] = True
    keep_rows.append(np.flatnonzero((seg > 0) & ~drop))
  S = max(len(k) for k in keep_rows)
  src = np.full((B, S), -1, np.int32)
  for b, k in enumerate(keep_rows):
    src[b, :len(k)] = k
  safe = np.maximum(src, 0)
  take = lambda x: np.where(src >= 0, np.take_along_axis(x, safe, 1), 0).astype(np.int32)
  seg_BS, col_BS = take(segment_ids_BT), np.where(src >= 0, src, T)
  real = src >= 0
  prompt = real & (col_BS < P)
  idx = np.arange(S)
  mask = (idx[None, None, :] <= idx[None, :, None]) & real[:, None, :] & real[:, :, None] & (
      (seg_BS[:, :, None] == seg_BS[:, None, :]) | prompt[:, None, :])
  mask |= np.eye(S, dtype=bool)[None]
  return {"tokens_BS": take(sequence_BT), "positions_BS": take(positions_BT), "mask_BSS": mask, "src_BS": src}


def teacher_layout(pending: Sequence[tuple], resp_BN: np.ndarray, mask_BN: np.ndarray, turn_BN: np.ndarray,
                   width: int, pad_id: int) -> tuple[dict, int]:
  """SDCC's teacher rows and the eviction mask (module docstring); (extra dict, evictions left out).

  `pending`: (row b, uncompressed context ids U, first response column of the turn after the eviction, turn t).
  The teacher segment of an eviction is U followed by that turn's policy tokens X (the contiguous run of mask-1
  columns of turn t from the given column); segments are packed in the row's `width` columns, positions from 0
  per segment. `sdcc_teacher_src_BN[b, n]` is the teacher column whose output predicts response token n (-1 when
  none); `eviction_mask_BN` is 1 on those tokens. An eviction whose segment does not fit (or whose turn produced
  no policy token) is left out and counted.
  """
  B, N = resp_BN.shape
  seq = np.full((B, width), pad_id, np.int32)
  pos = np.zeros((B, width), np.int32)
  seg = np.zeros((B, width), np.int32)
  src = np.full((B, N), -1, np.int32)
  evict_BN = np.zeros((B, N), np.float32)
  fill = np.zeros(B, np.int64)
  skipped = 0
  for b, ctx, x0, t in pending:
    x1 = x0
    while x1 < N and mask_BN[b, x1] > 0 and turn_BN[b, x1] == t:
      x1 += 1
    row = list(ctx) + resp_BN[b, x0:x1].tolist()
    f = int(fill[b])
    if x1 == x0 or f + len(row) > width:
      skipped += 1
      continue
    seq[b, f:f + len(row)] = row
    pos[b, f:f + len(row)] = np.arange(len(row))
    seg[b, f:f + len(row)] = seg[b].max() + 1
    src[b, x0:x1] = f + len(ctx) - 1 + np.arange(x1 - x0)
    evict_BN[b, x0:x1] = 1.0
    fill[b] = f + len(row)
  extra = dict(zip(TEACHER_KEYS, (seq, pos, seg, src)))
  extra["eviction_mask_BN"] = evict_BN
  return extra, skipped


def teacher_hidden(params, seq_BU, pos_BU, seg_BU, src_BN, cfg: ModelConfig) -> jax.Array:
  """The policy's final hidden states over the teacher rows, gathered at `src_BN` ([B, N, D]; zeros where -1)."""
  h_BUD = hidden(params, seq_BU, cfg, positions_BT=pos_BU, segment_ids_BT=seg_BU)
  h_BND = jnp.take_along_axis(h_BUD, jnp.maximum(src_BN, 0)[..., None], axis=1)
  return jnp.where(src_BN[..., None] >= 0, h_BND, 0).astype(cfg.compute_dtype)


_teacher_hidden = jax.jit(teacher_hidden, static_argnames=("cfg",))


def sdcc_extras(params, extra: dict, cfg: ModelConfig, temperature: float, with_teacher: bool) -> dict:
  """The loss inputs of an episode record's eviction `extra`: `eviction_mask_BN`, and with `with_teacher` the
  `teacher_head` (the policy `params` over the uncompressed contexts, stop-gradient; `losses.sdcc`'s teacher)."""
  out = {"eviction_mask_BN": jnp.asarray(extra["eviction_mask_BN"])}
  if with_teacher:
    seq, pos, seg, src = (jnp.asarray(extra[k]) for k in TEACHER_KEYS)
    h = jax.lax.stop_gradient(_teacher_hidden(params, seq, pos, seg, src, cfg))
    # a copy: the learner step donates `params`, so the batch must not hold one of its buffers
    w_DV = jnp.array(lm_head_weights(params, cfg), copy=True)
    out["teacher_head"] = VocabHead(hidden_BND=h, w_DV=w_DV, temperature=temperature)
  return out
