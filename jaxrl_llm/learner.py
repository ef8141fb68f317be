"""The jitted learner: scoring completions, the RL train step and the SFT warm-start step.

Functional core: `train_step(state, batch, key) -> (state, metrics)` is pure and donates `state`.
The loss is looked up by name once, outside the jitted function, so switching losses never adds a
branch inside the step.

Gradient accumulation (`grad_accum = M`): the batch is cut into M micro-batches along B and scanned.
Each micro-batch gives the (numerator, denominator) of the aggregate (`losses.reduce_parts`); the
numerators' gradients and the denominators are summed and divided once, so the accumulated gradient
equals the full-batch gradient (up to float summation order) for every aggregation mode, as long as a
token's loss depends only on its own sequence. Losses that couple the whole batch (batch statistics,
e.g. M2PO's second-moment mask) see each micro-batch separately; stateful losses are refused.

Update schedule (`minibatches = n`, `epochs = E`): one learner step consumes one rollout batch and makes
E·n optimiser updates, as verl (`ppo_mini_batch_size`, `ppo_epochs`), TRL (`num_iterations`) and AReaL
do: each epoch cuts the batch into n contiguous minibatches along B (in order, no shuffling; the loop
keeps GRPO groups whole by requiring prompts_per_step % n == 0) and takes one update per minibatch,
each with its own `grad_accum` micro-batches. π_old is fixed for the whole batch: the given
`prox_logp_BN`, or, when it is None ("the current parameters"), one no-grad scoring pass with the
parameters at the start of the step, so later minibatches are off-policy w.r.t. π_old exactly as in
those frameworks. All updates run in one XLA program (a scan), so the step still compiles once.
Versions: `TrainState.version` counts *published policies*, i.e. learner steps whose parameters changed
(at least one finite update); the loop publishes once per learner step, so the ParamStore's versions,
the per-token `versions_BN`, lag, fixed_lag, staged stages and async admission all count learner steps
in every mode. With n = E = 1 a version is one optimiser update, as before. Inside the step every update
sees `current_version` = the version at the start of the step. A non-finite update is skipped on its
own (the others still apply); `update_skipped` = 1 only when every update of the step was skipped,
`updates_applied` counts the applied ones and `skipped_consecutive` counts consecutive skipped updates.
An update on a (mini)batch with no token to train on (`mask_BN` all 0: every sample failed or was filtered) is
skipped too, counted by `updates_skipped_empty` (not in `skipped_consecutive`: nothing was non-finite).

LoRA (`TrainState.params` a policy with adapters, `models.lora`): the trainable pytree is the adapters
(`lora.trainable`), so gradients, grad clipping, weight decay and the optimiser's moments cover them only; the
frozen base joins them inside the loss (`lora.with_trainable`) as a constant and leaves the step bitwise unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxrl_llm import losses, packing
from jaxrl_llm.losses import core
from jaxrl_llm.models import ModelConfig, lm_head_weights, token_logprobs
from jaxrl_llm.models import lora
from jaxrl_llm.models.cache import window_attention_mask
from jaxrl_llm.models.logprobs import token_logprobs_shared
from jaxrl_llm.record import Rollout
from jaxrl_llm.types import LossInputs
from jaxrl_llm.vocab_chunks import VocabHead

Array = jax.Array


@struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: Array  # learner steps taken (int32)
  version: Array  # optimiser updates applied (int32); skipped updates do not count
  loss_state: Any = None  # carried by stateful losses (R²VPO's dual variable, ...)
  skipped: Array = None  # consecutive non-finite updates skipped
  hook_params: Any = None  # trainable non-policy params of a model hook (ALP's per-layer log σ), else None


# The learner's batch is the rollout record (`jaxrl_llm.record.Rollout`), as `batch.make_batch` completes it:
# B completions (T = P + N: left-padded prompt then response) with `adv_BN` and `lag_B` set; `prox_logp_BN`
# None means "the current parameters" (on-policy): the step then uses sg(log π_θ) from its own forward instead
# of a separate scoring pass; `ref_logp_BN` is scored inside the step (`fuse_reference`); `extra` holds loss
# inputs fixed at rollout time by `LossInputs` field name (a teacher's); a `VocabHead` entry (`teacher_head`)
# leads with B except its [D, V] lm-head, which every micro-batch shares whole; `routes_BTLk` replays an
# MoE sampler's expert ids (R3); μ's recorded top-k (`behavior_topk_ids_BNk`) and Monte-Carlo candidates
# (`mc_ids_BNJ`), when the sampler kept them, are where the step gathers π_θ for losses that read them.
# Host-only fields (rewards, ids, stats) are None here (`Rollout.learner_view`).
Batch = Rollout


def completion_logprobs(params, sequence_BT, positions_BT, segment_ids_BT, n_new: int, cfg: ModelConfig,
                        temperature: float, with_entropy: bool = False, perturb=None, routes_BTLk=None,
                        gather_ids_BNk=None, return_hidden: bool = False, kv_window_B2=None,
                        keep_routes: bool = False) -> dict:
  """Log-probs (and entropy) of the last `n_new` tokens of each sequence under `params`.

  Position j of the result scores completion token j given everything before it, exactly the
  context the sampler used (see `sampling.generate`). `routes_BTLk` (MoE) replays the sampler's
  expert ids for every input token; the result then also holds the scalar "router_aux_loss".
  `gather_ids_BNk` [B, n_new, k]: also return "gathered_logp_BTk", the tempered log-probs at those ids
  (chunked lm-head: no [B, n_new, V] array). `return_hidden`: also "hidden_BTD", the final hidden states of
  the scored positions (the student's side of a `VocabHead`). `kv_window_B2` [B, 2]: each row's (sinks, window)
  of the sampler's sinks + window KV cache; the forward then sees only what the sampler saw (π_shadow,
  `cache.window_attention_mask`). `keep_routes` (MoE): also "routes_BTLk", the expert ids this forward used at
  every input column, in the batch's [B, T, L, k] layout (the last column, never an input, 0).
  """
  routes = None if routes_BTLk is None else routes_BTLk[:, :-1]
  P = sequence_BT.shape[1] - n_new
  mask_BTT = None
  if kv_window_B2 is not None:
    kv_window_B2 = jnp.asarray(kv_window_B2, jnp.int32)
    mask_BTT = window_attention_mask(positions_BT[:, :-1], segment_ids_BT[:, :-1], kv_window_B2[:, 0],
                                     kv_window_B2[:, 1])
  # query_start: prompt positions only feed keys/values; their outputs are never scored.
  out = token_logprobs(params, sequence_BT[:, :-1], sequence_BT[:, 1:], cfg, positions_BT=positions_BT[:, :-1],
                       segment_ids_BT=segment_ids_BT[:, :-1], temperature=temperature, with_entropy=with_entropy,
                       perturb=perturb, routes_BTLk=routes, query_start=P - 1, gather_ids_BTk=gather_ids_BNk,
                       return_hidden=return_hidden, mask_BTT=mask_BTT)
  used = out.pop("routes_BTLk", None)
  if keep_routes and used is not None:
    out["routes_BTLk"] = jnp.pad(used, ((0, 0), (0, 1)) + ((0, 0),) * (used.ndim - 2))
  return out


def grouped_completion_logprobs(params, sequence_BT, positions_BT, segment_ids_BT, n_new: int, cfg: ModelConfig,
                                temperature: float, group_size: int, with_entropy: bool = False, perturb=None,
                                routes_BTLk=None, gather_ids_BNk=None, return_hidden: bool = False) -> dict:
  """`completion_logprobs` with each GRPO group's prompt run once (rows g·G .. g·G+G-1 share it;
  `models.token_logprobs_shared`, checked on device). Values and gradients equal the plain path up
  to rounding. Falls back to the plain path where sharing would not be exact or does not apply: G = 1,
  a batch of B % G != 0 rows (a micro-batch cutting groups), MoE, ALP noise (`perturb`, drawn per row),
  replayed routes."""
  B = sequence_BT.shape[0]
  if group_size == 1 or B % group_size or cfg.is_moe or perturb is not None or routes_BTLk is not None:
    return completion_logprobs(params, sequence_BT, positions_BT, segment_ids_BT, n_new, cfg, temperature,
                               with_entropy, perturb=perturb, routes_BTLk=routes_BTLk, gather_ids_BNk=gather_ids_BNk,
                               return_hidden=return_hidden)
  P = sequence_BT.shape[1] - n_new
  return token_logprobs_shared(params, sequence_BT[:, :-1], sequence_BT[:, 1:], cfg, query_start=P - 1,
                               group_size=group_size, positions_BT=positions_BT[:, :-1],
                               segment_ids_BT=segment_ids_BT[:, :-1], temperature=temperature,
                               with_entropy=with_entropy, gather_ids_BTk=gather_ids_BNk, return_hidden=return_hidden)


def _static_key(x):
  """A hashable stand-in for a builder argument: containers by value, anything else as it hashes (a function or
  an optimiser by identity). TypeError for an unhashable leaf (a pytree of shardings holding dicts)."""
  if isinstance(x, dict):
    return ("dict", tuple(sorted((k, _static_key(v)) for k, v in x.items())))
  if isinstance(x, (list, tuple)):
    return (type(x).__name__, tuple(_static_key(v) for v in x))
  hash(x)
  return (type(x), x)  # 1, 1.0 and True hash alike but are different arguments


def _once_per_static_args(make: Callable) -> Callable:
  """`make` (a builder of a jitted function) called once per distinct arguments in a process (the last 64 kept).

  jit caches compiled programs per function object, so a builder that returns a fresh closure on every call
  re-traces, re-lowers and re-compiles (or re-loads from the persistent cache) the same program for every run a
  process starts: the test suite starts hundreds, an experiment script or notebook several. Equal arguments now
  return the same jitted function, and with it its compiled programs. Arguments that cannot be hashed build anew.
  """
  cache: collections.OrderedDict = collections.OrderedDict()

  @functools.wraps(make)
  def build(*args, **kw):
    try:
      key = _static_key((args, kw))
    except TypeError:
      return make(*args, **kw)
    if key in cache:
      cache.move_to_end(key)
      return cache[key]
    fn = cache[key] = make(*args, **kw)
    if len(cache) > 64:
      cache.popitem(last=False)
    return fn

  return build


@_once_per_static_args
def make_optimizer(lr: float, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.98,
                   grad_clip: float = 1.0, warmup_steps: int = 0) -> optax.GradientTransformation:
  sched = optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps > 0 else lr
  tx = optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay)
  return optax.chain(clip_by_global_norm(grad_clip), tx) if grad_clip > 0 else tx


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` as one scale factor: XLA fuses `g * factor` into each consumer. optax's
  `select(norm < max_norm, g, g / norm * max_norm)` has a divide, which XLA:CPU materialises per leaf, all of them
  before the moments read them: a second copy of the gradients. Equal up to rounding (a product for a quotient)."""

  def update(updates, state, params=None):
    del params
    norm = optax.global_norm(updates)
    factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def init_state(params, tx: optax.GradientTransformation, loss_state=None, hook_params=None) -> TrainState:
  z = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the step donates each of them
  trainable = lora.trainable(params)  # LoRA: the optimiser holds the adapters' moments only
  opt_state = tx.init(trainable if hook_params is None else (trainable, hook_params))
  return TrainState(params=params, opt_state=opt_state, step=z(), version=z(), loss_state=loss_state,
                    skipped=z(), hook_params=hook_params)


