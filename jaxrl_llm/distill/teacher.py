"""A frozen teacher for on-policy distillation: its model config, where its weights come from, scoring.

Two sources (config `distill.teacher`):
  "sft"       a larger model of the student's family (`distill.teacher_d_model`, `teacher_n_layers`)
              trained by a teacher-forced SFT on the task's reference answers (`sft.sft_warm_start`,
              `distill.teacher_sft_steps` steps). It is trained once per (task, seed, size, SFT
              settings) and cached as a Hugging Face folder under `distill.teacher_cache_dir`; later
              runs load the cached folder bit for bit.
  PATH        any Hugging Face checkpoint folder (`models.load_hf`) sharing the student's tokenizer: same
              vocabulary size and, when the folder has tokenizer files, the same tokens.

A second, reference teacher (`distill.ref_teacher`: S²D / Direct-OPD's pre-RL checkpoint of the teacher)
comes from the same two sources with its own fields (`distill.ref_teacher_d_model`, `ref_teacher_n_layers`,
`ref_teacher_sft_steps`): every function here takes `role` ("teacher" or "ref_teacher"), the prefix of
the fields it reads. An "sft" reference starts from the teacher's initialisation, so at the teacher's size
it is the same model trained for fewer (or more) steps; equal settings share one cached folder.

Teacher and student share the run's tokenizer and prompt encoding (`tasks.encoder.Encoder`): the
"sft" teacher is trained on prompts and targets encoded exactly like the student's, and exported
with that tokenizer.

Scoring (`make_teacher_scorer`) is one jitted forward of the teacher over the student's sampled
sequences with a chunked lm-head (no [B, N, V] array): the teacher's log-prob of each sampled
completion token, a top-k cache (ids, log-probs, residual log-mass) and, for full-distribution
losses, its final hidden states with its lm-head (`vocab_chunks.VocabHead`), all aligned with the
completion positions [B, N(, k|D)] exactly like `learner.completion_logprobs` aligns the student's.

Sharding: on a multi-device mesh (`config.mesh` with more than one device) the teacher's parameters
are placed with `sharding.TEACHER` (the sampler layout: tensor/expert-parallel, replicated over
data/fsdp), see `place_teacher`. On one device they stay on the default device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxrl_llm import packing, policy_init, sft
from jaxrl_llm import config as config_lib
from jaxrl_llm.config import task_kwargs
from jaxrl_llm.models import ModelConfig, forward, init_params, lm_head_weights, token_logprobs
from jaxrl_llm.models.logprobs import query_hidden, token_logprobs_shared
from jaxrl_llm.models.transformer import logits_from_hidden
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder
from jaxrl_llm.vocab_chunks import VocabHead

Array = jax.Array


ROLES = ("teacher", "ref_teacher")  # prefixes of the distill fields of each frozen teacher


def teacher_model_config(c: ml_collections.ConfigDict, width: int, vocab_size: int,
                         role: str = "teacher") -> ModelConfig:
  """The SFT teacher's architecture: the student's from-scratch model (`policy_init.model_config`) at
  `distill.teacher_d_model` x `distill.teacher_n_layers` (`role` "ref_teacher": `distill.ref_teacher_*`).

  d_ff scales with d_model (same MLP ratio as the student); heads keep the student's head_dim, and
  n_heads / n_kv_heads scale with d_model when it is a multiple of the student's width (GQA ratio kept).
  """
  m = c.model
  d_model, n_layers = c.distill[f"{role}_d_model"], c.distill[f"{role}_n_layers"]
  student = policy_init.model_config(c, width, vocab_size)
  heads = {}
  if d_model % m.d_model == 0:
    k = d_model // m.d_model
    heads = {"n_heads": m.n_heads * k, "n_kv_heads": m.n_kv_heads * k}
  # dense even for an MoE student: the teacher is any model sharing the tokenizer, and it is cached as a Hugging
  # Face (llama-family) export
  teacher = dataclasses.replace(student, d_model=d_model, n_layers=n_layers,
                                d_ff=max(1, round(m.d_ff * d_model / m.d_model)),
                                layer_unroll=policy_init.layer_unroll(c, n_layers), num_experts=0, **heads)
  return policy_init.resolve_remat(c, teacher, width)[0]  # "auto": decided for the teacher's own shapes


def teacher_schedule(c: ml_collections.ConfigDict, role: str = "teacher") -> sft.SftSchedule:
  """The SFT teacher's schedule: the run's `sft.*` with `distill.teacher_sft_steps` (`{role}_sft_steps`) steps."""
  return sft.SftSchedule.from_config(c, steps=c.distill[f"{role}_sft_steps"])


def cache_key(c: ml_collections.ConfigDict, width: int, vocab_size: int, encoder: Encoder = CHAR_ENCODER,
              role: str = "teacher") -> str:
  """Folder name of the cached SFT teacher: task + seed + size + a hash of everything that shapes it
  (its architecture and SFT schedule; the tokenizer and chat settings too, unless they are the default
  char tokenizer in raw mode)."""
  cfg, schedule = teacher_model_config(c, width, vocab_size, role), teacher_schedule(c, role)
  what = {"task": c.task.name, "kwargs": task_kwargs(c), "source": c.task.source, "seed": c.seed,
          "prompt_width": c.task.prompt_width, "model": dataclasses.asdict(cfg), "sft": dataclasses.asdict(schedule)}
  if config_lib.env_on(c):  # an agent's teacher: trained on demonstration episodes of its environment
    e = c.env
    what["env"] = {"name": e.name, "kwargs": dict(config_lib.read(c, "env.kwargs")), "max_turns": e.max_turns,
                   "prompt_width": e.prompt_width, "max_episode_tokens": e.max_episode_tokens,
                   "demos": config_lib.read(c, "sft.demos"), "player": demo_player(c)}
  if not encoder.exact_char_widths:
    what["tokenizer"] = {"source": str(getattr(encoder.tokenizer, "source", type(encoder.tokenizer).__name__)),
                         "vocab_size": encoder.tokenizer.vocab_size, "chat": encoder.chat,
                         "system_prompt": encoder.system_prompt}
  h = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:10]
  name = c.task.name if "env" not in what else "env_" + "".join(ch if ch.isalnum() else "_" for ch in c.env.name)
  return f"{name}_s{c.seed}_d{cfg.d_model}_l{cfg.n_layers}_sft{schedule.steps}_{h}"


def cache_dir(c: ml_collections.ConfigDict) -> str:
  """Root of the teacher cache: `distill.teacher_cache_dir`, or ~/.cache/jaxrl_llm/teachers when empty."""
  return c.distill.teacher_cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_llm", "teachers")


def train_sft_teacher(c: ml_collections.ConfigDict, width: int, train_examples,
                      encoder: Encoder = CHAR_ENCODER, role: str = "teacher",
                      demos=None) -> tuple[ModelConfig, Any, float]:
  """(config, params, final SFT loss) of a freshly initialised teacher trained by SFT on the task, or for an agent
  (`demos`: a callable returning `sft.demo_records`) on demonstration episodes (`width` the episode's prompt
  bucket, `env.max_episode_tokens` its response budget)."""
  cfg = teacher_model_config(c, width, encoder.tokenizer.vocab_size, role)
  # Its own init key, so the teacher never shares an initialisation with the student of the same seed.
  params = init_params(cfg, jax.random.fold_in(jax.random.key(c.seed), 0x7EAC))
  if demos is not None:
    params, loss = sft.sft_on_demos(teacher_schedule(c, role), cfg, params, demos(), width, c.env.max_episode_tokens,
                                    encoder)
  else:
    params, loss = sft.sft_warm_start(teacher_schedule(c, role), cfg, params, train_examples, width, encoder)
  return cfg, params, loss


def demo_player(c: ml_collections.ConfigDict) -> str:
  """The scripted player an agent's "sft" teacher imitates: `distill.teacher_demo_player`, else `sft.demo_player`."""
  return config_lib.read(c, "distill.teacher_demo_player") or config_lib.read(c, "sft.demo_player")


