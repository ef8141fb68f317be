"""Config validation: every error names the offending field (`config.rollout.mode=...`).

Configs are `ml_collections.ConfigDict`s (see configs/default.py). Unknown fields are rejected by
`ml_collections.config_flags` on the command line; `validate` checks values and cross-field rules.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import warnings
from typing import Callable, Iterable

import ml_collections

from jaxrl_llm import model_fields

ROLLOUT_MODES = ("sync", "fixed_lag", "staged", "async")
OLD_LOGP = ("recompute", "behavior", "step_start", "ewma", "a3po")
DTYPES = model_fields.FLOAT_DTYPES
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo")  # baselines from the other responses of the prompt
WEIGHT_SYNC = ("full", "sparse")
REPLAY_STALE_POLICIES = ("drop", "keep", "downweight")
CONFIG_CHANGE = ("error", "resume", "restart")
TASK_SOURCES = ("memory", "tfds")
SAMPLER_QUANTIZE = ("none", "int8")
KL_ESTIMATORS = ("k1", "k2", "k3")
SPEC_LAYOUTS = ("min", "rows")

# The value a run uses for a field its config lacks, by dotted name; `read(c, name)` is the one way code reads
# such a field. Fields of configs/default.py are here because a config written before the field existed (or not
# built on default.py) still runs: their values are default.py's (tests/test_docs_config.py pins that). The
# optional sections (`env`; `distill.ref_teacher`; `dist` may be absent too) have their defaults only here. The
# distill options (`distill.adwin`, `.mopd`, `.topk_cache`) keep theirs in `jaxrl_llm.distill.extras`.
# docs/config.md shows them all (`python -m jaxrl_llm.config_doc`).
ABSENT_DEFAULTS = {
    "task.held_out": 0.0, "task.chat_template": "auto", "task.system_prompt": "",
    "model.num_experts": 0, "model.routing_replay": True, "model.layer_unroll": 0, "model.decode_unroll": True,
    "model.memory_budget_gb": 0.0, "model.pr2_horizon": 1,
    "model.lora.rank": 0, "model.lora.dropout": 0.0, "model.lora.base_quantize": "none",
    "sampler.behavior_topk": 0, "sampler.mc_samples": 0,
    "sampler.kv_cache": "full", "sampler.kv_sinks": 4, "sampler.kv_window": 64,
    "sampler.spec_gamma": 0, "sampler.spec_draft_layers": 0, "sampler.spec_layout": "min",
    "sampler.spec_drafter": "layers", "sampler.spec_head_reg_weight": 10.0, "sampler.spec_head_vocab": 0,
    "sampler.spec_head_ttt": 1,
    "sampler.spec_distill_lr": 1e-4,
    "sampler.spec_distill_steps": 1,
    "sampler.spec_distill_reward_weight": 0.0,
    "rollout.dynamic_sampling": False, "rollout.sampler_devices": 0, "rollout.partial_chunk": 0, "rollout.slots": 0,
    "rollout.score_at_switch": False,
    "rollout.echo.on": False, "rollout.echo.prompt_width": 0, "rollout.echo.gain_tau": 0.1,
    "rollout.pats.on": False, "rollout.pats.prompt_width": 0, "rollout.pats.card_frac": 0.5,
    "rollout.pats.add_below": 1.0, "rollout.pats.retire_margin": 0.0,
    "rollout.slot_chunk": 8,
    "rollout.replay.capacity": 0,
    "optim.minibatches": 1, "optim.epochs": 1, "optim.pack_width": 0,
    "sft.demos": 64, "sft.demo_player": "consistent",
    "checkpoint.config_change": "error", "serve.harness": "", "serve.harness_kwargs": {},
    "advantage.turn_level": False,
    "serve.sandbox": False, "serve.sandbox_cpu_s": 60.0, "serve.sandbox_memory_mb": 1024,
    "dist.coordinator_address": None, "dist.num_processes": None, "dist.process_id": None,
    "dist.initialization_timeout": 300, "dist.heartbeat_timeout_seconds": 100,
    # Optional sections: absent (or env.name "") = single-turn; no distill section = no teacher.
    "env.name": "", "env.kwargs": {}, "env.newest_each_turn": True, "env.kv_cache": True, "env.evict": "none",
    "env.context_budget": 0, "env.keep_last_turns": 1,
    "distill.ref_teacher": "", "distill.teacher_demo_player": "",
}


def read(c: ml_collections.ConfigDict, field: str):
  """`c.<field>` (a dotted name), or `ABSENT_DEFAULTS[field]` when the config lacks it or one of its sections.
  A field without an entry there is required: KeyError when absent."""
  node = c
  for k in field.split("."):
    if not hasattr(node, "keys") or k not in node:
      return ABSENT_DEFAULTS[field]
    node = node[k]
  return node


def load_file(path) -> ml_collections.ConfigDict:
  """`get_config()` of a config file loaded by path, as `ml_collections.config_flags` does: config files
  are not a package, and this works from any working directory (configs build on each other with it)."""
  path = pathlib.Path(path)
  spec = importlib.util.spec_from_file_location(f"_jaxrl_config_{path.stem}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


class ConfigError(ValueError):
  """A bad config value; the message starts with the field's dotted name."""