def perturb_hook(loss_name: str, model_cfg: ModelConfig, tx: optax.GradientTransformation, loss_hparams=None):
  """(hook_params, tx) for a loss needing the ALP perturbation hook, else (None, tx).

  ALP (addendum §5): one learnable log σ per layer, initialised at log(perturb_std), trained by the
  same RL loss with its own AdamW learning rate (`perturb_lr`).
  """
  spec = losses.get(loss_name)
  if "perturb" not in spec.needs:
    return None, tx
  hp = losses.make_hparams(spec, loss_hparams)
  hook = {"log_sigma_L": jnp.full((model_cfg.n_layers,), jnp.log(hp.perturb_std), jnp.float32)}
  joint = optax.multi_transform({"model": tx, "hook": optax.adamw(hp.perturb_lr)}, ("model", "hook"))
  return hook, joint


def _take_shared(batch: Batch) -> tuple[Batch, dict]:
  """(batch without its batch-wide arrays, {extra key: array}): the [D, V] lm-heads of `VocabHead`
  extras are shared by every sequence, so micro-batches and minibatches must not split them."""
  heads = {k: v.w_DV for k, v in (batch.extra or {}).items() if isinstance(v, VocabHead)}
  if not heads:
    return batch, heads
  return batch.replace(extra={k: v.replace(w_DV=None) if k in heads else v for k, v in batch.extra.items()}), heads