def load_teacher(c: ml_collections.ConfigDict, width: int, train_examples, vocab_size: int,
                 encoder: Encoder = CHAR_ENCODER, role: str = "teacher", demos=None) -> tuple[ModelConfig, Any]:
  """The frozen teacher (config, params): an HF folder, or the cached (trained on first use) SFT teacher.

  `vocab_size` is the student's model vocabulary; `encoder` the run's prompt encoding (its tokenizer
  is the one teacher and student share). Raises ConfigError naming `config.distill.teacher` when the
  folder is missing, its vocabulary or tokenizer differs from the student's, or its context is
  shorter than a prompt plus `sampler.max_new_tokens`. `role` "ref_teacher": the reference teacher of
  `distill.ref_teacher` (errors name that field).
  """
  from jaxrl_llm.config import ConfigError
  from jaxrl_llm.models import load_hf, save_hf
  # an episode's context with env; ECHO's diagnosis and refinement rows with rollout.echo
  seq_len = max(width + c.sampler.max_new_tokens, config_lib.env_length(c), config_lib.echo_length(c, width),
                config_lib.pats_length(c, width))
  source, field = c.distill[role], f"config.distill.{role}"
  if source == "sft":
    path = os.path.join(cache_dir(c), cache_key(c, width, encoder.tokenizer.vocab_size, encoder, role))
    if not os.path.exists(os.path.join(path, "config.json")):
      cfg, params, _ = train_sft_teacher(c, width, train_examples, encoder, role, demos)
      tmp = f"{path}.tmp{os.getpid()}"
      save_hf(tmp, cfg, params)
      encoder.tokenizer.save(tmp)
      try:  # a concurrent run (or another process of this one) may cache the same teacher first: keep theirs
        os.replace(tmp, path)
      except OSError:
        if not os.path.exists(os.path.join(path, "config.json")):
          raise
        shutil.rmtree(tmp)
  else:
    path = source
    if not os.path.exists(os.path.join(path, "config.json")):
      raise ConfigError(f"{field}={path!r}: not 'sft' and not a Hugging Face checkpoint folder "
                        "(no config.json there)")
  cfg, params = load_hf(path, param_dtype="float32")
  if cfg.vocab_size != vocab_size:
    raise ConfigError(f"{field}={source!r}: teacher vocab_size={cfg.vocab_size} does not "
                      f"match the student's vocab_size={vocab_size}")
  check_shared_tokenizer(c, path, encoder.tokenizer, role)
  if cfg.max_seq_len < seq_len:
    raise ConfigError(f"{field}={source!r}: the teacher's context of {cfg.max_seq_len} "
                      f"tokens is shorter than the run's {seq_len} (prompt width {width} + sampler.max_new_tokens "
                      f"{c.sampler.max_new_tokens}, or an episode's context)")
  cfg = dataclasses.replace(cfg, dtype=c.model.dtype, max_seq_len=max(cfg.max_seq_len, seq_len))
  return cfg, place_teacher(params, cfg, c)


