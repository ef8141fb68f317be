"""Default demo: GRPO-style PPO-clip on 2-digit addition with a tiny transformer, on a laptop CPU.

Run:  python -m jaxrl_llm --config=configs/default.py --workdir=runs/default
Every other config is a small delta over this one (see configs/tiny.py).
"""

import ml_collections

from jaxrl_llm import tasks


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0  # seed of every random draw (initial weights, SFT order, sampling, held-out split)
  c.num_steps = 400  # learner steps (one optimiser update each)

  c.task = ml_collections.ConfigDict()
  c.task.name = "arithmetic"  # a registered task (jaxrl_llm.tasks.task_names())
  # Every task's arguments as typed placeholders; None = the task's default (arithmetic: 2-digit addition).
  # Set those of the chosen task, e.g. --config.task.name=gsm8k --config.task.kwargs.path=train.jsonl
  c.task.kwargs = tasks.kwargs_config()  # the chosen task's arguments; None = the task's default
  c.task.source = "memory"  # "memory" (generated on the fly) or "tfds" (ArrayRecord built locally, read by grain)
  c.task.data_dir = ""  # TFDS data dir; "" = ~/.cache/jaxrl_llm/tfds
  c.task.held_out = 0.0  # test split: a count (>= 1), a fraction (0, 1) of a data file, or 0 = auto (10% of a file, max 500; 500 generated)
  # prompt_width 0 with a checkpoint's tokenizer: the longest encoded prompt rounded up to a multiple of 16.
  c.task.prompt_width = 0  # prompts are left-padded to this many tokens (0 = the task's longest prompt + BOS)
  c.task.chat_template = "auto"  # "auto" (the tokenizer's chat template if it has one) | "chat" (required) | "none" (raw)
  c.task.system_prompt = ""  # system message of chat prompts ("" = none)

  c.model = ml_collections.ConfigDict()
  c.model.d_model = 128  # hidden width (these size fields are ignored with model.init_from)
  c.model.n_layers = 2  # transformer blocks
  c.model.n_heads = 4  # query heads
  c.model.n_kv_heads = 2  # key/value heads (grouped-query attention; must divide n_heads)
  c.model.head_dim = 32  # width of one attention head (even: RoPE rotates pairs)
  c.model.d_ff = 384  # hidden width of the SwiGLU MLP
  c.model.rope_theta = 10000.0  # RoPE base frequency
  c.model.tie_embeddings = False  # the LM head reuses the input embedding
  c.model.qk_norm = False  # RMS-normalise queries and keys per head before attention
  c.model.dtype = "float32"  # learner compute dtype
  c.model.num_experts = 0  # > 0: MoE MLP in every layer (top-k routing)
  c.model.experts_per_token = 2  # MoE top-k: experts each token is routed to
  c.model.capacity_factor = 0.0  # MoE expert capacity; 0 = dropless
  c.model.router_aux_coef = 0.01  # MoE load-balancing loss weight
  # MoE only: True / "R3" the learner replays the sampler's expert ids; "R2" those of its own forward at the step
  # start, in every update of the step (optim.minibatches / epochs > 1); "PR2" the sampler routes with each router
  # predicted pr2_horizon updates ahead and the learner replays those ids; False: each forward routes afresh. Any
  # type, as remat below, so --config.model.routing_replay=R2 is taken.
  c.model.routing_replay = ml_collections.FieldReference(True, field_type=object)  # MoE expert ids replayed
  c.model.pr2_horizon = 1  # PR2: updates ahead the sampler's routers are predicted (jaxrl_llm/route_predictor.py)
  # Recompute in the backward pass: False/"none", True/"full" (each layer), "dots" (matmul outputs kept), "auto"
  # (the platform's fastest mode whose step's estimated memory fits memory_budget_gb; jaxrl_llm/memory.py). Any type:
  # ml_collections would otherwise pin the field to bool and refuse --config.model.remat=auto.
  c.model.remat = ml_collections.FieldReference(False, field_type=object)  # what the backward pass recomputes
  c.model.memory_budget_gb = 0.0  # remat="auto"'s budget per device; 0 = the accelerator's limit / 0.8 of free host RAM
  c.model.layer_unroll = 0  # layers per scan iteration; 0 = unroll all (fast on CPU), 1 = rolled (short compiles)
  c.model.decode_unroll = True  # decode loops read each layer in place, whatever layer_unroll (faster decode steps)
  c.model.init_from = ""  # path to a Hugging Face checkpoint folder; "" = random init + SFT warm start
  # LoRA (jaxrl_llm.models.lora): train low-rank adapters only, the base frozen (and not checkpointed: the run
  # re-reads it from model.init_from, checked by checksum, or re-draws it from the seed, and repeats the SFT warm start
  # when sft.steps > 0: the adapters train over the warm-started base, its checksum in every checkpoint).
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0  # r; 0 = off (full fine-tuning)
  c.model.lora.alpha = 16.0  # adapter scale alpha / r
  c.model.lora.targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # PEFT module names
  c.model.lora.dropout = 0.0  # only 0 (adapters are merged into the weights of every forward)
  c.model.lora.base_quantize = "none"  # "int8": QLoRA, the frozen base through the int8 weight-only round trip

  c.sampler = ml_collections.ConfigDict()
  c.sampler.max_new_tokens = 6  # completion tokens per rollout at most (N)
  c.sampler.temperature = 1.0  # the learner scores tokens at the same temperature
  c.sampler.top_k = 0  # sample among the k most likely tokens only (0 = off)
  c.sampler.top_p = 1.0  # nucleus sampling: the smallest set of tokens holding this mass (1 = off)
  c.sampler.dtype = "float32"  # "bfloat16" produces a real train/inference mismatch
  c.sampler.quantize = "none"  # "int8": weight-only int8 sampler weights (another real mismatch)
  # Records of μ beyond the sampled token (jaxrl_llm.sampling.behavior), for the losses that read them:
  c.sampler.behavior_topk = 0  # k > 0: μ's top-k ids + log-probs per position (dppo_topk; s2d_opd's candidates)
  c.sampler.mc_samples = 0  # J > 0: the token + J-1 i.i.d. draws from μ per position (opd_reverse_kl_mc)
  # KV-compressed rollouts (models/cache.py): the learner still scores the full context; `smd` corrects "window".
  c.sampler.kv_cache = "full"  # "full" | "int8" (int8 keys/values, per-token-per-head scales) | "window"
  c.sampler.kv_sinks = 4  # "window": first positions every token keeps (attention sinks; SMD reference: 4)
  c.sampler.kv_window = 64  # "window": last positions each token sees, itself included
  # Speculative decoding (sampling/speculative.py): the policy's first k layers draft γ tokens; exact rejection.
  c.sampler.spec_gamma = 0  # γ drafted tokens per policy call; 0 = off; -1 = adaptive (ReSpec; an int field)
  c.sampler.spec_draft_layers = 0  # k >= 1: the drafter's depth ("layers": a view of the policy's first k, always fresh)
  c.sampler.spec_layout = "min"  # "min": rows emit the batch's common minimum per call | "rows": each keeps its own
  # The drafter (distill/drafter.py): "layers" = a view of the policy's first k layers | "distilled" = its own copy of
  # them (+ embedding, norm, head) | "head" = an EAGLE-style head on the policy's last hidden states
  # (sampling/head_drafter.py); the last two distilled after every learner step on that step's rollouts (ReSpec).
  c.sampler.spec_drafter = "layers"  # "layers": the policy's first k layers | "distilled": a copy | "head": EAGLE
  c.sampler.spec_head_reg_weight = 10.0  # "head": weight of the feature regression beside the KL (EAGLE's 1 : 0.1)
  c.sampler.spec_head_vocab = 0  # "head": K > 0 drafts over the K most sampled tokens (EAGLE-3); 0 = all of them
  c.sampler.spec_head_ttt = 1  # "head": U > 1 trains drafts 1..U on the head's own features (EAGLE-3's test; 7 there)
  c.sampler.spec_distill_lr = 1e-4  # "distilled" / "head": Adam learning rate of the drafter's steps
  c.sampler.spec_distill_steps = 1  # "distilled" / "head": drafter steps per learner step (on that step's batch)
  c.sampler.spec_distill_reward_weight = 0.0  # "distilled" / "head": α of row weights max(0, 1 + α·z(r)); 0 = off

  c.rollout = ml_collections.ConfigDict()
  c.rollout.mode = "sync"  # sync | fixed_lag | staged | async | harness
  c.rollout.lag = 0  # k for fixed_lag, stage length for staged, staleness bound η for async
  c.rollout.prompts_per_step = 16  # prompts per learner step (the batch is prompts_per_step * group_size)
  c.rollout.group_size = 8  # responses sampled per prompt (G)
  c.rollout.dynamic_sampling = False  # DAPO: drop groups whose rewards are all equal from the loss
  c.rollout.old_logp = "recompute"  # recompute | behavior | step_start | ewma | a3po
  c.rollout.ewma_beta = 0.9  # EWMA decay of the proximal parameter copy (old_logp = ewma)
  c.rollout.num_workers = 1  # rollout worker threads (async)
  c.rollout.sampler_devices = 0  # devices of the sampler's own, per process (its last ones; the mesh gets the rest); 0 = shared
  c.rollout.partial_chunk = 0  # async partial rollouts: decode steps between version checks (0 = off)
  c.rollout.slots = 0  # continuous batching (sync sources): decode slots refilled as requests finish (0 = off)
  c.rollout.slot_chunk = 8  # continuous batching: decode steps between slot refills and version checks
  c.rollout.prox_in_worker = False  # async + recompute: workers score π_old at generation (else the learner does)
  c.rollout.score_at_switch = False  # prox_in_worker + partial rollouts: score each version's tokens at its switch
  c.rollout.weight_sync = "full"  # publish: "full" dense copy | "sparse" SparseRL-Sync delta (bit-identical copy)
  # ECHO (jaxrl_llm/rollout/cascade.py): per task an attempt, G critic diagnoses of it and G refinements, trained as
  # two GRPO groups (the critic is the policy's own weights in the critic role); prompts_per_step counts groups.
  c.rollout.echo = ml_collections.ConfigDict()
  c.rollout.echo.on = False  # ECHO's cascaded rollout with a co-evolving critic (sync, fixed_lag, staged, async)
  c.rollout.echo.prompt_width = 0  # prompt tokens of diagnosis / refinement rows; 0 = task width + 2 * N + 24
  c.rollout.echo.gain_tau = 0.1  # saturation-aware gain (r - r0) / (1 - r0 + tau) of an improvement [GUESS]
  # Pats (jaxrl_llm/rollout/scaffold.py): evidence cards made from rollout groups, shown in front of part of a
  # recurring prompt's later rollouts, retired once bare rows do as well; evaluation never shows a card.
  c.rollout.pats = ml_collections.ConfigDict()
  c.rollout.pats.on = False  # Pats' evidence-card scaffold (sync, fixed_lag, staged, async)
  c.rollout.pats.prompt_width = 0  # prompt tokens of scaffolded rows; 0 = task width + 2 * N + 16
  c.rollout.pats.card_frac = 0.5  # share of a carded prompt's group that sees the card (the rest: bare) [GUESS]
  c.rollout.pats.add_below = 1.0  # a group with mean reward below this (and differing rewards) becomes a card [GUESS]
  c.rollout.pats.retire_margin = 0.0  # a card is retired when bare rows score >= carded rows - this [GUESS]
  c.rollout.replay = ml_collections.ConfigDict()  # experience replay of groups (sync / fixed_lag modes)
  c.rollout.replay.capacity = 0  # groups held in the FIFO; 0 = off (every rollout consumed once)
  c.rollout.replay.fresh_per_step = 0  # prompts per sampler call, one call per learner step (0 = prompts_per_step)
  c.rollout.replay.reuse_limit = 0  # times a group may be sampled before it leaves the buffer (0 = unlimited)
  c.rollout.replay.recency = 1.0  # sampling weight ∝ recency ** lag (1 = uniform; smaller favours fresh groups)
  c.rollout.replay.stale_policy = "keep"  # groups with lag > max_lag: drop | keep | downweight
  c.rollout.replay.max_lag = -1  # over-stale threshold (-1 = no bound)
  c.rollout.replay.decay = 0.5  # downweight: advantages × decay ** (lag − max_lag)

  # rollout.mode="harness" (jaxrl_llm.serve): an OpenAI-compatible endpoint on 127.0.0.1 serves the policy to an
  # agent harness; every call is recorded per episode and finished episodes become the training batch.
  c.serve = ml_collections.ConfigDict()
  c.serve.harness = ""  # "module:function" called as fn(base_url, episode_id, seed, **harness_kwargs); "" = off
  c.serve.harness_kwargs = ml_collections.ConfigDict()  # keyword arguments of every harness call (JSON-able)
  c.serve.concurrency = 8  # harness threads running episodes at once
  c.serve.max_batch = 8  # requests sampled together in one sampler call at most
  c.serve.batch_window_s = 0.01  # the sampler thread waits this long for more requests before a batch
  c.serve.timeout_s = 60.0  # an episode not rewarded within this costs that episode only
  c.serve.max_context = 1024  # prompt + completion tokens of one call at most (the learner row's width)
  c.serve.prompt_width = 768  # P of the learner row: the first call's prompt region (the rest is N)
  c.serve.max_tokens = 16  # completion tokens of one call at most (the sampler's max_new_tokens in this mode)
  c.serve.model_name = "jaxrl-policy"  # the model id /v1/models lists; any other name is a 404
  c.serve.sandbox = False  # each episode's harness in a process of its own: limits below, wall = timeout_s (envs.sandbox)
  c.serve.sandbox_cpu_s = 60.0  # sandbox: CPU seconds of one episode's harness at most
  c.serve.sandbox_memory_mb = 1024  # sandbox: address space (MB) a harness may add to its imports'

  c.loss = ml_collections.ConfigDict()
  c.loss.name = "ppo_clip"  # a registered loss (docs/losses.md)
  c.loss.hparams = ml_collections.ConfigDict()  # overrides of the loss's Hparams dataclass
  c.loss.agg_mode = "seq-mean-token-mean"  # GRPO aggregation
  c.loss.drop_rejected = False  # tokens a loss rejects leave the denominator too (else they count as zeros)
  c.loss.norm_len = 0.0  # constant normaliser for seq-mean-token-sum-norm (0 = max_new_tokens)
  c.loss.kl_coef = 0.0  # weight of a KL term to the initial policy (> 0 keeps a frozen reference copy)
  c.loss.kl_estimator = "k3"  # estimator of that KL (Schulman's k1, k2, k3)
  c.loss.entropy_coef = 0.0  # weight of an entropy bonus

  c.advantage = ml_collections.ConfigDict()
  c.advantage.name = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp
  c.advantage.std_normalize = True  # divide the group-relative advantages by the group's reward std
  c.advantage.turn_level = False  # episodes: credit each turn by its return-to-go (collect.turn_advantages)

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-4  # AdamW learning rate (after the warmup)
  c.optim.weight_decay = 0.0  # AdamW's decoupled weight decay
  c.optim.b1 = 0.9  # AdamW's beta1
  c.optim.b2 = 0.98  # AdamW's beta2
  c.optim.grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
  c.optim.warmup_steps = 5  # optimiser updates of linear learning-rate warmup from 0 (0 = none)
  c.optim.grad_accum = 1  # micro-batches per optimiser update (exact token/sequence means via reduce_parts)
  # Update schedule: each learner step splits its rollout batch into `minibatches` (whole GRPO groups, in
  # order) and makes one optimiser update per minibatch, `epochs` passes over the batch; π_old stays the
  # step's. The policy is published once per learner step: versions and lag count learner steps.
  c.optim.minibatches = 1  # optimiser updates per learner step, one per minibatch of whole groups
  c.optim.epochs = 1  # passes over the step's batch (π_old stays the step's)
  c.optim.max_skips = 10  # consecutive non-finite updates before the run stops
  # Packed learner (`jaxrl_llm.packing`): rows of this many tokens, each holding several sequences' real tokens, so
  # no learner FLOP goes to padding; must hold the longest prompt + completion. 0 = off (padded [B, P+N] rows).
  c.optim.pack_width = 0  # tokens per packed learner row; 0 = off (padded rows)

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 250  # a short warm start: the policy begins with non-zero (but low) accuracy
  c.sft.batch_size = 64  # examples per SFT step
  c.sft.lr = 2e-3  # SFT learning rate
  c.sft.save_to = ""  # if set, the post-SFT policy is exported there (HF safetensors) for reuse via model.init_from
  # With an environment (env.name set) the warm start trains on scripted demonstration episodes instead
  # (jaxrl_llm.envs.demos): `demos` episodes of the player `demo_player` ("consistent" | "optimal" for guess_number).
  c.sft.demos = 64  # demonstration episodes of the warm start when env.name is set
  c.sft.demo_player = "consistent"  # the scripted player of those episodes (jaxrl_llm.envs.demos)

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 40  # learner steps between greedy held-out evaluations (and at the end); 0 = never
  c.eval.num_prompts = 256  # held-out prompts per evaluation

  c.mesh = ml_collections.ConfigDict()  # axis sizes; their product is the device count (all 1 = one device)
  c.mesh.data = 1  # data-parallel axis (replicated weights)
  c.mesh.fsdp = 1  # fully sharded data-parallel axis (weights and optimiser state sharded)
  c.mesh.tensor = 1  # tensor-parallel axis (heads and MLP columns split)
  c.mesh.expert = 1  # expert-parallel axis (MoE experts split)

  # Multi-process runs (one process per host; docs/scaling.md), named after `jax.distributed.initialize`'s
  # arguments. All None: TPU slices, SLURM, Open MPI and Kubernetes are detected (else one process);
  # $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES / $JAX_PROCESS_ID fill unset ones.
  c.dist = ml_collections.ConfigDict()
  c.dist.coordinator_address = ml_collections.config_dict.placeholder(str)  # "host:port" of process 0
  c.dist.num_processes = ml_collections.config_dict.placeholder(int)  # processes of the run (one per host)
  c.dist.process_id = ml_collections.config_dict.placeholder(int)  # this process's index; 0 writes the files
  c.dist.initialization_timeout = 300  # seconds to wait for every process to connect
  c.dist.heartbeat_timeout_seconds = 100  # a silent peer is declared dead after this (ours: after half of it)

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50  # learner steps between checkpoints (0 = only on SIGTERM / at the end)
  # False: no checkpoint after the last step unless `every` falls on it (metrics-only sweeps and smoke runs of
  # a large model: its weights and AdamW moments are written for nothing); SIGTERM / Ctrl-C still save.
  c.checkpoint.final = True  # write a checkpoint after the last step
  c.checkpoint.keep = 3  # newest checkpoints kept (with eval.every > 0 the best by eval_accuracy too)
  # A resumed run whose config differs from its checkpoint's in a field that changes shapes or semantics:
  # "error" stops with the list of fields; "resume" resumes anyway (deliberate: the arrays must still fit);
  # "restart" moves the old checkpoints and metrics to DIR/previous-<time>/ and starts at step 0.
  c.checkpoint.config_change = "error"  # on resume with a changed config: stop | resume anyway | move the old run aside

  c.reward = ml_collections.ConfigDict()  # how the task's reward function is called (jaxrl_llm.tasks.reward)
  c.reward.timeout_s = 5.0  # per call; a call that overruns scores 0 and counts in reward_errors
  c.reward.max_abs = 1e6  # |reward| above this (or NaN/inf) is an error: scores 0, counted
  # "auto" (the task's choice: worker processes for the math-verify data tasks, threads for the procedural
  # ones) | "thread" | "process" (worker processes: a hung or GIL-holding reward is killed)
  c.reward.executor = "auto"  # where reward calls run: "auto" (the task's choice) | "thread" | "process"
  c.reward.workers = 8  # concurrent reward calls

  c.log = ml_collections.ConfigDict()
  c.log.every = 1  # not read: metrics.jsonl gets a row every learner step
  c.log.progress = True  # a progress bar on the terminal
  c.log.tensorboard = True  # also write TensorBoard event files (DIR/tb)
  return c