def _put_shared(batch: Batch, heads: dict) -> Batch:
  """Inverse of `_take_shared` (on the whole batch or any micro-batch of it)."""
  if not heads:
    return batch
  return batch.replace(extra={k: v.replace(w_DV=heads[k]) if k in heads else v for k, v in batch.extra.items()})


def _split_micro(batch: Batch, m: int, field: str = "optim.grad_accum") -> Batch:
  """[B, ...] -> [m, B/m, ...] on every field (all Batch fields lead with B; a `packing.Packing`'s rows lead
  with chunks · R, packed chunk by chunk, so they cut along the same boundaries)."""
  B = batch.mask_BN.shape[0]
  if B % m:
    raise ValueError(f"{field}={m} must divide the batch size B={B}")
  return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)


def _combine_micro(aux_M: dict) -> dict:
  """Per-micro-batch (sum, count) metrics stacked on a leading M axis -> one (sum, count) each."""
  return {k: (jnp.max(s), jnp.sum(c)) if k.endswith("_max") else (jnp.sum(s), jnp.sum(c))
          for k, (s, c) in aux_M.items()}


def _jit_shardings(in_shardings, out_shardings) -> dict:
  """The `jax.jit` shardings kwargs that were given (None keeps jit's default layout)."""
  return {k: v for k, v in (("in_shardings", in_shardings), ("out_shardings", out_shardings)) if v is not None}


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """The static settings of one train step, which its pieces read (`make_train_step` builds it once)."""
  model_cfg: ModelConfig
  loss_name: str
  loss: Any  # losses.LossSpec
  hp: Any  # the loss's Hparams
  temperature: float = 1.0
  agg_mode: str = "token-mean"
  drop_rejected: bool = False
  norm_len: float | None = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  router_aux_coef: float = 0.0
  grad_accum: int = 1
  minibatches: int = 1
  epochs: int = 1
  group_size: int = 1
  old_policy_routes: bool = False  # R2: updates after the first replay the routes of the step-start forward

  def needs(self, what: str) -> bool:
    return what in self.loss.needs

  @property
  def perturbed(self) -> bool:  # ALP: a noise hook trained beside the parameters
    return self.needs("perturb")

  @property
  def shadow(self) -> bool:  # SMD: a second forward under the sampler's KV visibility mask
    return self.needs("shadow")

  @property
  def student_dense(self) -> bool:  # full-distribution losses read the student as a VocabHead
    return self.needs("student_logits") or self.shadow

  @property
  def n_updates(self) -> int:
    return self.minibatches * self.epochs