def check_shared_tokenizer(c: ml_collections.ConfigDict, path: str, tokenizer, role: str = "teacher") -> None:
  """Raises ConfigError when the teacher folder's own tokenizer (if it has one) is not the student's."""
  from jaxrl_llm.config import ConfigError
  from jaxrl_llm.models.tokenizer import CheckpointTokenizer, has_tokenizer_files, load_checkpoint_tokenizer
  from jaxrl_llm.tasks.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
  if has_tokenizer_files(path):
    same = isinstance(tokenizer, CheckpointTokenizer) and \
        load_checkpoint_tokenizer(path).hf.get_vocab() == tokenizer.hf.get_vocab()
  elif os.path.isfile(os.path.join(path, CHAR_TOKENIZER_FILE)):
    same = isinstance(tokenizer, CharTokenizer)
  else:
    return  # a folder without tokenizer files (older exports): only the vocabulary size is checked
  if not same:
    raise ConfigError(f"config.distill.{role}={c.distill[role]!r}: the teacher's tokenizer ({path}) is not the "
                      "student's; on-policy distillation compares both models token by token")


def place_teacher(params, cfg: ModelConfig, c: ml_collections.ConfigDict):
  """Shards the teacher with `sharding.TEACHER` on a multi-device `config.mesh` (the learner's devices, which
  score the batch); unchanged on one device."""
  m = c.get("mesh")
  if m is None or math.prod((m.data, m.fsdp, m.tensor, m.expert)) <= 1:
    return params
  from jaxrl_llm import multiprocess, sharding
  # the learner's devices: with `rollout.sampler_devices` the last ones of every process are the sampler's
  learner_devices, _ = multiprocess.split_devices(jax.devices(), config_lib.read(c, "rollout.sampler_devices"))
  mesh = sharding.mesh_from_config(m, devices=learner_devices)
  return sharding.reshard(params, sharding.param_shardings(cfg, mesh, sharding.TEACHER))


def teacher_logits(params, cfg: ModelConfig, sequence_BT: Array, positions_BT: Array, segment_ids_BT: Array,
                   n_new: int, group_size: int = 1) -> Array:
  """float32 teacher logits [B, N, V] predicting each of the last `n_new` tokens (the sampler's alignment).

  A dense reference for tiny vocabularies and tests: scoring (`score_completions`) never forms them.
  `group_size` G > 1: each group of G rows sharing its prompt runs the prompt once (`models.query_hidden`)."""
  P = sequence_BT.shape[1] - n_new
  if group_size > 1:
    h_BND = query_hidden(params, sequence_BT[:, :-1], cfg, query_start=P - 1, group_size=group_size,
                         positions_BT=positions_BT[:, :-1], segment_ids_BT=segment_ids_BT[:, :-1])
    return logits_from_hidden(params, h_BND, cfg)
  logits = forward(params, sequence_BT[:, :-1], cfg, positions_BT=positions_BT[:, :-1],
                   segment_ids_BT=segment_ids_BT[:, :-1])
  return logits[:, P - 1:].astype(jnp.float32)


