"""MemoryWalker (arXiv 2609.00865, spec A7): exact training replays of rollouts whose context was evicted.

Rollout format (host side, one rollout): the *physical stream* `tokens_T` of every token ever written, in
write order, and `end_T`, the lifetime end ω(j) of each token: the first physical index whose live view
no longer contains j (T when never evicted). Token i's live view is {j ≤ i : ω(j) > i}; the policy
produced token i from the view of its *parent*, the last token before i in that view. Harness-written
tokens (summaries E_k, tool outputs) are ordinary physical tokens with loss mask 0.

Exactness needs the views to form a tree (LogitTree's root-to-leaf branches over a shared trunk): every
token in i's view must have had, when it was written, exactly i's view up to itself. An eviction of the
*tail* of the current view (a finished tool call, a thought, a sub-agent's trajectory) always keeps
this; evicting a middle block while later tokens survive does not (those tokens would have to be
re-encoded, i.e. re-written as new physical tokens). `check_tree` raises otherwise.

Two exact replays, both equal to recomputing each token under its own view:
  (a) LogitTree: one sequence per leaf branch (K evictions -> K+1 forwards); each loss token is counted
      on exactly one branch (the first containing it), so the shared trunk is counted once.
  (b) Packed 4D mask: one forward over the physical stream with the visibility mask M_ij = [j ≤ i < ω(j)]
      and per-token RoPE positions = depth in the tree (in a tree, a key's position is the same for every
      row that sees it, so each row's visible keys are gap-free). The model's `hidden` only takes segment
      ids, so `hidden_masked` below is a dense-mask forward built from `models.layers`; a production path
      needs an explicit mask argument in `models.transformer.hidden` (or a splash-attention block mask).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.logprobs import head_logprobs, token_logprobs
from jaxrl_llm.models.transformer import lm_head_weights

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Host-side structure (numpy).


def lifetimes_from_events(T: int, events) -> np.ndarray:
  """ω per physical token from eviction events (at, start, end): writing token `at` evicts [start, end)."""
  end_T = np.full(T, T, np.int64)
  for at, start, stop in events:
    if not 0 <= start <= stop <= at <= T:
      raise ValueError(f"eviction event {(at, start, stop)} must satisfy 0 <= start <= end <= at <= T={T}")
    end_T[start:stop] = np.minimum(end_T[start:stop], at)
  return end_T


def visibility(end_T) -> np.ndarray:
  """[T, T] bool: vis[i, j] = j ≤ i < ω(j) (query i sees key j)."""
  end_T = np.asarray(end_T)
  T = end_T.shape[0]
  idx = np.arange(T)
  return (idx[None, :] <= idx[:, None]) & (end_T[None, :] > idx[:, None])


def check_tree(vis) -> None:
  """Raises ValueError unless every visible key j of row i saw exactly row i's view up to itself."""
  T = vis.shape[0]
  for i in range(T):
    if not vis[i, i]:
      raise ValueError(f"token {i} is evicted before it is written (ω({i}) <= {i})")
    for j in np.flatnonzero(vis[i, :i]):
      if not np.array_equal(vis[j, : j + 1], vis[i, : j + 1]):
        raise ValueError(f"views are not a tree: token {j} (visible to {i}) was written under a different context")


def parents(vis) -> np.ndarray:
  """Parent of each token (last earlier visible token), -1 for a root (no prediction for it)."""
  T = vis.shape[0]
  out = np.full(T, -1, np.int64)
  for i in range(T):
    prev = np.flatnonzero(vis[i, :i])
    if prev.size:
      out[i] = prev[-1]
  return out


def depths(vis) -> np.ndarray:
  """RoPE position of each token: its index within its own view."""
  return vis.sum(-1) - 1


def eviction_points(end_T) -> np.ndarray:
  """SDCC's diverging leaves: tokens whose view in the final compressed stream (survivors only) differs
  from their live view at generation time, i.e. some token they saw was evicted later. [T] float {0,1}.

  Nonzero only for middle evictions (non-tree rollouts, which the exact replays reject): there SDCC
  trains the cheap compressed-stream forward toward the live-view teacher at exactly these tokens.
  """
  end_T = np.asarray(end_T)
  vis = visibility(end_T)
  survivor = end_T >= end_T.shape[0]
  return ((vis & ~survivor[None, :]).any(-1) & survivor).astype(np.float32)