# --- the pieces of a train step, each a pure function of the spec and its arrays ---------------------------------

def _candidate_ids(s: StepSpec, batch: Batch) -> dict:
  """{loss field: [B, N, k] ids}: the id sets at which the one forward gathers π_θ (the teacher's top-k, μ's
  recorded top-k, the Monte-Carlo candidates), in a fixed order."""
  id_sets = {"student_topk_logp_BNk": (batch.extra or {}).get("teacher_topk_ids_BNk") if s.needs("student_topk")
             else None,
             "topk_logp_BNk": batch.behavior_topk_ids_BNk if s.needs("behavior_topk") else None,
             "mc_logp_BNJ": batch.mc_ids_BNJ if s.needs("mc") else None}
  return {k: v for k, v in id_sets.items() if v is not None}


def _policy_forward(s: StepSpec, params, batch: Batch, perturb, gather_ids) -> dict:
  """The forward variant: packed rows (`optim.pack_width`, outputs gathered back to [B, N]) or the padded rows
  (each GRPO prompt once with `group_size` > 1)."""
  n_new = batch.mask_BN.shape[1]
  if batch.pack is not None:
    return packing.packed_logprobs(params, batch.pack, batch.sequence_BT.shape[1], n_new, s.model_cfg, s.temperature,
                                   True, gather_ids_BNk=gather_ids, return_hidden=s.student_dense)
  return grouped_completion_logprobs(params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, n_new,
                                     s.model_cfg, s.temperature, s.group_size, True, perturb=perturb,
                                     routes_BTLk=batch.routes_BTLk, gather_ids_BNk=gather_ids,
                                     return_hidden=s.student_dense)


def _loss_inputs(s: StepSpec, params, state: TrainState, batch: Batch, out: dict, id_sets: dict,
                 perturb) -> LossInputs:
  """What the loss reads: the forward's outputs, the batch's records and each need's extra fields."""
  n_new = batch.mask_BN.shape[1]
  prox_BN = batch.prox_logp_BN if batch.prox_logp_BN is not None else jax.lax.stop_gradient(out["logp_BT"])
  inputs = LossInputs(
      logp_BN=out["logp_BT"], mask_BN=batch.mask_BN, adv_BN=batch.adv_BN,
      prox_logp_BN=prox_BN, behavior_logp_BN=batch.behavior_logp_BN, ref_logp_BN=batch.ref_logp_BN,
      entropy_BN=out.get("entropy_BT"), versions_BN=batch.versions_BN, current_version=state.version,
      lag_B=batch.lag_B, state=state.loss_state, tokens_BN=batch.sequence_BT[:, -n_new:],
      turn_BN=batch.turn_BN)  # None for single completions; multi-turn episodes number their turns
  if batch.extra:
    inputs = inputs.replace(**batch.extra)
  head = lambda h: VocabHead(hidden_BND=h, w_DV=lm_head_weights(params, s.model_cfg), temperature=s.temperature)
  if s.student_dense:
    inputs = inputs.replace(student_head=head(out["hidden_BTD"]))
  if id_sets:  # one gather over the concatenated id sets, split back in order
    ends = np.cumsum([v.shape[-1] for v in id_sets.values()])
    inputs = inputs.replace(**dict(zip(id_sets, jnp.split(out["gathered_logp_BTk"], ends[:-1], axis=-1))))
  if s.shadow:
    if batch.kv_window_B2 is None:
      raise ValueError(f"loss {s.loss_name!r} needs the sampler's KV window record kv_window_B2 "
                       "(sampler.kv_cache='window')")
    sh = completion_logprobs(params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, n_new, s.model_cfg,
                             s.temperature, perturb=perturb, routes_BTLk=batch.routes_BTLk, return_hidden=True,
                             kv_window_B2=batch.kv_window_B2)
    inputs = inputs.replace(shadow_logp_BN=sh["logp_BT"], shadow_head=head(sh["hidden_BTD"]))
  if s.needs("behavior_topk"):
    inputs = inputs.replace(behavior_topk_ids_BNk=batch.behavior_topk_ids_BNk,
                            behavior_topk_logp_BNk=batch.behavior_topk_logp_BNk)
  if s.needs("mc"):  # mc_teacher_logp_BNJ comes with the teacher's fields (`extra`)
    inputs = inputs.replace(mc_ids_BNJ=batch.mc_ids_BNJ, mc_behavior_logp_BNJ=batch.mc_behavior_logp_BNJ)
  return inputs