def _need(cond: bool, field: str, value, why: str) -> None:
  if not cond:
    raise ConfigError(f"config.{field}={value!r}: {why}")


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first invalid field."""
  from jaxrl_llm import losses  # local: keep `import jaxrl_llm.config` light

  _need(isinstance(c.seed, int) and c.seed >= 0, "seed", c.seed, "must be a non-negative int")
  _need(isinstance(c.num_steps, int) and c.num_steps >= 0, "num_steps", c.num_steps, "must be a non-negative int")
  _validate_task(c)
  validate_dist(c)
  _validate_model(c)
  _validate_lora(c)
  if c.loss.name not in losses.names():
    raise ConfigError(f"config.loss.name={c.loss.name!r}: unknown loss; valid names: {', '.join(losses.names())}")
  spec = losses.get(c.loss.name)
  for ax in ("data", "fsdp", "tensor", "expert"):
    _need(isinstance(c.mesh[ax], int) and c.mesh[ax] >= 1, f"mesh.{ax}", c.mesh[ax], "must be an int >= 1")
  n_mesh = c.mesh.data * c.mesh.fsdp * c.mesh.tensor * c.mesh.expert
  n_sampler = read(c, "rollout.sampler_devices")
  _need(isinstance(n_sampler, int) and n_sampler >= 0, "rollout.sampler_devices", n_sampler,
        "must be an int >= 0 (0 = the sampler shares the learner's devices)")
  if n_mesh > 1 or n_sampler:
    import jax  # local: validating a one-device config must not initialise devices
    n_proc = jax.process_count()  # sampler devices are per process
    if n_mesh + n_sampler * n_proc != jax.device_count():
      if n_sampler:
        each = f" ({n_sampler} on each of {n_proc} processes)" if n_proc > 1 else ""
        raise ConfigError(f"config.rollout.sampler_devices={n_sampler}: with config.mesh={dict(c.mesh)} ({n_mesh} "
                          f"learner devices) the run needs {n_mesh + n_sampler * n_proc} devices{each} but "
                          f"{jax.device_count()} are visible")
      raise ConfigError(f"config.mesh={dict(c.mesh)}: the axis sizes multiply to {n_mesh} but {jax.device_count()} "
                        "devices are visible")

  _validate_multiprocess(c, n_mesh)

  why = losses.micro_batching_error(spec, c.optim.grad_accum)  # the learner applies the same rule
  _need(why is None, "optim.grad_accum", c.optim.grad_accum, why or "")
  B = c.rollout.prompts_per_step * c.rollout.group_size
  _need(B % c.optim.grad_accum == 0, "optim.grad_accum", c.optim.grad_accum,
        f"must divide the batch rollout.prompts_per_step * rollout.group_size = {B}")
  n_mb, n_ep = read(c, "optim.minibatches"), read(c, "optim.epochs")
  _need(isinstance(n_mb, int) and n_mb >= 1, "optim.minibatches", n_mb, "must be an int >= 1")
  _need(isinstance(n_ep, int) and n_ep >= 1, "optim.epochs", n_ep, "must be an int >= 1")
  _need(c.rollout.prompts_per_step % n_mb == 0, "optim.minibatches", n_mb,
        f"must divide rollout.prompts_per_step = {c.rollout.prompts_per_step} (GRPO groups are never split)")
  _need((B // n_mb) % c.optim.grad_accum == 0, "optim.grad_accum", c.optim.grad_accum,
        f"must divide the minibatch size {B // n_mb} (batch {B} / optim.minibatches {n_mb})")
  _need(c.sampler.dtype in DTYPES, "sampler.dtype", c.sampler.dtype, f"must be one of {DTYPES}")
  _need(c.sampler.quantize in SAMPLER_QUANTIZE, "sampler.quantize", c.sampler.quantize,
        f"must be one of {SAMPLER_QUANTIZE}")
  _need(c.sampler.max_new_tokens > 0, "sampler.max_new_tokens", c.sampler.max_new_tokens, "must be > 0")
  _need(c.sampler.temperature > 0, "sampler.temperature", c.sampler.temperature,
        "must be > 0 for training (greedy decoding is used only for evaluation)")
  _need(0 < c.sampler.top_p <= 1, "sampler.top_p", c.sampler.top_p, "must be in (0, 1]")
  _need(c.sampler.top_k >= 0, "sampler.top_k", c.sampler.top_k, "must be >= 0 (0 = off)")
  _validate_sampler_records(c)
  _validate_kv_cache(c, spec)
  _validate_speculative(c)
  modes = rollout_modes()
  _need(c.rollout.mode in modes, "rollout.mode", c.rollout.mode, f"must be one of {modes}")
  _need(isinstance(c.rollout.lag, int) and c.rollout.lag >= 0, "rollout.lag", c.rollout.lag,
        "must be a non-negative int")
  if c.rollout.mode == "staged":
    _need(c.rollout.lag >= 1, "rollout.lag", c.rollout.lag, "is the stage length in staged mode: must be >= 1")
  _need(c.rollout.prompts_per_step > 0, "rollout.prompts_per_step", c.rollout.prompts_per_step, "must be > 0")
  _need(c.rollout.group_size > 0, "rollout.group_size", c.rollout.group_size, "must be > 0")
  _need(c.rollout.old_logp in OLD_LOGP, "rollout.old_logp", c.rollout.old_logp, f"must be one of {OLD_LOGP}")
  _need(c.rollout.num_workers >= 1, "rollout.num_workers", c.rollout.num_workers, "must be >= 1")
  _need(c.rollout.partial_chunk >= 0, "rollout.partial_chunk", c.rollout.partial_chunk, "must be >= 0 (0 = off)")
  if c.rollout.partial_chunk and c.rollout.mode != "async":
    raise ConfigError(f"config.rollout.partial_chunk={c.rollout.partial_chunk}: partial rollouts need rollout.mode='async'")
  _need(0.0 <= c.rollout.ewma_beta < 1.0, "rollout.ewma_beta", c.rollout.ewma_beta, "must be in [0, 1)")
  _need(isinstance(c.rollout.prox_in_worker, bool), "rollout.prox_in_worker", c.rollout.prox_in_worker, "must be a bool")
  if c.rollout.prox_in_worker and (c.rollout.mode != "async" or c.rollout.old_logp != "recompute"):
    raise ConfigError(f"config.rollout.prox_in_worker={c.rollout.prox_in_worker}: workers score π_old only with "
                      "rollout.mode='async' and rollout.old_logp='recompute'")
  at_switch = read(c, "rollout.score_at_switch")
  _need(isinstance(at_switch, bool), "rollout.score_at_switch", at_switch, "must be a bool")
  _need(not at_switch or (c.rollout.prox_in_worker and c.rollout.partial_chunk), "rollout.score_at_switch", at_switch,
        "scores each version's tokens when a partial rollout switches version: it needs rollout.partial_chunk > 0 "
        "and rollout.prox_in_worker=True")
  _need(c.rollout.weight_sync in WEIGHT_SYNC, "rollout.weight_sync", c.rollout.weight_sync,
        f"must be one of {WEIGHT_SYNC}")
  _validate_slots(c, n_mesh, n_sampler)
  _validate_replay(c)
  _validate_serve(c)
  _validate_echo(c)
  _validate_pats(c)
  _need(c.checkpoint.every >= 0, "checkpoint.every", c.checkpoint.every, "must be >= 0 (0 = only at the end / on SIGTERM)")
  _need(c.checkpoint.keep >= 1, "checkpoint.keep", c.checkpoint.keep, "must be >= 1")
  _need(isinstance(c.checkpoint.final, bool), "checkpoint.final", c.checkpoint.final, "must be a bool")
  change = read(c, "checkpoint.config_change")
  _need(change in CONFIG_CHANGE, "checkpoint.config_change", change, f"must be one of {CONFIG_CHANGE}")
  try:
    losses.make_hparams(spec, losses.run_hparams(c))
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.{e}") from None
  _need(c.loss.agg_mode in losses.MODES, "loss.agg_mode", c.loss.agg_mode, f"must be one of {losses.MODES}")
  _need(c.loss.kl_estimator in KL_ESTIMATORS, "loss.kl_estimator", c.loss.kl_estimator,
        f"must be one of {KL_ESTIMATORS}")
  _need(c.advantage.name in ADVANTAGES, "advantage.name", c.advantage.name, f"must be one of {ADVANTAGES}")
  # A group of one has no peers: GRPO, Dr.GRPO and RLOO then give each response its raw reward (no baseline,
  # verl's singleton convention), not a group-relative advantage. REINFORCE++ whitens over the batch and
  # works with G=1; distillation losses (needs beyond RL_NEEDS: teacher scores) ignore the advantage.
  if c.advantage.name in GROUP_ADVANTAGES and not set(spec.needs) - RL_NEEDS:
    _need(c.rollout.group_size >= 2, "rollout.group_size", c.rollout.group_size,
          f"advantage.name={c.advantage.name!r} compares the responses of one prompt, so a group needs >= 2 of "
          "them; use group_size >= 2, or advantage.name='reinforce_pp' (a batch-wide baseline)")
  turn_level = read(c, "advantage.turn_level")
  _need(isinstance(turn_level, bool), "advantage.turn_level", turn_level, "must be a bool")
  if turn_level:
    _need(c.advantage.name in GROUP_ADVANTAGES, "advantage.turn_level", turn_level,
          f"needs a group baseline (advantage.name in {GROUP_ADVANTAGES}), not {c.advantage.name!r}")
    _need(env_on(c), "advantage.turn_level", turn_level,
          "credits the turns of multi-turn episodes: set env.name (a single completion is one turn)")
  if read(c, "rollout.dynamic_sampling"):  # DAPO drops groups of equal rewards: every group of one
    _need(c.rollout.group_size >= 2, "rollout.group_size", c.rollout.group_size,
          "rollout.dynamic_sampling drops groups whose rewards are all equal, which every group of one is")
  lr = c.optim.lr
  _need(isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0, "optim.lr", lr,
        "must be a finite number > 0")
  if lr > 1:  # AdamW moves every weight by about lr per update: > 1 wipes out the policy (uniform, grad_norm 0)
    warnings.warn(f"config.optim.lr={lr!r} is above 1: each AdamW update moves every weight by about that much, "
                  "which destroys the policy (typical values: 1e-6 to 1e-3)", RuntimeWarning)  # one place: shown once
  _need(c.optim.grad_clip >= 0, "optim.grad_clip", c.optim.grad_clip, "must be >= 0 (0 = off)")
  _need(c.eval.every >= 0, "eval.every", c.eval.every, "must be >= 0 (0 = never)")
  _need(isinstance(c.eval.num_prompts, int) and c.eval.num_prompts >= 0, "eval.num_prompts", c.eval.num_prompts,
        "must be a non-negative int")
  if c.eval.every > 0:
    _need(c.eval.num_prompts > 0, "eval.num_prompts", c.eval.num_prompts,
          f"must be > 0 when eval.every={c.eval.every} (set eval.every=0 to turn evaluation off)")
  _need(isinstance(c.sft.steps, int) and c.sft.steps >= 0, "sft.steps", c.sft.steps, "must be a non-negative int")
  _need(isinstance(c.sft.batch_size, int) and c.sft.batch_size >= 0, "sft.batch_size", c.sft.batch_size,
        "must be a non-negative int")
  if c.sft.steps > 0:
    _need(c.sft.batch_size > 0, "sft.batch_size", c.sft.batch_size,
          f"must be > 0 when sft.steps={c.sft.steps} (set sft.steps=0 to skip the warm start)")
    _need(c.sft.lr > 0, "sft.lr", c.sft.lr, "must be > 0")
    if env_on(c):  # the warm start plays demonstration episodes (jaxrl_llm.sft.demo_records)
      n = read(c, "sft.demos")
      _need(isinstance(n, int) and not isinstance(n, bool) and n >= 1, "sft.demos", n,
            f"must be an int >= 1 when sft.steps={c.sft.steps} and env.name={c.env.name!r} (demonstration episodes)")
      from jaxrl_llm import envs  # local: text only, as in _validate_env
      from jaxrl_llm.envs import demos
      player = read(c, "sft.demo_player")
      _need(c.env.name not in envs.names() or player in demos.player_names(c.env.name), "sft.demo_player", player,
            f"environment {c.env.name!r} has the scripted players {demos.player_names(c.env.name)} "
            "(set sft.steps=0 to skip the warm start)")
  _need(isinstance(c.optim.max_skips, int) and c.optim.max_skips >= 1, "optim.max_skips", c.optim.max_skips,
        "must be an int >= 1")
  _validate_packing(c)
  _validate_reward(c)
  _validate_env(c)
  missing = losses.missing_needs(spec, available_needs(c))
  if missing:
    hints = "".join(f"; {n}: {NEED_HINTS[n]}" for n in missing if n in NEED_HINTS)
    raise ConfigError(f"config.loss.name={c.loss.name!r}: needs {missing}, which this run does not provide "
                      f"(available: {sorted(available_needs(c))}){hints}")


def _validate_packing(c: ml_collections.ConfigDict) -> None:
  """`optim.pack_width`: 0 (off) or a row width; the combinations `jaxrl_llm.packing` does not support are refused."""
  w = read(c, "optim.pack_width")
  _need(isinstance(w, int) and not isinstance(w, bool) and (w == 0 or w >= 2), "optim.pack_width", w,
        "must be 0 (off) or an int >= 2 (tokens per packed row)")
  if not w:
    return
  row = max(env_length(c) - (c.env.turn_tokens if env_on(c) else 0), c.serve.max_context if serve_on(c) else 0)
  _need(w >= row, "optim.pack_width", w, f"must hold one learner row of {row} tokens (an episode's prompt bucket + "
        "token budget, or the harness's serve.max_context)")  # single completions: checked against P at setup
  why = packing_refusal(c)
  _need(why is None, "optim.pack_width", w, why or "")


def packing_refusal(c: ml_collections.ConfigDict) -> str | None:
  """Why this run's learner cannot take packed rows (`jaxrl_llm.packing`), or None."""
  from jaxrl_llm import losses  # local, as in `validate`
  needs = losses.get(c.loss.name).needs
  if read(c, "model.num_experts") and c.model.get("capacity_factor", 0):
    return "an MoE with a capacity limit (model.capacity_factor > 0) drops tokens by how many share a call"
  if "perturb" in needs:
    return f"loss {c.loss.name!r} draws its perturbation per row (ALP) and is not packed"
  if "shadow" in needs:
    return f"loss {c.loss.name!r} runs a shadow forward under the sampler's KV window, which is not packed"
  return None