def build_packed(tokens_T, end_T, loss_mask_T) -> dict:
  """Packed-replay inputs for one rollout: tokens, depth positions, [T, T] mask, parents, loss mask."""
  vis = visibility(end_T)
  check_tree(vis)
  par = parents(vis)
  return {
      "tokens_T": np.asarray(tokens_T, np.int32),
      "positions_T": depths(vis).astype(np.int32),
      "mask_TT": vis,
      "parent_T": par.astype(np.int32),
      "loss_mask_T": ((np.asarray(loss_mask_T) > 0) & (par >= 0)).astype(np.float32),
  }


def build_logit_tree(tokens_T, end_T, loss_mask_T) -> dict:
  """LogitTree inputs: one right-padded row per leaf branch (its root-to-leaf view).

  Row b, position k predicts branch token k+1: `targets_BT`, its physical index `target_src_BT` (-1 on
  padding), and `loss_mask_BT`, set only on the first branch containing that token (trunk counted once).
  """
  tokens_T = np.asarray(tokens_T)
  vis = visibility(end_T)
  check_tree(vis)
  par = parents(vis)
  T = tokens_T.shape[0]
  leaves = [i for i in range(T) if not np.any(par == i)]
  paths = [np.flatnonzero(vis[leaf]) for leaf in leaves]
  L = max(len(p) for p in paths)
  nb = len(paths)
  out = {k: np.zeros((nb, L), np.int32) for k in ("tokens_BT", "targets_BT", "segment_ids_BT")}
  out["target_src_BT"] = np.full((nb, L), -1, np.int32)
  out["loss_mask_BT"] = np.zeros((nb, L), np.float32)
  counted = np.zeros(T, bool)
  for b, path in enumerate(paths):
    n = len(path)
    out["tokens_BT"][b, :n] = tokens_T[path]
    out["segment_ids_BT"][b, :n] = 1
    out["targets_BT"][b, : n - 1] = tokens_T[path[1:]]
    out["target_src_BT"][b, : n - 1] = path[1:]
    for k, j in enumerate(path[1:]):
      if not counted[j] and loss_mask_T[j] > 0:
        out["loss_mask_BT"][b, k] = 1.0
        counted[j] = True
  out["positions_BT"] = np.broadcast_to(np.arange(L, dtype=np.int32), (nb, L)).copy()
  return out


# ---------------------------------------------------------------------------------------------
# Device side (jittable).


def hidden_masked(params: dict, tokens_BT: Array, cfg: ModelConfig, *, positions_BT: Array, mask_BTT: Array) -> Array:
  """Final-normed hidden states under an arbitrary [B, T, T] attention mask (the model's own layers).

  Every row of the mask must allow at least its own position.
  """
  from jaxrl_llm.models.transformer import hidden  # noqa: PLC0415
  return hidden(params, tokens_BT, cfg, positions_BT=positions_BT, mask_BTT=mask_BTT)


def packed_logprobs(params: dict, packed: dict, cfg: ModelConfig) -> Array:
  """log π(token_i | view of its parent) for every physical token [T] (0 for roots), one forward."""
  tokens = jnp.asarray(packed["tokens_T"])[None]
  h = hidden_masked(params, tokens, cfg, positions_BT=jnp.asarray(packed["positions_T"])[None],
                    mask_BTT=jnp.asarray(packed["mask_TT"])[None])
  par = jnp.asarray(packed["parent_T"])
  # Token i is scored at its parent's position; the chunked lm-head holds no [T, V] logits.
  h_parent = h[:, jnp.maximum(par, 0)].astype(cfg.compute_dtype)
  out = head_logprobs(h_parent, tokens, lm_head_weights(params, cfg))["logp_BT"][0]
  return jnp.where(par >= 0, out, 0.0)


def logit_tree_logprobs(params: dict, tree: dict, cfg: ModelConfig, T: int) -> Array:
  """Per physical token [T]: its log-prob from the branch that counts it (0 elsewhere); K+1 rows, one forward each."""
  lp = token_logprobs(params, jnp.asarray(tree["tokens_BT"]), jnp.asarray(tree["targets_BT"]), cfg,
                      positions_BT=jnp.asarray(tree["positions_BT"]),
                      segment_ids_BT=jnp.asarray(tree["segment_ids_BT"]))["logp_BT"]
  m = jnp.asarray(tree["loss_mask_BT"]) > 0
  src = jnp.where(m, jnp.asarray(tree["target_src_BT"]), T)  # uncounted slots scatter into a dropped bin
  return jnp.zeros(T + 1, jnp.float32).at[src.reshape(-1)].add(jnp.where(m, lp, 0.0).reshape(-1))[:T]
