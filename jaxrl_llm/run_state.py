"""A run's state on disk: Orbax checkpoints (train state, held ParamStore snapshots, reference / EWMA copies,
the batch source's plain-data state, the resolved config), resuming from the latest valid one, and a fresh start.

Checkpoints hold the batch source's state as arrays + a JSON skeleton (async: buffered groups and request-id
cursor; replay: the buffer; staged: the stage's version): nothing is ever unpickled. A resume whose config
differs from the checkpoint's in a field that changes shapes or semantics (anything but
`config_lib.RESUMABLE`) stops with the list of fields unless `checkpoint.config_change` says "resume"
(deliberately) or "restart" (old run moved to `previous-<time>/`).
"""

from __future__ import annotations

import os
import time
import warnings

import jax
import jax.numpy as jnp

from jaxrl_llm import checkpoint as checkpoint_lib
from jaxrl_llm import config as config_lib
from jaxrl_llm import distributed, metrics as metrics_lib, multiprocess
from jaxrl_llm import workdir as workdir_lib
from jaxrl_llm.errors import RunError
from jaxrl_llm.models import init_params, lora
from jaxrl_llm.policy_init import initial_policy
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.episode_eval import evaluate_run
from jaxrl_llm.sft import SftSchedule, demo_records, sft_on_demos, sft_warm_start
from jaxrl_llm.wiring import Run, env_settings, fresh_state, lora_base, lora_base_id, lora_policy, reference_of

def full_state(state, store: ParamStore, extra: dict, slots: int, host_arrays: dict) -> tuple[dict, list[int]]:
  """The checkpointed pytree: train state + `slots` snapshot slots (padded with the newest) + copies +
  the flat host arrays of the async engine / replay state (`checkpoint.pack_host`; None when empty) + the
  distilled drafter's state when there is one (`distill.drafter`; no key otherwise)."""
  held = store.held_versions()[-slots:]
  snaps = [store.acquire(v) for v in held]
  try:
    pick = lambda i: snaps[min(i, len(snaps) - 1)]
    if lora.has_adapters(state.params):  # LoRA: adapters only; the base is the run's `lora_base_id`
      tree = {"train": state.replace(params=state.params["lora"].weights), "ref": None,  # ref: the base
              "snap": [pick(i).adapters.weights for i in range(slots)], "snap_learner": [None] * slots}
    else:
      tree = {"train": state, "snap": [pick(i).params for i in range(slots)], "ref": extra["ref"],
              "snap_learner": [pick(i).learner_params for i in range(slots)]}
    tree.update({"ewma": extra["ewma"], "host": host_arrays or None})
    if extra.get("drafter") is not None:  # the distilled drafter: parameters and optimiser state
      tree["drafter"] = extra["drafter"]
  finally:
    for s in snaps:
      store.release(s)
  return tree, held


def save(ckpt, step: int, state, store, extra, slots: int, meta: dict, host: dict, force: bool = False,
          metrics=None) -> None:
  """Saves checkpoint `step`; `host` (plain data: dicts, lists, numpy arrays, numbers, strings) is split
  into a JSON skeleton in meta and flat arrays in the tree, so that restoring never unpickles anything."""
  skeleton, arrays = checkpoint_lib.pack_host(host)
  tree, held = full_state(state, store, extra, slots, arrays)
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