def validate_dist(c: ml_collections.ConfigDict) -> None:
  """`dist`: the `jax.distributed.initialize` settings (checked before it is called; absent: all None)."""
  d = c.get("dist")
  if d is None:
    return
  addr, n, i = (read(c, f"dist.{f}") for f in ("coordinator_address", "num_processes", "process_id"))
  if addr is not None:
    host, _, port = str(addr).rpartition(":")
    _need(isinstance(addr, str) and host != "" and port.isdigit() and 0 < int(port) < 65536,
          "dist.coordinator_address", addr, "must be 'host:port' (the address of process 0)")
  _need(n is None or (isinstance(n, int) and n >= 1), "dist.num_processes", n, "must be an int >= 1")
  _need(i is None or (isinstance(i, int) and i >= 0), "dist.process_id", i, "must be an int >= 0")
  if n is not None and i is not None:
    _need(i < n, "dist.process_id", i, f"must be < config.dist.num_processes={n}")
  for f in ("initialization_timeout", "heartbeat_timeout_seconds"):
    v = read(c, f"dist.{f}")
    _need(isinstance(v, int) and v >= 1, f"dist.{f}", v, "must be an int >= 1 (seconds)")


def _validate_model(c: ml_collections.ConfigDict) -> None:
  """`model.*`: the architecture rules `ModelConfig` itself applies (`jaxrl_llm.model_fields`, one home for
  both), on the fields the config sets; `layer_unroll` 0 means every layer."""
  m = c.model
  fields = {k: m[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "rope_theta",
                              "dtype", "remat", "num_experts", "experts_per_token", "capacity_factor") if k in m}
  unroll = read(c, "model.layer_unroll")
  fields["layer_unroll"] = unroll if unroll != 0 else 1  # 0 = every layer: resolved when the model is built
  bad = model_fields.check(fields)
  if bad is not None:
    name, value, why = bad
    if name == "layer_unroll":  # the config's own range: 0 is allowed
      why = "must be an int >= 0 (0 = unroll every layer)"
    raise ConfigError(f"config.model.{name}={m[name]!r}: {why}")
  _need(isinstance(read(c, "model.decode_unroll"), bool), "model.decode_unroll", read(c, "model.decode_unroll"),
        "must be a bool")
  rr = read(c, "model.routing_replay")
  _need(isinstance(rr, bool) or rr in ROUTING_REPLAY, "model.routing_replay", rr,
        f"must be a bool (True = 'R3') or one of {ROUTING_REPLAY}")
  h = read(c, "model.pr2_horizon")
  _need(isinstance(h, int) and not isinstance(h, bool) and h >= 1, "model.pr2_horizon", h,
        "must be an int >= 1 (updates the PR2 router prediction looks ahead)")
  budget = read(c, "model.memory_budget_gb")
  _need(isinstance(budget, (int, float)) and not isinstance(budget, bool) and math.isfinite(budget) and budget >= 0,
        "model.memory_budget_gb", budget, "must be a number >= 0 (decimal GB per device; 0 = from the machine)")


ROUTING_REPLAY = ("R3", "R2", "PR2")  # `model.routing_replay` besides a bool


