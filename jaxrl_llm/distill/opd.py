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
  ref_teacher        "" (off) | "sft" | HF folder path: S²D / Direct-OPD's reference (pre-RL) teacher,
                     loaded like the teacher from its own ref_teacher_d_model, ref_teacher_n_layers,
                     ref_teacher_sft_steps ("sft" only; `distill.teacher.load_teacher(role="ref_teacher")`)

Options with their own sections (off by default; `jaxrl_llm.distill.extras` documents their fields):
  adwin              ADWIN adaptive prefix horizon: the loss trains on the first H tokens of each rollout
  teachers, mopd     Open-MOPD: several teachers (`teacher` = "mopd"), one per prompt domain, M1/M2 budgets
  topk_cache         the teacher's scores of a row computed once and served again (replay)

Loss needs this module provides (`PROVIDED_NEEDS`): teacher_logp, teacher_logits, teacher_topk,
sup_drift (0: a frozen teacher never drifts) and, through the learner's differentiable student
forward, student_logits and student_topk. Scored at candidates the sampler recorded
(`sampling.behavior`, `candidate_needs`): mc (AsyncOPD's Monte-Carlo candidates: the teacher at
`mc_ids_BNJ`) when `sampler.mc_samples` > 0, and teacher_ref_topk (S²D: the student's top-K, i.e. μ's
recorded top-k, become `teacher_topk_ids_BNk`, scored by the teacher and by `distill.ref_teacher`) when
`distill.ref_teacher` is set and `sampler.behavior_topk` > 0. Not provided (configs asking for it fail
at start-up): eviction (SDCC).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import packing
from jaxrl_llm.distill import extras as extras_lib
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
  return PROVIDED_NEEDS + candidate_needs(c) if c.get("distill") and c.distill.teacher else ()


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
  validate_ref_teacher(c)
  if extras_lib.enabled(c) or d.teacher == extras_lib.MOPD_TEACHER:  # ADWIN, Open-MOPD, the teacher cache
    from jaxrl_llm import losses
    if losses.get(c.loss.name).needs & set(candidate_needs(c)):
      raise ConfigError(f"config.loss.name={c.loss.name!r}: reads sampler-recorded candidates, which distill.adwin / "
                        "distill.teachers / distill.topk_cache do not score yet")
    extras_lib.validate(c, extra_fields(c.loss.name))


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
    fields.add("teacher_topk_ids_BNk")
  return tuple(sorted(fields))


def make_batch_extras(c: ml_collections.ConfigDict, *, task, width: int, train_examples, student_cfg,
                      encoder: Encoder = CHAR_ENCODER, demos=None):
  """Loads (or trains once and caches) the frozen teacher; returns `extras(ro, seq, mask) -> dict`.

  `extras` scores the rollout's sequences with the teacher (one jitted forward) and returns the
  `LossInputs` fields the configured loss reads, each [B, N(, k)] over the completion positions, and
  for full-distribution losses `teacher_head` (its [D, V] lm-head is shared by the whole batch; the
  learner does not split it into micro-batches).
  `task` is accepted for the loop's hook signature (the teacher is trained on `train_examples`);
  `encoder` is the run's prompt encoding, whose tokenizer teacher and student share. An agent run (`env.name`)
  passes its episodes' prompt bucket as `width` and `demos` (a callable returning `sft.demo_records`): an "sft"
  teacher learns from those demonstration episodes, and scores every token of an episode in its context (the
  environment's tokens carry mask 0, so only the policy's tokens are distilled).
  """
  del task
  validate(c)
  fields = extra_fields(c.loss.name)
  if extras_lib.enabled(c):  # ADWIN horizons, several teachers (Open-MOPD), the teacher cache: distill/extras.py
    if demos is not None:
      raise config_lib.ConfigError("config.env.name: distill.adwin / distill.teachers / distill.topk_cache score "
                                   "single completions only (not built for episodes yet)")
    return extras_lib.make_batch_extras(c, fields=fields, temperature=scoring_temperature(c), width=width,
                                        train_examples=train_examples, student_cfg=student_cfg, encoder=encoder)
  cfg, params = teacher_lib.load_teacher(c, width, train_examples, student_cfg.vocab_size, encoder, demos=demos)
  # Scored with a chunked lm-head; full-distribution losses also get the teacher's hidden states + lm-head.
  score = teacher_lib.make_teacher_scorer(cfg, scoring_temperature(c), c.distill.topk,
                                          head="teacher_head" in fields, group_size=c.rollout.group_size)
  # AsyncOPD / S²D: the teacher (and S²D's reference teacher) at the sampler's recorded candidates
  cand = make_candidate_scores(c, width=width, train_examples=train_examples, vocab_size=student_cfg.vocab_size,
                               encoder=encoder)

  pack_width = config_lib.read(c, "optim.pack_width")

  def extras(ro, seq, mask_BN) -> dict:
    # The sequences (and, for candidate losses, the ids the sampler recorded) carry everything; a frozen
    # teacher does not depend on the rollout's version.
    pk = None  # `optim.pack_width`: the teacher scores the packed rows too
    if pack_width:
      pk = jax.tree.map(jnp.asarray, packing.pack(*(np.asarray(x) for x in seq), pack_width))
    out = score(params, *seq, mask_BN, *(() if cand is None else (cand.ids(ro),)), pack=pk)
    out["sup_drift_B"] = jnp.zeros((mask_BN.shape[0],), jnp.float32)
    got = {f: out[f] for f in fields}
    return got if cand is None else {**got, **cand.fields(ro, seq, mask_BN, out["gathered_logp_BNk"])}

  return extras


