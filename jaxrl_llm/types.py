"""Dataclasses that cross module boundaries, and the dimension key.

Dimension key used in every shape-suffixed name:
  B batch (sequences), T time (tokens), V vocabulary, D model width, H query heads,
  K key/value heads or top-k, G group size, E experts, L layers, S cache slots, P prompt width, N new tokens.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import struct

Array = jax.Array


@struct.dataclass
class LossInputs:
  """Everything a policy loss may read. Only `logp_BT` is differentiated.

  Required fields are always present; optional ones are filled by the learner only when a loss
  declares them in its `needs` (see `jaxrl_llm.losses.registry.NEED_FIELDS`).

  Log-prob fields are log-probabilities of the sampled tokens, already shifted so that position t
  scores token t of the response; padding may hold any value (including -inf): losses sanitise.
  """

  logp_BT: Array  # log π_θ(y_t | s_t), current policy, differentiable.
  mask_BT: Array  # 1 for response tokens that count in the loss, 0 elsewhere.
  adv_BT: Array  # advantage per token (sequence advantages broadcast over tokens).
  prox_logp_BT: Optional[Array] = None  # log π_old: learner-side proximal/old policy (never differentiated).
  behavior_logp_BT: Optional[Array] = None  # log μ: what the sampler actually drew from.
  ref_logp_BT: Optional[Array] = None  # log π_ref for a KL-to-reference term.
  entropy_BT: Optional[Array] = None  # entropy of π_θ at each position (differentiable when computed so).
  versions_BT: Optional[Array] = None  # int: parameter version that generated each token.
  current_version: Optional[Array] = None  # int scalar: version of the parameters being trained.
  lag_B: Optional[Array] = None  # learner_version - behavior_version per sequence.
  behavior_topk_ids_BTK: Optional[Array] = None  # top-k token ids of μ at each position.
  behavior_topk_logp_BTK: Optional[Array] = None  # log μ of those ids.
  topk_logp_BTK: Optional[Array] = None  # log π_θ at μ's top-k ids (for top-k divergences).
  turn_BT: Optional[Array] = None  # int: turn index of each token (multi-turn agents, EPO).
  teacher_logp_BT: Optional[Array] = None  # log π_teacher of the sampled token (distillation).
  teacher_topk_ids_BTK: Optional[Array] = None
  teacher_topk_logp_BTK: Optional[Array] = None
  state: Any = None  # state carried across steps by a loss (R²VPO dual variable, EPO entropy history).
  tokens_BT: Optional[Array] = None  # int: the sampled token ids y_t (top-k membership tests, distillation).
  # --- On-policy distillation (jaxrl_llm/losses/opd_*, gkd_jsd, s2d_opd, f_opd, sdcc). ---
  # Full distributions come either as [B, T, V] logits (tiny vocabularies, tests) or as a
  # `vocab_chunks.VocabHead` (hidden states + lm-head; what the learner and teacher provide), which the
  # losses turn into logits C positions at a time (`losses.dense`): no [B, T, V] array at a real vocabulary.
  student_logits_BTV: Optional[Array] = None  # π_θ logits over the vocabulary (differentiable).
  teacher_logits_BTV: Optional[Array] = None  # teacher logits (or log-probs) over the same vocabulary.
  student_head: Any = None  # VocabHead of π_θ (differentiable hidden states and lm-head).
  teacher_head: Any = None  # VocabHead of the teacher (never differentiated).
  student_topk_logp_BTK: Optional[Array] = None  # log π_θ (full-vocab normalised) at teacher_topk_ids_BTK (differentiable).
  teacher_ref_topk_logp_BTK: Optional[Array] = None  # S²D/Direct-OPD: log π_ref (pre-RL teacher) at teacher_topk_ids_BTK.
  mc_ids_BTN: Optional[Array] = None  # AsyncOPD MC candidates, N per position (N: MC samples); column 0 = y_t.
  mc_logp_BTN: Optional[Array] = None  # log π_θ at mc_ids_BTN (differentiable).
  mc_behavior_logp_BTN: Optional[Array] = None  # log μ (rollout-time student) at mc_ids_BTN.
  mc_teacher_logp_BTN: Optional[Array] = None  # log p (teacher) at mc_ids_BTN.
  sup_drift_B: Optional[Array] = None  # f-OPD supervision drift D^sup per sequence (0 for a frozen teacher).
  eviction_mask_BT: Optional[Array] = None  # SDCC: 1 at eviction points (tokens whose compressed and live contexts differ).