def routing_replay_mode(c: ml_collections.ConfigDict) -> str:
  """Which expert ids an MoE learner replays (`model.routing_replay`): "R3" (True) the sampler's, recorded at
  rollout; "R2" those of the learner's own forward at the step start (π_old in the training engine), replayed by
  the step's later updates (`optim.minibatches` / `optim.epochs` > 1); "PR2" the sampler's, which it routed with
  each router predicted `model.pr2_horizon` updates ahead (`jaxrl_llm.route_predictor`); "off" (False) none.
  Dense models: "off"."""
  rr = read(c, "model.routing_replay")
  if not read(c, "model.num_experts") or rr is False:
    return "off"
  return "R3" if rr is True else rr


def replays_sampler_routes(c: ml_collections.ConfigDict) -> bool:
  """Whether the sampler records its expert ids for the learner to replay: R3, and PR2 (predicted routes)."""
  return routing_replay_mode(c) in ("R3", "PR2")


def uses_reference(c: ml_collections.ConfigDict) -> bool:
  """Whether the run keeps a frozen copy of the initial policy and scores `ref_logp_BN` in every step: for a
  KL-to-reference term (`loss.kl_coef` > 0) or a loss that reads it (S²D-OPD's anchor to the initial student)."""
  from jaxrl_llm import losses  # local: keep `import jaxrl_llm.config` light
  return c.loss.kl_coef > 0 or "ref_logp" in losses.get(c.loss.name).needs


def scores_prox(c: ml_collections.ConfigDict) -> bool:
  """Whether the run scores π_old at all: only for a loss that reads it (the `prox_logp` need). A-3PO (π_prox
  interpolated from μ and π_θ), plain PG, DPPO, μ-GRPO, the OPD losses, ... read no π_old, so no source, worker or
  learner pays its forward pass (A-3PO's saving), whatever `rollout.old_logp` says."""
  from jaxrl_llm import losses  # local: keep `import jaxrl_llm.config` light
  return "prox_logp" in losses.get(c.loss.name).needs


def old_logp_strategy(c: ml_collections.ConfigDict) -> str:
  """The π_old strategy the run carries out: `rollout.old_logp`, or "none" when the loss reads no π_old
  (`scores_prox`; then nothing scores it and no EWMA copy is kept)."""
  return c.rollout.old_logp if scores_prox(c) else "none"


def lora_on(c: ml_collections.ConfigDict) -> bool:
  """Whether the run trains LoRA adapters (`model.lora.rank` > 0; configs without the section: no)."""
  return read(c, "model.lora.rank") != 0