def score_completions(params, cfg: ModelConfig, sequence_BT: Array, positions_BT: Array, segment_ids_BT: Array,
                      mask_BN: Array, *, temperature: float, topk: int, head: bool = False,
                      group_size: int = 1, gather_ids_BNk: Array | None = None, pack=None) -> dict:
  """Teacher scores of sampled completions, all at `temperature` (pure; jit it via `make_teacher_scorer`).

  Returns [B, N(, ·)] arrays, zeroed / id 0 where `mask_BN` is 0 (losses mask them anyway):
    teacher_logp_BN        log p(y_t | s_t) of the sampled token y_t
    teacher_topk_ids_BNk   the teacher's top-k ids, descending by probability
    teacher_topk_logp_BNk  their log-probs (full-vocabulary normalised)
    teacher_topk_residual_logp_BN  log(1 − Σ_k p_k), exact from the logits (-inf when the top-k hold all)
                           (the three top-k fields only when `topk` > 0)
    gathered_logp_BNk      only with `gather_ids_BNk` [B, N, k]: log p at those ids (the student's recorded
                           candidates: μ's top-k, Monte-Carlo draws), full-vocabulary normalised; -inf at ids < 0
    teacher_head           only when `head`: a `VocabHead` (final hidden states [B, N, D] and the lm-head
                           [D, V] at `temperature`) from which full-distribution losses form the teacher's
                           logits chunk by chunk (`losses.dense`)

  No [B, N, V] array anywhere: the lm-head runs in chunks (`models.token_logprobs`), as a real
  vocabulary (V ~ 50k) needs. `group_size` G > 1 (GRPO groups: rows g·G .. g·G+G-1 share one prompt):
  the prompt runs once per group (`models.logprobs.query_hidden`, checked on device); the values agree
  up to rounding. `pack` (a `packing.Packing` of the rows, `optim.pack_width`): the forward runs on the packed
  rows instead (outputs gathered back to [B, N]; same values up to rounding).
  """
  n_new = mask_BN.shape[1]
  live_BN = mask_BN > 0
  P = sequence_BT.shape[1] - n_new
  kw = dict(positions_BT=positions_BT[:, :-1], segment_ids_BT=segment_ids_BT[:, :-1], temperature=temperature,
            topk=topk, query_start=P - 1, return_hidden=head, gather_ids_BTk=gather_ids_BNk)
  if pack is not None:
    out = packing.packed_logprobs(params, pack, sequence_BT.shape[1], n_new, cfg, temperature, return_hidden=head,
                                  topk=topk, gather_ids_BNk=gather_ids_BNk)
  elif group_size > 1:
    out = token_logprobs_shared(params, sequence_BT[:, :-1], sequence_BT[:, 1:], cfg, group_size=group_size, **kw)
  else:
    out = token_logprobs(params, sequence_BT[:, :-1], sequence_BT[:, 1:], cfg, **kw)
  scores = {"teacher_logp_BN": jnp.where(live_BN, out["logp_BT"], 0.0)}
  if topk:
    scores.update({
        "teacher_topk_ids_BNk": jnp.where(live_BN[..., None], out["topk_ids_BTk"].astype(jnp.int32), 0),
        "teacher_topk_logp_BNk": jnp.where(live_BN[..., None], out["topk_logp_BTk"], 0.0),
        "teacher_topk_residual_logp_BN": jnp.where(live_BN, out["topk_residual_logp_BT"], 0.0),
    })
  if gather_ids_BNk is not None:
    scores["gathered_logp_BNk"] = jnp.where(live_BN[..., None], out["gathered_logp_BTk"], 0.0)
  if head:
    h_BND = jnp.where(live_BN[..., None], out["hidden_BTD"], 0)
    scores["teacher_head"] = VocabHead(hidden_BND=h_BND, w_DV=lm_head_weights(params, cfg), temperature=temperature)
  return scores


def make_teacher_scorer(cfg: ModelConfig, temperature: float, topk: int, head: bool = False, group_size: int = 1):
  """Jitted `(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, gather_ids_BNk=None, pack=None) -> dict` of
  `score_completions` (`head`: also the teacher's `VocabHead` for full-distribution losses; `group_size`:
  prompts run once per group of that many rows sharing them; `gather_ids_BNk`: also the teacher at those
  ids, in the same forward; `topk` 0: no top-k cache, e.g. a reference teacher read only at given ids)."""
  if not 0 <= topk <= cfg.vocab_size:
    raise ValueError(f"config.distill.topk={topk}: must be in [1, vocab_size={cfg.vocab_size}]")

  @jax.jit
  def score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, gather_ids_BNk=None, pack=None):
    return score_completions(params, cfg, sequence_BT, positions_BT, segment_ids_BT, mask_BN,
                             temperature=temperature, topk=topk, head=head, group_size=group_size,
                             gather_ids_BNk=gather_ids_BNk, pack=pack)

  return score