def restore(ckpt, run: Run, store: ParamStore, slots: int, config_json: dict):
  """(step, state, extra, meta, host) from the latest valid checkpoint, or None. Rebuilds the ParamStore.

  Each candidate's stored config is compared with `config_json` before its arrays are read: a difference
  outside `config_lib.RESUMABLE` raises `ConfigChanged`, unless `checkpoint.config_change="resume"`.
  Steps that are intact but do not fit this run's state are never moved aside: RunError.
  """
  if not ckpt.all_steps():
    return None
  params = lora_policy(run.c, run.model_cfg, init_params(run.model_cfg, run.k_init), run.k_init)
  state, extra = fresh_state(run, params)
  if lora.has_adapters(params):  # LoRA: the checkpoint holds adapters (`full_state`), in the learner's layout
    weights = state.params["lora"].weights
    base = {"train": state.replace(params=weights), "snap": [weights] * slots, "snap_learner": [None] * slots,
            **extra, "ref": None}
  else:
    base = {"train": state, "snap": [store.sampler_copy(params)] * slots,
            "snap_learner": [state.params if store.keeps_learner_copy else None] * slots, **extra}  # learner layout
  if base.get("drafter", 0) is None:  # no distilled drafter: no key (`full_state`)
    del base["drafter"]
  policy = config_lib.read(run.c, "checkpoint.config_change")

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
  train = tree["train"]
  if lora.has_adapters(params):
    policy = _lora_rebase(run, meta, step, ckpt.directory, params["lora"].scale)
    tree["snap"] = [policy(w) for w in tree["snap"]]
    train = train.replace(params=policy(train.params))
    if extra["ref"] is not None:  # the reference is the frozen base (a copy: the learner's base buffers are donated)
      tree["ref"] = jax.tree.map(lambda x: jnp.array(x, copy=True), lora.split(train.params)[0])
  for i, v in enumerate(meta["snapshot_versions"]):
    learner_copy = tree["snap_learner"][i]
    store.restore(v, tree["snap"][i], learner_copy)
  return step, train, {"ref": tree["ref"], "ewma": tree["ewma"], "drafter": tree.get("drafter")}, meta, host


def _lora_rebase(run: Run, meta: dict, step: int, directory: str, scale: float):
  """`weights -> policy`: restored adapter weights attached to the run's frozen base, read again (init_from) or
  drawn again (seed), and warm-started again (sft.steps), after checking it is the one the checkpoint's adapters
  were trained on."""
  _, base, _ = warm_started(run)
  want = lora_base_id(run.c, base)
  if meta.get("lora_base") != want:
    raise RunError(f"checkpoint step {step} in {directory}: its LoRA adapters were trained on the base "
                   f"{meta.get('lora_base')}, but this run's base is {want} (model.init_from changed, or the SFT "
                   "warm start computed a different base on this machine?)")
  base = lora_base(run.c, base)
  if run.mesh is not None:  # the learner's layout of the base, as `fresh_state` lays out a fresh run's
    from jaxrl_llm import sharding
    base = sharding.reshard(base, reference_of(run.state_shardings.params))
  return lambda weights: lora.attach(base, lora.Adapters(weights, scale))


def resume_error(e: ConfigChanged, directory: str) -> RunError:
  return RunError(f"{directory}: the checkpoint to resume was written with a different config "
                  f"({'; '.join(e.fields)}). Nothing was changed on disk. Use another --workdir, restore the old "
                  "values, --config.checkpoint.config_change=restart (moves the old run to previous-<time>/ and "
                  "starts at step 0) or =resume (resume anyway, deliberately)")


def open_checkpointer(c, workdir: str):
  d = os.path.join(workdir, "checkpoints")
  try:
    return checkpoint_lib.Checkpointer(d, keep=c.checkpoint.keep,
                                       best_metric="eval_accuracy" if c.eval.every > 0 else None)
  except OSError as e:
    raise RunError(f"{d}: cannot open the checkpoint directory ({e.strerror or e})") from None



RUN_FILES = ("checkpoints", "metrics.jsonl", "config.json", "run_info.json", "tb", "reward_accuracy.png")