def _validate_lora(c: ml_collections.ConfigDict) -> None:
  """`model.lora.*` (`model_fields.check_lora`; the rank against the layer shapes of a from-scratch model here,
  of a checkpoint's at setup)."""
  lo = c.model.get("lora")
  if lo is None:
    return
  m = c.model
  arch = None if m.init_from else {k: m[k] for k in ("d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                                                     "num_experts")}
  bad = model_fields.check_lora(arch, lo.rank, lo.alpha, lo.targets, read(c, "model.lora.dropout"),
                                read(c, "model.lora.base_quantize"))
  if bad is not None:
    name, value, why = bad
    raise ConfigError(f"config.model.lora.{name}={value!r}: {why}")


def _validate_sampler_records(c: ml_collections.ConfigDict) -> None:
  """`sampler.behavior_topk` / `sampler.mc_samples` (absent: 0): what the sampler records about μ beyond the
  token (`sampling.behavior`), in every decode loop but speculative decoding's."""
  for f in ("behavior_topk", "mc_samples"):
    v = read(c, f"sampler.{f}")
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"sampler.{f}", v, "must be an int >= 0 (0 = off)")


KV_CACHES = ("full", "int8", "window")  # = sampling.config.KV_CACHES (config imports no sampler; a test pins it)


def _validate_kv_cache(c: ml_collections.ConfigDict, spec) -> None:
  """`sampler.kv_cache` / `kv_sinks` / `kv_window` (absent: "full", 4, 64): a compressed sampler KV cache runs in
  every decode loop, and SMD's shadow forward needs the window's mask (single completions, and episodes without
  eviction)."""
  kind, sinks, window = read(c, "sampler.kv_cache"), read(c, "sampler.kv_sinks"), read(c, "sampler.kv_window")
  _need(kind in KV_CACHES, "sampler.kv_cache", kind, f"must be one of {KV_CACHES}")
  _need(isinstance(sinks, int) and not isinstance(sinks, bool) and sinks >= 0, "sampler.kv_sinks", sinks,
        "must be an int >= 0")
  _need(isinstance(window, int) and not isinstance(window, bool) and window >= 1, "sampler.kv_window", window,
        "must be an int >= 1 (a token always sees itself)")
  if "shadow" in spec.needs:
    _need(kind == "window", "sampler.kv_cache", kind,
          f"loss {spec.name!r} trains the shadow policy, the forward under the sampler's KV visibility mask: only "
          "'window' has one (an int8 cache changes values, not visibility; 'full' has no mismatch)")
  if "shadow" in spec.needs:  # episodes record each row's window by position; eviction renumbers the positions
    _need(not evicting(c), "loss.name", spec.name, "episodes with eviction (env.evict) renumber positions after each "
          "eviction: the window each token saw is not the recorded window by position")


def _validate_speculative(c: ml_collections.ConfigDict) -> None:
  """`sampler.spec_gamma` / `spec_draft_layers` (absent: 0, 0): speculative decoding runs in `generate`, in partial
  rollouts' chunks and in the slot engine ("min" layout), with every KV cache format, μ's records and MoE
  routes. spec_gamma -1 is the sampler's "auto" (adaptive γ, ReSpec; ml_collections keeps the field an int)."""
  gamma, k = read(c, "sampler.spec_gamma"), read(c, "sampler.spec_draft_layers")
  _need(isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= -1, "sampler.spec_gamma", gamma,
        "must be an int >= 0 (0 = off) or -1 (adaptive γ)")
  _need(isinstance(k, int) and not isinstance(k, bool) and k >= 0, "sampler.spec_draft_layers", k,
        "must be an int >= 0")
  layout = read(c, "sampler.spec_layout")
  _need(layout in SPEC_LAYOUTS, "sampler.spec_layout", layout, f"must be one of {SPEC_LAYOUTS}")
  _validate_drafter(c, gamma)
  if not gamma:
    return
  _need(k >= 1, "sampler.spec_draft_layers", k, f"must be >= 1 with sampler.spec_gamma={gamma!r} (the drafter's depth)")
  _need(not read(c, "rollout.slots") or layout == "min", "sampler.spec_layout", layout,
        f"continuous batching (rollout.slots={read(c, 'rollout.slots')}) speculates with 'min': its slots share "
        "the cache's write index")


SPEC_DRAFTERS = ("layers", "distilled", "head")
DRAFTER_MODES = ("sync", "fixed_lag", "staged", "async", "harness")  # the sources whose sampler reads the drafter


def _validate_drafter(c: ml_collections.ConfigDict, gamma: int) -> None:
  """`sampler.spec_drafter` and its distillation fields (absent: "layers", 1e-4, 1, 0.0). "distilled" keeps the
  drafter's state in the loop and hands it to the sampler (`Generation.drafter`): the sync, fixed_lag (with or
  without replay), staged, async and harness sources, LoRA policies included, on one device, a mesh or several processes
  (the rest is refused by name rather than run untested)."""
  kind = read(c, "sampler.spec_drafter")
  _need(kind in SPEC_DRAFTERS, "sampler.spec_drafter", kind, f"must be one of {SPEC_DRAFTERS}")
  lr, steps = read(c, "sampler.spec_distill_lr"), read(c, "sampler.spec_distill_steps")
  alpha = read(c, "sampler.spec_distill_reward_weight")
  _need(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0, "sampler.spec_distill_lr", lr,
        "must be a number > 0")
  _need(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1, "sampler.spec_distill_steps", steps,
        "must be an int >= 1")
  _need(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha >= 0,
        "sampler.spec_distill_reward_weight", alpha, "must be a number >= 0 (0 = unweighted)")
  reg = read(c, "sampler.spec_head_reg_weight")
  _need(isinstance(reg, (int, float)) and not isinstance(reg, bool) and reg >= 0, "sampler.spec_head_reg_weight",
        reg, "must be a number >= 0")
  vocab = read(c, "sampler.spec_head_vocab")
  _need(isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 0, "sampler.spec_head_vocab", vocab,
        "must be an int >= 0 (0 = the whole vocabulary)")
  _need(vocab == 0 or kind == "head", "sampler.spec_head_vocab", vocab,
        f"a draft vocabulary is the head drafter's (sampler.spec_drafter='head'), not the {kind} drafter's")
  ttt = read(c, "sampler.spec_head_ttt")
  _need(isinstance(ttt, int) and not isinstance(ttt, bool) and ttt >= 1, "sampler.spec_head_ttt", ttt,
        "must be an int >= 1 (1 = train the first draft only)")
  _need(ttt == 1 or kind == "head", "sampler.spec_head_ttt", ttt,
        f"the training-time test unrolls the head drafter (sampler.spec_drafter='head'), not the {kind} drafter")
  if kind == "layers":
    return
  where = f"the {kind} drafter"
  _need(gamma != 0, "sampler.spec_drafter", kind, "needs speculative decoding (sampler.spec_gamma != 0)")
  _need(c.rollout.mode in DRAFTER_MODES, "sampler.spec_drafter", kind,
        f"{where} is wired for rollout.mode in {DRAFTER_MODES} only, not {c.rollout.mode!r}")


MULTIPROCESS_MODES = ("sync", "fixed_lag", "staged", "async", "harness")
PER_PROCESS_MODES = ("async", "harness")  # over several processes each process runs workers of its own


def _validate_multiprocess(c: ml_collections.ConfigDict, n_mesh: int) -> None:
  """What a run over several processes (`jax.process_count() > 1`) supports: one mesh over every device
  (but the sampler's own, under async), the sync, fixed_lag, staged, async and harness modes, replay, on-policy
  distillation, sparse sync, the distilled drafter and continuous batching (one slot engine per process; the rest
  is refused by name rather than run untested)."""
  import jax  # local: and no device is touched unless `jax.distributed` is initialised (the CLI does it first)
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return
  n_proc = jax.process_count()
  n_sampler = read(c, "rollout.sampler_devices")
  if n_mesh == 1:
    raise ConfigError(f"config.mesh={dict(c.mesh)}: {n_proc} processes run one model over all "
                      f"{jax.device_count() - n_sampler * n_proc} devices: set the mesh axes to multiply to that")
  mode = c.rollout.mode
  _need(mode in MULTIPROCESS_MODES, "rollout.mode", mode, f"multi-process runs ({n_proc} processes) support "
        f"{MULTIPROCESS_MODES}")
  slots = read(c, "rollout.slots")
  if slots:  # each process runs its own slot engine over an equal share of every sampler call's rows
    _need(not env_on(c), "rollout.slots", slots,
          f"multi-turn episodes over {n_proc} processes re-prefill their turns: set rollout.slots=0")
    fresh = read(c, "rollout.replay.capacity") and read(c, "rollout.replay.fresh_per_step")
    for field, n in (("rollout.prompts_per_step", c.rollout.prompts_per_step),
                     ("rollout.replay.fresh_per_step", fresh)):
      _need(not n or n % n_proc == 0, field, n, f"with rollout.slots over {n_proc} processes each process runs "
            f"its slot engine over an equal share of the prompts: it must be divisible by {n_proc}")
  _need(not n_sampler or mode in PER_PROCESS_MODES, "rollout.sampler_devices", n_sampler,
        f"devices of the sampler's own are for rollout.mode in {PER_PROCESS_MODES} in multi-process runs "
        f"({n_proc} processes)")
  if mode in PER_PROCESS_MODES:  # each process's workers (its endpoint and harness under "harness") and replica
    _need(c.rollout.prompts_per_step % n_proc == 0, "rollout.prompts_per_step", c.rollout.prompts_per_step,
          f"{mode} over {n_proc} processes: each process generates an equal share, so it must be divisible by "
          f"{n_proc}")
    _need(not c.rollout.prox_in_worker, "rollout.prox_in_worker", c.rollout.prox_in_worker,
          f"{mode} over {n_proc} processes: π_old is scored by the learner (the workers' replica is not its layout)")


def task_kwargs(c: ml_collections.ConfigDict) -> dict:
  """The `task.kwargs` the chosen task takes (unset ones and other tasks' arguments left out)."""
  from jaxrl_llm import tasks  # local: keep `import jaxrl_llm.config` light
  return tasks.config_task_kwargs(c.task.name, dict(c.task.kwargs))[0]


def _validate_task(c: ml_collections.ConfigDict) -> None:
  """`task`: the name, its kwargs (None = the task's default; another task's argument is set aside with
  a note; a name no task takes is an error), the data file (read here, so a missing file or wrong
  columns fail at start-up) and the held-out split."""
  from jaxrl_llm import tasks  # local: keep `import jaxrl_llm.config` light
  _need(c.task.name in tasks.task_names(), "task.name", c.task.name, f"must be one of {tasks.task_names()}")
  _need(c.task.source in TASK_SOURCES, "task.source", c.task.source, f"must be one of {TASK_SOURCES}")
  kwargs, foreign = tasks.config_task_kwargs(c.task.name, dict(c.task.kwargs))
  for k, v in foreign.items():
    print(f"note: config.task.kwargs.{k}={v!r} is not an argument of task {c.task.name!r}; ignored", flush=True)
  try:
    task = tasks.get_task(c.task.name, **kwargs)
  except (ValueError, TypeError, OSError) as e:
    kwarg = getattr(e, "kwarg", None)
    field = f"task.kwargs.{kwarg}" if kwarg else "task.kwargs"
    value = kwargs.get(kwarg) if kwarg else {k: v for k, v in kwargs.items() if v is not None}
    why = str(e).removeprefix(f"{value}: ")  # data errors start with the path: say it once
    raise ConfigError(f"config.{field}={value!r}: {why} (config.task.name={c.task.name!r})") from None
  held_out = read(c, "task.held_out")
  try:
    tasks.num_held_out(task, held_out)
  except ValueError as e:
    raise ConfigError(f"config.task.held_out={held_out!r}: {e}") from None


def _validate_replay(c: ml_collections.ConfigDict) -> None:
  """`rollout.replay`: every field has a range; replay needs a synchronous mode and room for a batch."""
  r = c.rollout.get("replay")
  if r is None:
    return
  _need(isinstance(r.capacity, int) and r.capacity >= 0, "rollout.replay.capacity", r.capacity,
        "must be a non-negative int (0 = off)")
  _need(isinstance(r.fresh_per_step, int) and r.fresh_per_step >= 0, "rollout.replay.fresh_per_step",
        r.fresh_per_step, "must be a non-negative int (0 = rollout.prompts_per_step)")
  _need(isinstance(r.reuse_limit, int) and r.reuse_limit >= 0, "rollout.replay.reuse_limit", r.reuse_limit,
        "must be a non-negative int (0 = unlimited)")
  _need(0.0 < r.recency <= 1.0, "rollout.replay.recency", r.recency, "must be in (0, 1] (1 = uniform)")
  _need(r.stale_policy in REPLAY_STALE_POLICIES, "rollout.replay.stale_policy", r.stale_policy,
        f"must be one of {REPLAY_STALE_POLICIES}")
  _need(isinstance(r.max_lag, int) and r.max_lag >= -1, "rollout.replay.max_lag", r.max_lag,
        "must be an int >= -1 (-1 = no bound)")
  _need(0.0 <= r.decay <= 1.0, "rollout.replay.decay", r.decay, "must be in [0, 1]")
  if not r.capacity:
    return
  if c.rollout.mode not in ("sync", "fixed_lag"):
    raise ConfigError(f"config.rollout.replay.capacity={r.capacity}: replay runs in rollout.mode 'sync' or "
                      f"'fixed_lag', not {c.rollout.mode!r}")
  fresh = r.fresh_per_step or c.rollout.prompts_per_step
  _need(r.capacity >= max(c.rollout.prompts_per_step, fresh), "rollout.replay.capacity", r.capacity,
        f"must hold a batch and a sampler call: >= max(rollout.prompts_per_step={c.rollout.prompts_per_step}, "
        f"rollout.replay.fresh_per_step={fresh})")
  if r.stale_policy == "drop" and r.max_lag >= 0 and c.rollout.mode == "fixed_lag":
    _need(r.max_lag >= c.rollout.lag, "rollout.replay.max_lag", r.max_lag,
          f"must be >= rollout.lag={c.rollout.lag} under stale_policy='drop' (fresh groups already have that lag)")


def _validate_reward(c: ml_collections.ConfigDict) -> None:
  """`reward`: a positive time limit and bound, a known executor, at least one worker (absent: defaults)."""
  r = c.get("reward")
  if r is None:
    return
  from jaxrl_llm.tasks.reward import EXECUTORS  # local: numpy only, but keep `import jaxrl_llm.config` light
  _need(isinstance(r.timeout_s, (int, float)) and r.timeout_s > 0, "reward.timeout_s", r.timeout_s, "must be > 0 seconds")
  _need(isinstance(r.max_abs, (int, float)) and r.max_abs > 0, "reward.max_abs", r.max_abs,
        "must be > 0 (rewards with a larger magnitude count as errors)")
  _need(r.executor in EXECUTORS, "reward.executor", r.executor, f"must be one of {EXECUTORS}")
  _need(isinstance(r.workers, int) and r.workers >= 1, "reward.workers", r.workers, "must be an int >= 1")


# Fields a resumed run may change: they affect neither array shapes nor what a learner step computes.
RESUMABLE = ("num_steps", "log.", "dist.", "checkpoint.every", "checkpoint.final", "checkpoint.keep",
             "checkpoint.config_change", "eval.every", "reward.timeout_s", "reward.executor", "reward.workers",
             "rollout.num_workers", "sft.save_to",
             "task.data_dir", "sft.demos", "sft.demo_player")  # the warm start's demos: it never runs on resume


ENV_FIELDS = ("name", "kwargs", "max_turns", "turn_tokens", "max_episode_tokens", "timeout_s", "prompt_width",
              "newest_each_turn", "kv_cache", "evict", "context_budget", "keep_last_turns")
EVICT_POLICIES = ("none", "drop_oldest", "summary")  # `env.evict` (`rollout.evict`)


def _validate_slots(c: ml_collections.ConfigDict, n_mesh: int, n_sampler: int) -> None:
  """`rollout.slots` / `rollout.slot_chunk`: continuous batching (`sampling.continuous`) of single completions and
  episode turns in the sources that generate whole steps with one snapshot, and of single completions in async
  (one slot worker thread, which switches to newer versions at chunk boundaries itself), with any KV cache format;
  on one device or in one process over the sampler's mesh or devices (`_validate_multiprocess`)."""
  slots, chunk = read(c, "rollout.slots"), read(c, "rollout.slot_chunk")
  _need(isinstance(slots, int) and not isinstance(slots, bool) and slots >= 0, "rollout.slots", slots,
        "must be an int >= 0 (0 = off)")
  _need(isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1, "rollout.slot_chunk", chunk,
        "must be an int >= 1")
  if not slots:
    return
  if c.rollout.mode == "async":
    _need(c.rollout.num_workers == 1, "rollout.num_workers", c.rollout.num_workers,
          f"async with rollout.slots={slots} runs one slot worker thread holding many groups: set num_workers=1")
    _need(not c.rollout.partial_chunk, "rollout.partial_chunk", c.rollout.partial_chunk,
          f"async with rollout.slots={slots} already switches to the newest version every rollout.slot_chunk decode "
          "steps (keeping the cache): set partial_chunk=0")
  _need(not (env_on(c) and c.rollout.mode == "async"), "rollout.slots", slots,
        "async continuous batching generates single completions; episodes use slots in the sync, fixed_lag and "
        "staged sources")


def env_on(c: ml_collections.ConfigDict) -> bool:
  """Whether the run plays multi-turn episodes: an `env` section with a non-empty `env.name`."""
  return bool(read(c, "env.name"))


def evicting(c: ml_collections.ConfigDict) -> bool:
  """Whether the run's episodes compress their context (`env.evict` other than "none")."""
  return env_on(c) and read(c, "env.evict") != "none"


def env_length(c: ml_collections.ConfigDict) -> int:
  """Longest context an episode needs (0 without `env`): its prompt bucket, its token budget, and the
  sampler's cache slots of a turn (`rollout.episodes`: every turn re-prefills P + budget columns)."""
  if not env_on(c):
    return 0
  e = c.env
  return e.prompt_width + e.max_episode_tokens + e.turn_tokens


def _validate_env(c: ml_collections.ConfigDict) -> None:
  """`env`: absent or `env.name=""` = single-turn; otherwise a registered environment, the arguments it takes,
  positive limits, no within-turn partial rollouts."""
  e = c.get("env")
  if e is None:
    return
  _need(isinstance(read(c, "env.name"), str), "env.name", e.get("name"), "must be a str ('' = single-turn)")
  if not read(c, "env.name"):
    return
  for k in e.keys():
    _need(k in ENV_FIELDS, f"env.{k}", e[k], f"unknown field; the env section takes {ENV_FIELDS}")
  from jaxrl_llm import envs  # local: text only (numpy), but keep `import jaxrl_llm.config` light
  try:  # a registered name, an installed entry point or `package.module:factory` (imported here)
    accepted = envs.kwarg_names(e.name)
  except ValueError as err:
    raise ConfigError(f"config.env.name={e.name!r}: {err}") from None
  for k, v in dict(read(c, "env.kwargs")).items():
    _need(k in accepted, f"env.kwargs.{k}", v,
          f"environment {e.name!r} takes no such argument (its arguments: {accepted})")
  for f in ("max_turns", "turn_tokens", "max_episode_tokens", "prompt_width"):
    v = e.get(f)
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"env.{f}", v, "must be an int >= 1")
  _need(e.max_episode_tokens >= e.turn_tokens, "env.max_episode_tokens", e.max_episode_tokens,
        f"must be >= env.turn_tokens = {e.turn_tokens} (the budget holds at least one turn)")
  t = e.get("timeout_s")
  _need(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0, "env.timeout_s", t,
        "must be a finite number of seconds > 0")
  for f in ("newest_each_turn", "kv_cache"):
    _need(isinstance(read(c, f"env.{f}"), bool), f"env.{f}", e.get(f), "must be a bool")
  _need(read(c, "env.evict") in EVICT_POLICIES, "env.evict", e.get("evict"), f"must be one of {EVICT_POLICIES}")
  for f, lo in (("context_budget", 1 if evicting(c) else 0), ("keep_last_turns", 1)):
    v = read(c, f"env.{f}")
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"env.{f}", v,
          f"must be an int >= {lo}" + (f" with env.evict={e.evict!r}" if f == "context_budget" and lo else ""))
  _need(not read(c, "rollout.partial_chunk"), "rollout.partial_chunk", c.rollout.get("partial_chunk"),
        f"must be 0 with env.name={e.name!r} (async episodes switch versions between turns: env.newest_each_turn)")
  if c.get("distill") and c.distill.get("teacher") == "sft":  # the SFT teacher of an agent learns from demonstrations
    from jaxrl_llm.envs import demos
    player = read(c, "distill.teacher_demo_player") or read(c, "sft.demo_player")
    _need(e.name not in envs.names() or player in demos.player_names(e.name), "distill.teacher_demo_player", player,
          f"environment {e.name!r} has the scripted players {demos.player_names(e.name)} (the 'sft' teacher of an "
          "agent is trained on their demonstration episodes; '' = sft.demo_player)")