def _objective(s: StepSpec, inputs: LossInputs, out: dict) -> tuple[Array, tuple[Array, Array, dict]]:
  """(objective numerator, (numerator, denominator, aux)) of the loss and its regularisers (KL to the reference,
  entropy bonus, MoE load balancing); the gradient is ∇objective / denominator."""
  losses.check_needs(s.loss, inputs)
  loss_BN, aux = s.loss.fn(inputs, s.hp)
  aux = dict(aux)
  if s.kl_coef > 0:
    term, m = core.kl_to_ref_term(inputs, s.kl_coef, s.kl_estimator)
    loss_BN, aux = loss_BN + term, {**aux, **m}
  if s.entropy_coef > 0:
    term, m = core.entropy_term(inputs, s.entropy_coef)
    loss_BN, aux = loss_BN + term, {**aux, **m}
  num, den = losses.reduce_parts(loss_BN, inputs.mask_BN, s.agg_mode, keep_BN=aux.pop("keep_BN", None),
                                 drop_rejected=s.drop_rejected, norm_len=s.norm_len)
  objective = num
  if "router_aux_loss" in out:
    # Weighted by this micro-batch's denominator so that objective / Σ den = loss + coef · aux.
    den_sg = jax.lax.stop_gradient(den)
    objective = objective + s.router_aux_coef * out["router_aux_loss"] * den_sg
    aux["router_aux_loss"] = (out["router_aux_loss"] * den_sg, den_sg)
  return objective, (num, den, aux)


def _diagnostics(inputs: LossInputs, out: dict) -> dict:
  """Metrics of every step, whatever the loss: π_θ against μ, π_old against μ, π_θ against π_old, entropy."""
  mask_BN, mu_BN = inputs.mask_BN, inputs.behavior_logp_BN
  # Divergence between the behaviour policy μ and π_θ on the sampled tokens (samples from μ).
  lr = core.safe_log_ratio(inputs.logp_BN, mu_BN, mask_BN)
  aux = {"kl_mu_k1": core.metric(-lr, mask_BN), "kl_mu_k3": core.metric(jnp.exp(lr) - lr - 1.0, mask_BN)}
  # Training–inference mismatch |π_old − μ| (precision / kernels; equal versions under `recompute`). A loss
  # that reads no π_old gets none scored (`config.scores_prox`): π_θ stands in, and on stale batches this
  # then measures |π_θ − μ|, staleness included.
  mism_BN = jnp.abs(core.safe_log_ratio(inputs.prox_logp_BN, mu_BN, mask_BN))
  # Drift of π_θ from π_old, |π_θ/π_old − 1|: exactly 0 with one update per batch and π_old current,
  # > 0 once earlier minibatches of the same batch have moved the policy.
  drift_BN = jnp.abs(jnp.exp(core.safe_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, mask_BN)) - 1.0)
  aux["ratio_old_abs_dev"] = core.metric(drift_BN, mask_BN)
  aux["mismatch_abs_mean"] = core.metric(mism_BN, mask_BN)
  aux["mismatch_abs_max"] = core.max_metric(mism_BN, mask_BN)
  if "entropy_BT" in out:
    aux["entropy"] = core.metric(out["entropy_BT"], mask_BN)
  return aux


def _loss_parts(s: StepSpec, trainable, state: TrainState, batch: Batch, key: Array, heads: dict):
  """forward → loss inputs → objective (+ diagnostics): what `jax.value_and_grad` differentiates."""
  params, hook = trainable if s.perturbed else (trainable, None)
  params = lora.with_trainable(state.params, params)  # LoRA: the frozen base joins the adapters here
  batch = _put_shared(batch, heads)
  # ALP: only the numerator forward is perturbed (fresh noise per step, deterministic given the key).
  perturb = (hook["log_sigma_L"], key) if s.perturbed else None
  id_sets = _candidate_ids(s, batch)
  gather_ids = jnp.concatenate([jnp.asarray(v, jnp.int32) for v in id_sets.values()], -1) if id_sets else None
  out = _policy_forward(s, params, batch, perturb, gather_ids)
  inputs = _loss_inputs(s, params, state, batch, out, id_sets, perturb)
  objective, (num, den, aux) = _objective(s, inputs, out)
  diagnostics = _diagnostics(inputs, out)
  if "entropy" in aux:  # the loss's own entropy metric (e.g. the entropy bonus's) is kept
    diagnostics.pop("entropy", None)
  return objective, (num, den, {**aux, **diagnostics})


def _accumulate(s: StepSpec, trainable, state: TrainState, batch: Batch, key: Array, heads: dict):
  """(loss, aux, grads) of the whole batch from `grad_accum` sequential micro-batches."""
  parts_and_grad = jax.value_and_grad(functools.partial(_loss_parts, s), has_aux=True)
  if s.grad_accum == 1:
    (_, (num, den, aux)), g = parts_and_grad(trainable, state, batch, key, heads)
  else:
    def micro(g_acc, xs):
      mb, i = xs
      (_, (num, den, aux)), g = parts_and_grad(trainable, state, mb, jax.random.fold_in(key, i), heads)
      return jax.tree.map(jnp.add, g_acc, g), (num, den, aux)

    zeros = jax.tree.map(jnp.zeros_like, trainable)
    g, (num_M, den_M, aux_M) = jax.lax.scan(micro, zeros, (_split_micro(batch, s.grad_accum), jnp.arange(s.grad_accum)))
    new_loss_state = aux_M.pop("state", None)
    num, den, aux = num_M.sum(), den_M.sum(), _combine_micro(aux_M)
    if new_loss_state is not None:
      aux["state"] = new_loss_state
  scale = 1.0 / jnp.maximum(den, 1.0)
  return num * scale, aux, jax.tree.map(lambda x: x * scale.astype(x.dtype), g)