def resume_point(c, workdir: str, r: Run, store: ParamStore, slots: int, config_json: dict):
  """(checkpointer, restored or None): the latest valid checkpoint to resume, after the config check.

  A changed config raises RunError, or with `checkpoint.config_change="restart"` moves the old run aside.
  """
  ckpt = open_checkpointer(c, workdir)
  try:
    return ckpt, restore(ckpt, r, store, slots, config_json)
  except ConfigChanged as e:
    ckpt.close()
    if config_lib.read(c, "checkpoint.config_change") != "restart":
      raise resume_error(e, workdir) from None
    moved = workdir_lib.move_aside(workdir, list(RUN_FILES)) if multiprocess.is_writer() else None
    distributed.barrier("config_change_restart")  # every process reopens the checkpoints after the move
    print(f"config changed ({'; '.join(e.fields)}): previous run moved to {moved}; starting at step 0", flush=True)
    return open_checkpointer(c, workdir), None


def fresh_start(c, r: Run, store: ParamStore, workdir: str):
  """(0, state, extra, meta, host) of a run without a checkpoint: initial policy, SFT warm start, version 0
  published, the initial evaluation."""
  moved = workdir_lib.move_aside(workdir, ["metrics.jsonl", "run_info.json"]) if multiprocess.is_writer() else None
  if moved:  # rows of a run that left no usable checkpoint: kept, never deleted
    print(f"no checkpoint to resume: the earlier metrics.jsonl was moved to {moved}; starting at step 0", flush=True)
  t0 = time.perf_counter()
  model_cfg, params, sft_loss = warm_started(r)
  meta = {"sft_final_loss": sft_loss, "time_sft_s": time.perf_counter() - t0}
  if c.sft.save_to and multiprocess.is_writer():
    from jaxrl_llm.models import save_hf
    save_hf(c.sft.save_to, model_cfg, params)
    r.encoder.tokenizer.save(c.sft.save_to)  # the export loads back with its tokenizer (`model.init_from`)
  if config_lib.lora_on(c):
    meta["lora_base"] = lora_base_id(c, params)
  params = lora_policy(c, model_cfg, params, r.k_init)  # LoRA: the frozen base + fresh adapters
  state, extra = fresh_state(r, params)
  store.publish(state.params)
  initial = evaluate_run(r, lora.effective(state.params)) if c.eval.every > 0 else {}
  meta["eval_accuracy_initial"] = initial.get("eval_accuracy")
  meta.update({f"{k}_initial": v for k, v in initial.items() if k.startswith("eval_episode_")})  # with an env
  return 0, state, extra, meta, {}


def warm_started(r: Run) -> tuple:
  """(model config, params, SFT loss): the initial policy (random init or `model.init_from`) after the SFT warm
  start (`sft.steps`; on demonstration episodes when the run plays an environment). For LoRA this is the frozen
  base, computed again on resume (`_lora_rebase`; `sft_cache` serves it when the same inputs ran before)."""
  c = r.c
  model_cfg, params = initial_policy(c, r.model_cfg, r.k_init, r.encoder.tokenizer.vocab_size)
  if config_lib.env_on(c):  # multi-turn: SFT on scripted demonstration episodes (jaxrl_llm.envs.demos)
    es = env_settings(c)
    player, n = config_lib.read(c, "sft.demo_player"), config_lib.read(c, "sft.demos")
    records = demo_records(r.encoder, es, player, n, c.seed) if c.sft.steps > 0 else []
    params, sft_loss = sft_on_demos(SftSchedule.from_config(c), model_cfg, params, records, es.prompt_width,
                                    es.max_episode_tokens, r.encoder)
  else:
    params, sft_loss = sft_warm_start(SftSchedule.from_config(c), model_cfg, params, r.train_examples, r.P, r.encoder)
  return model_cfg, params, sft_loss


def source_state(name: str, meta: dict, host: dict):
  """The checkpointed state of source `name` (None when the checkpoint's source was another one)."""
  if "source" not in host:  # a checkpoint from before batch sources, or a fresh start
    return {"replay": host.get("replay"), "async": host.get("async_engine"),
            "staged": {"stage_version": meta["stage_version"]} if "stage_version" in meta else None}.get(name)
  saved = host["source"]
  return saved.get("state") if isinstance(saved, dict) and saved.get("name") == name else None