SERVE_FIELDS = ("harness", "harness_kwargs", "concurrency", "max_batch", "batch_window_s", "timeout_s", "max_context",
                "prompt_width", "max_tokens", "model_name", "sandbox", "sandbox_cpu_s", "sandbox_memory_mb")


def serve_on(c: ml_collections.ConfigDict) -> bool:
  """Whether the run serves an agent harness (`rollout.mode="harness"`, `jaxrl_llm.serve`)."""
  return c.rollout.mode == "harness"


def _validate_serve(c: ml_collections.ConfigDict) -> None:
  """`serve`: checked only when `rollout.mode="harness"`: a "module:function" harness, positive limits, a completion
  budget that leaves room for a prompt, a learner row (prompt_width + the rest) of `max_context`, and no environment."""
  if not serve_on(c):
    return
  s = c.get("serve")
  _need(s is not None, "serve", s, 'rollout.mode="harness" needs a serve section (configs/default.py)')
  for k in s.keys():
    _need(k in SERVE_FIELDS, f"serve.{k}", s[k], f"unknown field; the serve section takes {SERVE_FIELDS}")
  h = read(c, "serve.harness")
  _need(isinstance(h, str) and h.count(":") == 1 and all(h.split(":")), "serve.harness", h,
        'must be "module:function" (called as fn(base_url, episode_id, seed, **serve.harness_kwargs))')
  kw = read(c, "serve.harness_kwargs")
  _need(isinstance(kw, (dict, ml_collections.ConfigDict)), "serve.harness_kwargs", kw,
        "must be a dict of the harness's keyword arguments")
  try:
    json.dumps(kw.to_dict() if isinstance(kw, ml_collections.ConfigDict) else kw)
  except (TypeError, ValueError) as e:
    _need(False, "serve.harness_kwargs", kw, f"must be JSON-able (a sandboxed harness gets them as JSON): {e}")
  for f in ("concurrency", "max_batch", "max_context", "prompt_width", "max_tokens"):
    v = s.get(f)
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"serve.{f}", v, "must be an int >= 1")
  for f in ("timeout_s", "batch_window_s"):
    v = s.get(f)
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 and
          (v > 0 or f == "batch_window_s"), f"serve.{f}", v, "must be a finite number of seconds" +
          (" >= 0" if f == "batch_window_s" else " > 0"))
  _need(s.max_tokens < s.max_context, "serve.max_tokens", s.max_tokens,
        f"must be < serve.max_context = {s.max_context} (leave room for a prompt)")
  _need(s.prompt_width < s.max_context, "serve.prompt_width", s.prompt_width,
        f"must be < serve.max_context = {s.max_context} (the rest of the row holds the completions)")
  _need(isinstance(s.get("model_name"), str) and s.model_name, "serve.model_name", s.get("model_name"),
        "must be a non-empty str")
  _need(isinstance(read(c, "serve.sandbox"), bool), "serve.sandbox", read(c, "serve.sandbox"), "must be a bool")
  for f in ("sandbox_cpu_s", "sandbox_memory_mb"):
    v = read(c, f"serve.{f}")
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0, f"serve.{f}", v,
          "must be a number > 0")
  _need(not env_on(c), "env.name", c.get("env", {}).get("name"), 'must be "" with rollout.mode="harness" (the harness '
        "is the environment)")


