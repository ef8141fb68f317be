"""Dataclasses that cross module boundaries, and the dimension key.

Dimension key. A shape-suffixed name spells its array's axes in order, one letter per axis
(`logp_BN` is [B, N], `q_BTKQd` is [B, T, K, Q, d]), and each letter has one meaning everywhere:
  B  batch rows (sequences)
  T  positions of a whole sequence (left-padded prompt + response)
  P  prompt positions (a group's shared prompt prefix in the shared-prefix forward)
  N  response positions (new tokens)
  A  answer positions (a task's right-padded reference target tokens)
  S  key/value positions (attention keys, KV-cache slots)
  C  positions of one chunk (chunked lm-head and vocabulary work)
  V  vocabulary
  D  model width
  F  MLP width
  H  query heads
  K  key/value heads
  Q  query heads per key/value head (H = K * Q)
  d  head dimension (lowercase; h: half of it, the rotary frequencies)
  L  layers
  E  experts
  X  expert capacity (token slots of one expert)
  k  top-k (lowercase): the k best tokens, or the k routed experts as in `routes_BTLk`
  G  rows of one group (group size)
  b  groups (lowercase: one row per group, B / G rows)
  J  Monte-Carlo candidates per position
  U  turns of a multi-turn episode
  Y  domains (multi-teacher distillation: one teacher per domain)
  M  micro-batches or minibatches (stacked updates)
  R  epochs
  1  an axis of size one (kept for broadcasting)
A trailing `_` (`w_D_`) stands for any further axes.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import struct

Array = jax.Array


@struct.dataclass
class LossInputs:
  """Everything a policy loss may read. Only `logp_BN` is differentiated.

  Required fields are always present; optional ones are filled by the learner only when a loss
  declares them in its `needs` (see `jaxrl_llm.losses.registry.NEED_FIELDS`).

  Log-prob fields are log-probabilities of the sampled tokens, already shifted so that position t
  scores token t of the response; padding may hold any value (including -inf): losses sanitise.
  """

  logp_BN: Array  # log π_θ(y_t | s_t), current policy, differentiable.
  mask_BN: Array  # 1 for response tokens that count in the loss, 0 elsewhere.
  adv_BN: Array  # advantage per token (sequence advantages broadcast over tokens).
  prox_logp_BN: Optional[Array] = None  # log π_old: learner-side proximal/old policy (never differentiated).
  behavior_logp_BN: Optional[Array] = None  # log μ: what the sampler actually drew from.
  ref_logp_BN: Optional[Array] = None  # log π_ref for a KL-to-reference term.
  entropy_BN: Optional[Array] = None  # entropy of π_θ at each position (differentiable when computed so).
  versions_BN: Optional[Array] = None  # int: parameter version that generated each token.
  current_version: Optional[Array] = None  # int scalar: version of the parameters being trained.
  lag_B: Optional[Array] = None  # learner_version - behavior_version per sequence.
  behavior_topk_ids_BNk: Optional[Array] = None  # top-k token ids of μ at each position.
  behavior_topk_logp_BNk: Optional[Array] = None  # log μ of those ids.
  topk_logp_BNk: Optional[Array] = None  # log π_θ at μ's top-k ids (for top-k divergences).
  turn_BN: Optional[Array] = None  # int: turn index of each token (multi-turn agents, EPO).
  teacher_logp_BN: Optional[Array] = None  # log π_teacher of the sampled token (distillation).
  teacher_topk_ids_BNk: Optional[Array] = None
  teacher_topk_logp_BNk: Optional[Array] = None
  state: Any = None  # state carried across steps by a loss (R²VPO dual variable, EPO entropy history).
  tokens_BN: Optional[Array] = None  # int: the sampled token ids y_t (top-k membership tests, distillation).
  # --- On-policy distillation (jaxrl_llm/losses/opd_*, gkd_jsd, s2d_opd, f_opd, sdcc). ---
  # Full distributions come either as [B, N, V] logits (tiny vocabularies, tests) or as a
  # `vocab_chunks.VocabHead` (hidden states + lm-head; what the learner and teacher provide), which the
  # losses turn into logits C positions at a time (`losses.dense`): no [B, N, V] array at a real vocabulary.
  student_logits_BNV: Optional[Array] = None  # π_θ logits over the vocabulary (differentiable).
  teacher_logits_BNV: Optional[Array] = None  # teacher logits (or log-probs) over the same vocabulary.
  student_head: Any = None  # VocabHead of π_θ (differentiable hidden states and lm-head).
  teacher_head: Any = None  # VocabHead of the teacher (never differentiated).
  student_topk_logp_BNk: Optional[Array] = None  # log π_θ (full-vocab normalised) at teacher_topk_ids_BNk (differentiable).
  teacher_ref_topk_logp_BNk: Optional[Array] = None  # S²D/Direct-OPD: log π_ref (pre-RL teacher) at teacher_topk_ids_BNk.
  mc_ids_BNJ: Optional[Array] = None  # AsyncOPD MC candidates, J per position; column 0 = y_t.
  mc_logp_BNJ: Optional[Array] = None  # log π_θ at mc_ids_BNJ (differentiable).
  mc_behavior_logp_BNJ: Optional[Array] = None  # log μ (rollout-time student) at mc_ids_BNJ.
  mc_teacher_logp_BNJ: Optional[Array] = None  # log p (teacher) at mc_ids_BNJ.
  sup_drift_B: Optional[Array] = None  # f-OPD supervision drift D^sup per sequence (0 for a frozen teacher).
  eviction_mask_BN: Optional[Array] = None  # SDCC: 1 at eviction points (tokens whose compressed and live contexts differ).
  # --- KV-compressed rollouts (losses/smd.py): π_shadow, the forward under the sampler's visibility mask. ---
  shadow_logp_BN: Optional[Array] = None  # log π_shadow of the sampled token (differentiable).
  shadow_head: Any = None  # VocabHead of π_shadow (never differentiated by the losses that read it).
