"""On-policy distillation inside the RL loop: teacher scores attached to every rollout batch.

`loop.setup` calls `make_batch_extras` when the config has a `distill` section with a non-empty
`distill.teacher`; the returned `extras(ro, seq, mask) -> dict` is evaluated in `loop.make_batch`,
i.e. when the batch is built from the rollout, and its arrays become `LossInputs` fields. The teacher
therefore scores exactly the states the (possibly stale) behaviour policy visited, and with a frozen
teacher the supervision of a lagged batch is the same as if it had been scored when generated.
AsyncOPD's question (how stale can OPD be?) is then a question about the loss: forward-KL targets
do not depend on the student, the sampled-token reverse-KL advantage log p − log μ does.

Config section `distill` (documented with defaults in configs/opd_default.py):
  teacher            "" (off) | "sft" (train a larger teacher on the task, cached) | HF folder path
  teacher_d_model    teacher width ("sft" only)
  teacher_n_layers   teacher depth ("sft" only)
  teacher_sft_steps  SFT steps of the teacher ("sft" only; batch size and lr are `sft.*`)
  teacher_cache_dir  where SFT teachers are cached ("" = ~/.cache/jaxrl_llm/teachers)
  topk               width K of the teacher top-k cache
  temperature        teacher scoring temperature; 0 = the sampler's (`sampler.temperature`), which is
                     also the temperature the learner applies to the student, so both sides of every
                     divergence are compared at the same T.

Loss needs this module provides (`PROVIDED_NEEDS`): teacher_logp, teacher_logits, teacher_topk,
sup_drift (0: a frozen teacher never drifts) and, through the learner's differentiable student
forward, student_logits and student_topk. Not provided (configs asking for them fail at start-up):
mc (AsyncOPD multi-sample caches), teacher_ref_topk (S²D's pre-RL teacher), eviction (SDCC).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections

from jaxrl_llm import config as config_lib
from jaxrl_llm.distill import teacher as teacher_lib
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder

PROVIDED_NEEDS = ("teacher_logp", "teacher_logits", "teacher_topk", "sup_drift", "student_logits", "student_topk")
# Needs whose fields this module fills; the student_* ones are computed by the learner.
_TEACHER_NEEDS = ("teacher_logp", "teacher_logits", "teacher_topk", "sup_drift")
# Fields every distill section must have, and those only the "sft" teacher reads.
_COMMON_FIELDS = ("teacher", "teacher_cache_dir", "topk", "temperature")
_SFT_FIELDS = ("teacher_d_model", "teacher_n_layers", "teacher_sft_steps")


def provided_needs(c: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The loss needs this module supplies to a run of config `c`: `PROVIDED_NEEDS` when `distill.teacher` is set."""
  return PROVIDED_NEEDS if c.get("distill") and c.distill.teacher else ()


config_lib.register_needs("distill", provided_needs)  # config.validate accepts OPD losses once this is imported


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first missing or invalid `config.distill.*` field."""
  from jaxrl_llm.config import ConfigError
  d = c.get("distill")
  if d is None:
    raise ConfigError("config.distill: missing (on-policy distillation needs a distill section with a teacher)")
  fields = _COMMON_FIELDS + (_SFT_FIELDS if d.get("teacher") == "sft" else ())
  for f in fields:
    if f not in d:
      raise ConfigError(f"config.distill.{f}: missing (see configs/opd_default.py for the distill fields)")
  if not isinstance(d.teacher, str) or not d.teacher:
    raise ConfigError(f"config.distill.teacher={d.teacher!r}: must be 'sft' or a Hugging Face checkpoint folder")
  for f in fields:
    if f in _SFT_FIELDS and not (isinstance(d[f], int) and d[f] > 0):
      raise ConfigError(f"config.distill.{f}={d[f]!r}: must be a positive int")
  if not (isinstance(d.topk, int) and d.topk > 0):
    raise ConfigError(f"config.distill.topk={d.topk!r}: must be a positive int")
  if not d.temperature >= 0:
    raise ConfigError(f"config.distill.temperature={d.temperature!r}: must be >= 0 (0 = sampler.temperature)")


def scoring_temperature(c: ml_collections.ConfigDict) -> float:
  """The teacher's scoring temperature: `distill.temperature`, or the sampler's when it is 0."""
  return float(c.distill.temperature or c.sampler.temperature)


def extra_fields(loss_name: str) -> tuple[str, ...]:
  """The `LossInputs` fields the teacher must fill for `loss_name` (sorted; empty for non-OPD losses).

  Full distributions ("teacher_logits") come as the chunked alternative, a `teacher_head` (hidden
  states + lm-head), never as [B, N, V] logits.
  """
  from jaxrl_llm import losses
  from jaxrl_llm.losses.registry import NEED_ALTERNATIVES, NEED_FIELDS
  needs = losses.get(loss_name).needs
  fields = {f for n in needs & set(_TEACHER_NEEDS) for f in NEED_ALTERNATIVES.get(n, NEED_FIELDS[n])}
  if "student_topk" in needs:  # the learner gathers the student at the teacher's ids
    fields.add("teacher_topk_ids_BTK")
  return tuple(sorted(fields))


def make_batch_extras(c: ml_collections.ConfigDict, *, task, width: int, train_examples, student_cfg,
                      encoder: Encoder = CHAR_ENCODER):
  """Loads (or trains once and caches) the frozen teacher; returns `extras(ro, seq, mask) -> dict`.

  `extras` scores the rollout's sequences with the teacher (one jitted forward) and returns the
  `LossInputs` fields the configured loss reads, each [B, N(, K)] over the completion positions, and
  for full-distribution losses `teacher_head` (its [D, V] lm-head is shared by the whole batch; the
  learner does not split it into micro-batches).
  `task` is accepted for the loop's hook signature (the teacher is trained on `train_examples`);
  `encoder` is the run's prompt encoding, whose tokenizer teacher and student share.
  """
  del task
  validate(c)
  fields = extra_fields(c.loss.name)
  cfg, params = teacher_lib.load_teacher(c, width, train_examples, student_cfg.vocab_size, encoder)
  # Scored with a chunked lm-head; full-distribution losses also get the teacher's hidden states + lm-head.
  score = teacher_lib.make_teacher_scorer(cfg, scoring_temperature(c), c.distill.topk,
                                          head="teacher_head" in fields, group_size=c.rollout.group_size)

  def extras(ro: dict, seq, mask_BN) -> dict:
    del ro  # the sequences carry everything; a frozen teacher does not depend on the rollout's version
    out = score(params, *seq, mask_BN)
    out["sup_drift_B"] = jnp.zeros((mask_BN.shape[0],), jnp.float32)
    return {f: out[f] for f in fields}

  return extras