# the run modes ECHO's cascade and Pats' scaffold run in (in harness mode the harness writes every call)
SCAFFOLD_MODES = ("sync", "fixed_lag", "staged", "async")


def _scaffold_width(c: ml_collections.ConfigDict, field: str, width: int, room: int) -> int:
  """`field` (a scaffold's prompt width), or when 0: the task's P, two completions (N each) and `room` tokens for
  markers and rewards, rounded up to a multiple of 16."""
  w = read(c, field)
  return w if w else -(-(width + 2 * c.sampler.max_new_tokens + room) // 16) * 16


def echo_on(c: ml_collections.ConfigDict) -> bool:
  """Whether the run uses ECHO's cascaded rollout with a co-evolving critic (`rollout.echo.on`)."""
  return read(c, "rollout.echo.on") is True


def echo_width(c: ml_collections.ConfigDict, width: int) -> int:
  """The prompt width of ECHO's diagnosis and refinement rows: `rollout.echo.prompt_width`, or 0 = the task's P,
  the attempt and the diagnosis (N each) and 24 tokens for the markers and the attempt's reward, rounded up to a
  multiple of 16."""
  return _scaffold_width(c, "rollout.echo.prompt_width", width, 24)


def echo_length(c: ml_collections.ConfigDict, width: int) -> int:
  """Longest row of ECHO's cascaded rollout (0 when off): its prompt width + `sampler.max_new_tokens`."""
  return echo_width(c, width) + c.sampler.max_new_tokens if echo_on(c) else 0


def _validate_echo(c: ml_collections.ConfigDict) -> None:
  """`rollout.echo`: types; when on, an even `prompts_per_step` (a critic group and a policy group per task) and a
  mode of `SCAFFOLD_MODES` with single completions (docs/compat.md lists the refusals)."""
  on, w, tau = read(c, "rollout.echo.on"), read(c, "rollout.echo.prompt_width"), read(c, "rollout.echo.gain_tau")
  _need(isinstance(on, bool), "rollout.echo.on", on, "must be a bool")
  _need(isinstance(w, int) and not isinstance(w, bool) and w >= 0, "rollout.echo.prompt_width", w,
        "must be an int >= 0 (0 = the task's width + 2 * sampler.max_new_tokens + 24)")
  _need(isinstance(tau, (int, float)) and not isinstance(tau, bool) and math.isfinite(tau) and tau > 0,
        "rollout.echo.gain_tau", tau, "must be a finite number > 0")
  if not on:
    return
  _need(c.rollout.prompts_per_step % 2 == 0, "rollout.prompts_per_step", c.rollout.prompts_per_step,
        "must be even with rollout.echo.on (each task gives a critic group and a policy group)")
  _need(c.rollout.mode in SCAFFOLD_MODES, "rollout.mode", c.rollout.mode,
        f"must be one of {SCAFFOLD_MODES} with rollout.echo.on (in harness mode the harness decides every call)")
  if c.rollout.mode == "async":  # a request is one task: its three calls, then a record of 2G rows
    _need(not read(c, "rollout.partial_chunk"), "rollout.partial_chunk", read(c, "rollout.partial_chunk"),
          "must be 0 with rollout.echo.on (a version switch inside ECHO's cascade of three sampler calls is not built)")
    _need(not read(c, "rollout.slots"), "rollout.slots", read(c, "rollout.slots"),
          "must be 0 with rollout.echo.on in async mode (the slot worker decodes single groups; ECHO's async "
          "requests run their three calls as static batches)")
    import jax  # local: no device is touched unless `jax.distributed` is initialised
    n_proc = jax.process_count() if jax.distributed.is_initialized() else 1
    _need(c.rollout.prompts_per_step % (2 * n_proc) == 0, "rollout.prompts_per_step", c.rollout.prompts_per_step,
          f"must be a multiple of 2 x {n_proc} process(es) with rollout.echo.on in async mode (each process's "
          "share is whole tasks of two groups)")
  _need(not env_on(c), "env.name", read(c, "env.name"),
        'must be "" with rollout.echo.on (a critique turn inside a multi-turn episode is not built)')
  if read(c, "rollout.replay.capacity"):
    fresh = c.rollout.replay.fresh_per_step or c.rollout.prompts_per_step
    _need(fresh % 2 == 0, "rollout.replay.fresh_per_step", fresh, "must be even with rollout.echo.on")


def pats_on(c: ml_collections.ConfigDict) -> bool:
  """Whether the run scaffolds its rollouts with Pats' evidence cards (`rollout.pats.on`)."""
  return read(c, "rollout.pats.on") is True


def pats_width(c: ml_collections.ConfigDict, width: int) -> int:
  """The prompt width of scaffolded rows: `rollout.pats.prompt_width`, or 0 = the task's P, a card's best and worst
  completions (N each) and 16 tokens for their rewards, rounded up to a multiple of 16."""
  return _scaffold_width(c, "rollout.pats.prompt_width", width, 16)


def pats_length(c: ml_collections.ConfigDict, width: int) -> int:
  """Longest row of a Pats run (0 when off): its scaffolded prompt width + `sampler.max_new_tokens`."""
  return pats_width(c, width) + c.sampler.max_new_tokens if pats_on(c) else 0


def _validate_pats(c: ml_collections.ConfigDict) -> None:
  """`rollout.pats`: types and ranges; when on, groups of >= 2 (carded and bare rows) and a mode of
  `SCAFFOLD_MODES` with single completions (docs/compat.md lists the refusals)."""
  on, w = read(c, "rollout.pats.on"), read(c, "rollout.pats.prompt_width")
  _need(isinstance(on, bool), "rollout.pats.on", on, "must be a bool")
  _need(isinstance(w, int) and not isinstance(w, bool) and w >= 0, "rollout.pats.prompt_width", w,
        "must be an int >= 0 (0 = the task's width + 2 * sampler.max_new_tokens + 16)")
  frac = read(c, "rollout.pats.card_frac")
  _need(isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0 < frac < 1, "rollout.pats.card_frac",
        frac, "must be in (0, 1): a group holds carded and bare rows")
  for f in ("add_below", "retire_margin"):
    v = read(c, f"rollout.pats.{f}")
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), f"rollout.pats.{f}", v,
          "must be a finite number")
  if not on:
    return
  _need(c.rollout.group_size >= 2, "rollout.group_size", c.rollout.group_size,
        "must be >= 2 with rollout.pats.on (a group compares carded and bare rows)")
  _need(c.rollout.mode in SCAFFOLD_MODES, "rollout.mode", c.rollout.mode,
        f"must be one of {SCAFFOLD_MODES} with rollout.pats.on (in harness mode the harness writes every prompt)")
  if c.rollout.mode == "async":
    import jax  # local: no device is touched unless `jax.distributed` is initialised
    _need(not (jax.distributed.is_initialized() and jax.process_count() > 1), "rollout.pats.on", on,
          "async over several processes is not built with Pats (each process's workers would learn their own cards)")
  _need(not env_on(c), "env.name", read(c, "env.name"),
        'must be "" with rollout.pats.on (cards in an episode\'s first message are not built)')
  _need(not echo_on(c), "rollout.echo.on", read(c, "rollout.echo.on"),
        "must be False with rollout.pats.on (cards in ECHO's attempt prompts are not built)")