def _optimise(tx: optax.GradientTransformation, trainable, opt_state, grads):
  updates, opt_state = tx.update(grads, opt_state, trainable)
  return optax.apply_updates(trainable, updates), opt_state


def update_if(apply: Array, tx: optax.GradientTransformation, trainable, opt_state, grads):
  """(trainable, opt_state) after `tx`'s update when `apply`, else both as they were (bitwise).

  A branch, not a select of the new state against the old: with a select each leaf reads the old moments after the
  fusions that overwrite them in place, so XLA copied both moments first (`bench/optimizer_update.py`)."""
  return jax.lax.cond(apply, functools.partial(_optimise, tx), lambda t, o, g: (t, o), trainable, opt_state, grads)


def _update(s: StepSpec, tx: optax.GradientTransformation, state: TrainState, batch: Batch, key: Array, heads: dict):
  """One optimiser update on `batch`: (state with new params / opt / loss state / skips, applied, loss,
  aux, gradient norm, empty): applied = finite and not empty (no token to train on). `step` and `version` are left to
  the caller (they count learner steps). `heads`: the batch-wide arrays `_take_shared` took out of `batch`."""
  own = lora.trainable(state.params)  # the adapters of a LoRA policy (the base is a constant), else all params
  trainable = (own, state.hook_params) if s.perturbed else own
  loss, aux, grads = _accumulate(s, trainable, state, batch, key, heads)
  # Finite when the norm is: an inf or nan anywhere makes it so (and a sum of squares past 3e38, gradients ~1e19).
  # `all(isfinite(g))` per leaf made XLA read the unscaled gradients after the scaled ones were due, so it wrote those
  # beside them, not over them: a second copy of the gradients.
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  # A batch with no token to train on (every sample failed or masked) moves nothing: AdamW's moments and weight
  # decay would still change the weights, so the update is skipped, counted apart from the non-finite ones.
  empty = ~jnp.any(batch.mask_BN > 0)
  apply = finite & ~empty
  new_trainable, opt_state = update_if(apply, tx, trainable, state.opt_state, grads)
  params, hook_params = new_trainable if s.perturbed else (new_trainable, None)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
  new_loss_state = aux.pop("state", state.loss_state)
  new_state = state.replace(
      params=lora.with_trainable(state.params, params), opt_state=opt_state,
      loss_state=keep(new_loss_state, state.loss_state) if state.loss_state is not None else None,
      skipped=jnp.where(finite, jnp.where(empty, state.skipped, 0), state.skipped + 1),
      hook_params=hook_params)
  return new_state, apply, loss, aux, grad_norm, empty


def _finish(s: StepSpec, state: TrainState, new_state: TrainState, applied: Array, aux: dict, metrics: dict):
  """The step's bookkeeping: `step` + 1, `version` + 1 when an update applied; the metrics."""
  new_state = new_state.replace(step=state.step + 1, version=state.version + applied.astype(jnp.int32))
  if s.perturbed:
    aux["alp_sigma_mean"] = (jnp.exp(new_state.hook_params["log_sigma_L"]).mean(), jnp.ones(()))
  return new_state, {**losses.combine_metrics(aux), **metrics, "update_skipped": (~applied).astype(jnp.int32),
                     "skipped_consecutive": new_state.skipped}


def _one_update_step(s: StepSpec, tx, state: TrainState, batch: Batch, key: Array, heads: dict):
  """The default schedule: one update on the whole batch."""
  new_state, applied, loss, aux, grad_norm, empty = _update(s, tx, state, batch, key, heads)
  d_sum, d_count = aux["ratio_old_abs_dev"]
  return _finish(s, state, new_state, applied, aux, {"loss": loss, "grad_norm": grad_norm,
                                                     "updates_applied": applied.astype(jnp.int32),
                                                     "updates_skipped_empty": empty.astype(jnp.int32),
                                                     "ratio_old_abs_dev_last": d_sum / jnp.maximum(d_count, 1.0)})