# --- Candidates the sampler recorded (`sampling.behavior`): AsyncOPD's Monte-Carlo draws, S²D's student top-K ---


def candidate_needs(c: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The needs scored at sampler-recorded candidates that a run of `c` (with a teacher) provides: "mc" when
  `sampler.mc_samples` > 0; "teacher_ref_topk" when `distill.ref_teacher` is set and `sampler.behavior_topk`
  > 0 (S²D's candidate set V_K(s_t) is the rollout-time student's top-K, which the sampler records)."""
  out = ("mc",) if config_lib.read(c, "sampler.mc_samples") else ()
  if config_lib.read(c, "distill.ref_teacher") and config_lib.read(c, "sampler.behavior_topk"):
    out += ("teacher_ref_topk",)
  return out


_REF_SFT_FIELDS = ("ref_teacher_d_model", "ref_teacher_n_layers", "ref_teacher_sft_steps")


def validate_ref_teacher(c: ml_collections.ConfigDict) -> None:
  """`distill.ref_teacher` (absent: off): "" | "sft" (with positive `ref_teacher_*` sizes and steps) | a folder."""
  from jaxrl_llm.config import ConfigError
  d = c.distill
  ref = config_lib.read(c, "distill.ref_teacher")
  if not isinstance(ref, str):
    raise ConfigError(f"config.distill.ref_teacher={ref!r}: must be '', 'sft' or a Hugging Face checkpoint folder")
  if ref != "sft":
    return
  for f in _REF_SFT_FIELDS:
    if f not in d:
      raise ConfigError(f"config.distill.{f}: missing (distill.ref_teacher='sft'; see configs/opd_default.py)")
    if not (isinstance(d[f], int) and d[f] > 0):
      raise ConfigError(f"config.distill.{f}={d[f]!r}: must be a positive int")


class CandidateScores:
  """The teacher's fields at the sampler's recorded candidates, for the configured loss (`make_candidate_scores`).

  `ids(ro)`: the ids the teacher gathers in its one forward, [B, N, K + J]: μ's top-K (S²D) then the
  Monte-Carlo candidates (AsyncOPD). `fields(ro, seq, mask_BN, gathered)` splits the teacher's log-probs
  at them into `LossInputs` fields: S²D's `teacher_topk_ids_BNk` (the candidates: the student's top-K),
  `teacher_topk_logp_BNk` and, from one more forward of the reference teacher, `teacher_ref_topk_logp_BNk`;
  AsyncOPD's `mc_teacher_logp_BNJ`.
  """

  def __init__(self, mc: bool, ref=None):
    self.mc, self.ref = mc, ref  # ref: None, or (scorer, params) of the reference teacher (S²D)

  def _sets(self, ro) -> list:
    sets = []
    if self.ref is not None:
      sets.append(("behavior_topk_ids_BNk", ro.behavior_topk_ids_BNk, "sampler.behavior_topk"))
    if self.mc:
      sets.append(("mc_ids_BNJ", ro.mc_ids_BNJ, "sampler.mc_samples"))
    for name, x, field in sets:
      if x is None:
        raise ValueError(f"the rollout has no {name}: the sampler records it only with {field} > 0")
    return [jnp.asarray(x, jnp.int32) for _, x, _ in sets]

  def ids(self, ro):
    return jnp.concatenate(self._sets(ro), axis=-1)

  def fields(self, ro, seq, mask_BN, gathered_BN_) -> dict:
    out, k = {}, 0
    if self.ref is not None:
      ids_BNk = self._sets(ro)[0]
      k = ids_BNk.shape[-1]
      ref_score, ref_params = self.ref
      out["teacher_topk_ids_BNk"] = ids_BNk
      out["teacher_topk_logp_BNk"] = gathered_BN_[..., :k]
      out["teacher_ref_topk_logp_BNk"] = ref_score(ref_params, *seq, mask_BN, ids_BNk)["gathered_logp_BNk"]
    if self.mc:
      out["mc_teacher_logp_BNJ"] = gathered_BN_[..., k:]
    return out


def make_candidate_scores(c: ml_collections.ConfigDict, *, width: int, train_examples, vocab_size: int,
                          encoder: Encoder = CHAR_ENCODER) -> CandidateScores | None:
  """The `CandidateScores` of the configured loss (None when it reads no recorded candidates); loads the
  reference teacher (`distill.ref_teacher`, trained once and cached when "sft") for S²D."""
  from jaxrl_llm import losses
  needs = losses.get(c.loss.name).needs & set(candidate_needs(c))
  if not needs:
    return None
  ref = None
  if "teacher_ref_topk" in needs:
    ref_cfg, ref_params = teacher_lib.load_teacher(c, width, train_examples, vocab_size, encoder, role="ref_teacher")
    ref = (teacher_lib.make_teacher_scorer(ref_cfg, scoring_temperature(c), 0, group_size=c.rollout.group_size),
           ref_params)
  return CandidateScores(mc="mc" in needs, ref=ref)