def serve_length(c: ml_collections.ConfigDict) -> int:
  """Longest context the sampler sees in harness mode (0 otherwise): a prompt padded to `serve.max_context` plus
  `serve.max_tokens` sampled slots."""
  return c.serve.max_context + c.serve.max_tokens if serve_on(c) else 0


def _flatten(d, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def resume_diff(stored: dict, new: dict) -> list[str]:
  """`field: old -> new` for every field (dotted name) that differs between a checkpoint's stored config
  and the new one (both as plain JSON, `json.loads(c.to_json_best_effort())`), except `RESUMABLE` ones."""
  if not isinstance(stored, dict):
    return [f"(stored config is not a JSON object: {type(stored).__name__})"]
  a, b = _flatten(stored), _flatten(new)
  out = []
  for k in sorted(set(a) | set(b)):
    if any(k == f or (f.endswith(".") and k.startswith(f)) for f in RESUMABLE):
      continue
    if a.get(k, "(absent)") != b.get(k, "(absent)"):
      out.append(f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}")
  return out


# Loss needs that optional run components add (on-policy distillation: `jaxrl_llm.distill.opd`), by
# component name. Each component registers itself when imported, so this module imports none of them;
# `jaxrl_llm.loop` imports them all, so a run (and `python -m jaxrl_llm`) validates with every one.
_NEEDS_PROVIDERS: dict[str, Callable[[ml_collections.ConfigDict], Iterable[str]]] = {}


def register_needs(component: str, provided: Callable[[ml_collections.ConfigDict], Iterable[str]]) -> None:
  """Registers `provided(c)`: the loss needs `component` supplies to a run of config `c` (none when it is off)."""
  _NEEDS_PROVIDERS[component] = provided


# Rollout modes beyond the built-in ones: a batch source (`jaxrl_llm.rollout.sources`) registers its mode
# name when imported, as the loss needs above.
_EXTRA_MODES: list[str] = []


def register_rollout_mode(name: str) -> None:
  """Accepts `rollout.mode=name` (called by `rollout.sources.register`)."""
  if name not in ROLLOUT_MODES and name not in _EXTRA_MODES:
    _EXTRA_MODES.append(name)


def rollout_modes() -> tuple[str, ...]:
  return ROLLOUT_MODES + tuple(_EXTRA_MODES)


# Loss needs the RL loop itself provides (a loss needing anything else, e.g. teacher scores, is distillation).
RL_NEEDS = frozenset({"prox_logp", "behavior_logp", "ref_logp", "entropy", "versions", "lag", "tokens", "state",
                      "perturb"})


def sampler_needs(c: ml_collections.ConfigDict) -> tuple[str, ...]:
  """Loss needs the sampler's records provide: `behavior_topk` (μ's top-k ids and log-probs; the learner
  gathers π_θ at them) when `sampler.behavior_topk` > 0. Its Monte-Carlo candidates (`sampler.mc_samples`)
  serve AsyncOPD's `mc` need, which also takes a teacher (`jaxrl_llm.distill.opd.provided_needs`)."""
  return ("behavior_topk",) if read(c, "sampler.behavior_topk") else ()


register_needs("sampler", sampler_needs)
register_needs("old_logp", lambda c: ("ewma_prox",) if c.rollout.old_logp == "ewma" else ())  # PPO-EWMA's π_prox
# How a run provides a need the RL loop does not always have (named in the missing-needs error).
NEED_HINTS = {"ewma_prox": "set config.rollout.old_logp='ewma' (π_prox from an EWMA copy of the weights)",
              "turn": "multi-turn episodes: an env section (configs/agent_tiny.py)"}
register_needs("env", lambda c: ("turn",) if env_on(c) else ())  # episodes number their turns (`turn_BN`)
# The sinks + window cache records what each token saw: the learner runs the shadow forward (`losses.smd`).
register_needs("kv_cache", lambda c: ("shadow",) if read(c, "sampler.kv_cache") == "window" else ())
# Episodes with eviction: the eviction mask and SDCC's teacher (the policy on the uncompressed context); the student's
# logits are the learner's own forward (`rollout.evict`).
register_needs("evict", lambda c: ("eviction", "teacher_logits", "student_logits") if evicting(c) else ())


def available_needs(c: ml_collections.ConfigDict) -> set[str]:
  """Loss needs an RL run can satisfy; the learner computes only those the chosen loss declares.

  Distillation needs (teacher scores, student logits/top-k, Monte-Carlo samples, eviction masks) are
  provided by the components registered with `register_needs`, not by the RL loop itself.
  """
  need = set(RL_NEEDS)
  for provided in _NEEDS_PROVIDERS.values():
    need |= set(provided(c))
  return need