def _step_start_forward(s: StepSpec, params, batch: Batch) -> Batch:
  """The forward of the parameters at the step start: π_old's log-probs where the batch has none, and with R2
  (`old_policy_routes`, routing replay from the training engine's π_old forward) that forward's own expert ids,
  put into the batch so that every update of the step replays them (the sampler's routes, if any, are not used)."""
  r2 = s.old_policy_routes
  if batch.pack is not None:
    pk = batch.pack.replace(routes_RWLk=None) if r2 else batch.pack
    out = packing.packed_logprobs(params, pk, batch.sequence_BT.shape[1], batch.mask_BN.shape[1], s.model_cfg,
                                  s.temperature, keep_routes=r2)
    if r2:
      batch = batch.replace(pack=batch.pack.replace(routes_RWLk=jax.lax.stop_gradient(out["routes_RWLk"])))
  else:
    out = completion_logprobs(params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT,
                              batch.mask_BN.shape[1], s.model_cfg, s.temperature,
                              routes_BTLk=None if r2 else batch.routes_BTLk, keep_routes=r2)
    if r2:
      batch = batch.replace(routes_BTLk=jax.lax.stop_gradient(out["routes_BTLk"]))
  if batch.prox_logp_BN is None:
    batch = batch.replace(prox_logp_BN=jax.lax.stop_gradient(jnp.where(batch.mask_BN > 0, out["logp_BT"], 0.0)))
  return batch


def _multi_update_step(s: StepSpec, tx, state: TrainState, batch: Batch, key: Array, heads: dict):
  """`epochs` passes of `minibatches` updates, π_old fixed at the step start (module docstring)."""
  if batch.prox_logp_BN is None or s.old_policy_routes:  # the parameters at the step start, scored once
    batch = _step_start_forward(s, state.params, batch)
  mbs = _split_micro(batch, s.minibatches, "optim.minibatches")

  def one(st, xs):
    mb, i = xs
    st, applied, loss, aux, grad_norm, empty = _update(s, tx, st, mb, jax.random.fold_in(key, i), heads)
    return st, (applied, empty, loss, grad_norm, aux)

  def epoch(st, e):
    return jax.lax.scan(one, st, (mbs, e * s.minibatches + jnp.arange(s.minibatches)))

  new_state, (applied_RM, empty_RM, loss_RM, gnorm_RM, aux_RM) = jax.lax.scan(epoch, state, jnp.arange(s.epochs))
  flat = lambda x: x.reshape(s.n_updates, *x.shape[2:])
  aux = _combine_micro(jax.tree.map(flat, aux_RM))
  drift_s, drift_c = aux_RM["ratio_old_abs_dev"]
  metrics = {"loss": loss_RM.mean(), "grad_norm": gnorm_RM.mean(),
             "updates_applied": applied_RM.sum().astype(jnp.int32),
             "updates_skipped_empty": empty_RM.sum().astype(jnp.int32),
             # the last update's drift from π_old: > 0 once earlier minibatches moved the policy
             "ratio_old_abs_dev_last": flat(drift_s)[-1] / jnp.maximum(flat(drift_c)[-1], 1.0)}
  return _finish(s, state, new_state, applied_RM.any(), aux, metrics)


def _train_step(s: StepSpec, tx, on_trace, state: TrainState, batch: Batch, key: Array):
  if on_trace is not None:
    on_trace()
  if batch.adv_BN is None or batch.lag_B is None:
    raise ValueError("the learner's batch needs adv_BN and lag_B (`jaxrl_llm.batch.make_batch` sets them)")
  batch, heads = _take_shared(batch)
  schedule = _multi_update_step if s.n_updates > 1 else _one_update_step
  return schedule(s, tx, state, batch, key, heads)


@_once_per_static_args
def make_train_step(model_cfg: ModelConfig, tx: optax.GradientTransformation, loss_name: str,
                    loss_hparams: dict | None = None, *, temperature: float = 1.0,
                    agg_mode: str = "token-mean", drop_rejected: bool = False, norm_len: float | None = None,
                    kl_coef: float = 0.0, kl_estimator: str = "k3", entropy_coef: float = 0.0,
                    router_aux_coef: float = 0.0, grad_accum: int = 1, minibatches: int = 1, epochs: int = 1,
                    in_shardings=None, out_shardings=None, on_trace: Callable[[], None] | None = None,
                    group_size: int = 1, old_policy_routes: bool = False):
  """Builds the jitted `train_step(state, batch, key) -> (state, metrics)` for one loss.

  The step is composed of small pure pieces over one static `StepSpec`: the candidate ids the loss reads
  (`_candidate_ids`), the forward variant (`_policy_forward`: packed or padded rows), the loss's inputs
  (`_loss_inputs`: each need adds its fields), the objective and its regularisers (`_objective`) with the
  diagnostics every step logs (`_diagnostics`), micro-batching (`_accumulate`), the update with its skip rules
  (`_update`) and the update schedule (`_one_update_step`, `_multi_update_step`). A feature adds a piece or a
  field of the spec, not a branch here.

  A non-finite loss or gradient skips the update: parameters and optimiser state stay bitwise
  unchanged, `version` does not advance, and `update_skipped` / `skipped_consecutive` say so.

  MoE: `router_aux_coef` weights the load-balancing loss (token-weighted over micro-batches); a
  batch with `routes_BTLk` replays the sampler's expert ids (R3). `old_policy_routes` (R2): a step of several
  updates routes the step-start forward natively and replays its expert ids in every update (one update: its
  own routing, which is the same thing). `grad_accum` micro-batches and the
  `minibatches` x `epochs` update schedule: see the module docstring. `in_shardings` / `out_shardings` are passed to `jax.jit` (see
  `jaxrl_llm.sharding.train_step_shardings`); None keeps the single-device default.
  `group_size` G > 1 (GRPO groups: rows g·G .. g·G+G-1 share one prompt): the policy forward and
  backward run each prompt once (`grouped_completion_logprobs`); same update up to rounding.
  Candidate log-probs: the one forward gathers π_θ (tempered, full-vocabulary normalised, differentiable)
  at every id set the loss reads, concatenated along the last axis and split after: the teacher's top-k
  (`student_topk` → `student_topk_logp_BNk`), μ's recorded top-k (`behavior_topk` → `topk_logp_BNk`) and
  the Monte-Carlo candidates (`mc` → `mc_logp_BNJ`).
  A batch with `pack` (`packing.Packing`, `optim.pack_width`): the forward runs on the packed rows and its
  outputs are gathered back to [B, N], so the loss sees the same inputs (`packing` module docstring).
  """
  spec = losses.get(loss_name)
  why = losses.micro_batching_error(spec, grad_accum)
  if why is not None:
    raise ValueError(f"optim.grad_accum={grad_accum!r}: {why}")
  for name, v in (("optim.minibatches", minibatches), ("optim.epochs", epochs)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")
  s = StepSpec(model_cfg=model_cfg, loss_name=loss_name, loss=spec, hp=losses.make_hparams(spec, loss_hparams),
               temperature=temperature, agg_mode=agg_mode, drop_rejected=drop_rejected, norm_len=norm_len,
               kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef,
               router_aux_coef=router_aux_coef, grad_accum=grad_accum, minibatches=minibatches, epochs=epochs,
               group_size=group_size, old_policy_routes=old_policy_routes and model_cfg.is_moe)
  return jax.jit(functools.partial(_train_step, s, tx, on_trace), donate_argnums=0,
                 **_jit_shardings(in_shardings, out_shardings))


@_once_per_static_args
def make_score_fn(model_cfg: ModelConfig, temperature: float, group_size: int = 1):
  """Jitted no-grad scorer `(params, batch_fields..., routes_BTLk=None) -> logp_BN` (old-log-prob
  recompute, reference). `routes_BTLk` replays an MoE sampler's expert ids (R3).

  `group_size` G > 1 (GRPO: rows g·G .. g·G+G-1 complete one prompt): a dense model runs each group's
  prompt once and scores its G completions against those keys/values (`models.token_logprobs_shared`;
  checked on device, a batch whose groups differ is scored row by row). Same values up to rounding.
  `pack` (a `packing.Packing` of the batch): score its packed rows instead; same values up to rounding."""

  @jax.jit
  def score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, routes_BTLk=None, pack=None):
    if pack is not None:  # `packing.Packing` of these rows: score the packed rows (`optim.pack_width`)
      out = packing.packed_logprobs(params, pack, sequence_BT.shape[1], mask_BN.shape[1], model_cfg, temperature)
      return jnp.where(mask_BN > 0, out["logp_BT"], 0.0)
    out = grouped_completion_logprobs(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN.shape[1], model_cfg,
                                      temperature, group_size, routes_BTLk=routes_BTLk)
    return jnp.where(mask_BN > 0, out["logp_BT"], 0.0)

  return score


@_once_per_static_args
def fuse_reference(train_step: Callable, score: Callable, in_shardings=None, out_shardings=None) -> Callable:
  """`step(state, batch, key, ref_params) -> (state, metrics)`: scores the batch under the frozen
  reference policy (`score`, from `make_score_fn`; no gradient flows into it) and runs `train_step`
  (from `make_train_step`) with those log-probs as `ref_logp_BN`, in one XLA program.

  The update equals scoring first and passing `ref_logp_BN` in the batch. One program saves a dispatch
  and lets XLA run the reference forward alongside the policy's forward and backward, which fills
  the cores that small ops leave idle (measured in `bench/grpo_step.py`). `in_shardings`, when
  given, has a fourth entry: the reference params' layout.
  """

  def step(state: TrainState, batch: Batch, key: Array, ref_params):
    ref_logp_BN = score(ref_params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, batch.mask_BN,
                        batch.routes_BTLk, pack=batch.pack)
    return train_step(state, batch.replace(ref_logp_BN=ref_logp_BN), key)

  return jax.jit(step, donate_argnums=0, **_jit_shardings(in_shardings, out_shardings))


@_once_per_static_args
def make_sft_step(model_cfg: ModelConfig, tx: optax.GradientTransformation):
  """Jitted supervised step: mean negative log-likelihood of the target tokens (temperature 1)."""

  def loss_fn(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN):
    out = completion_logprobs(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN.shape[1], model_cfg, 1.0)
    nll = jnp.where(mask_BN > 0, -out["logp_BT"], 0.0)
    return nll.sum() / jnp.maximum(mask_BN.sum(), 1.0)

  def sft_step(params, opt_state, sequence_BT, positions_BT, segment_ids_BT, mask_BN):
    loss, grads = jax.value_and_grad(loss_fn)(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(sft_step, donate_argnums=(0, 1))
