"""The jitted learner: scoring completions, the RL train step and the SFT warm-start step.

Functional core: `train_step(state, batch, key) -> (state, metrics)` is pure and donates `state`.
The loss is looked up by name once, outside the jitted function, so switching losses never adds a
branch inside the step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxrl_llm import losses
from jaxrl_llm.losses import core
from jaxrl_llm.models import ModelConfig, token_logprobs
from jaxrl_llm.types import LossInputs

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


@struct.dataclass
class Batch:
  """One learner batch of B completions (T = P + N: left-padded prompt then completion)."""
  sequence_BT: Array
  positions_BT: Array
  segment_ids_BT: Array
  mask_BN: Array
  adv_BN: Array
  behavior_logp_BN: Array
  versions_BN: Array  # int32 version that generated each completion token
  lag_B: Array
  prox_logp_BN: Optional[Array] = None
  ref_logp_BN: Optional[Array] = None


def completion_logprobs(params, sequence_BT, positions_BT, segment_ids_BT, n_new: int, cfg: ModelConfig,
                        temperature: float, with_entropy: bool = False, perturb=None) -> dict:
  """Log-probs (and entropy) of the last `n_new` tokens of each sequence under `params`.

  Position j of the result scores completion token j given everything before it, exactly the
  context the sampler used (see `sampling.generate`).
  """
  out = token_logprobs(params, sequence_BT[:, :-1], sequence_BT[:, 1:], cfg, positions_BT=positions_BT[:, :-1],
                       segment_ids_BT=segment_ids_BT[:, :-1], temperature=temperature, with_entropy=with_entropy,
                       perturb=perturb)
  P = sequence_BT.shape[1] - n_new
  return {k: v[:, P - 1:] for k, v in out.items()}


def make_optimizer(lr: float, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.98,
                   grad_clip: float = 1.0, warmup_steps: int = 0) -> optax.GradientTransformation:
  sched = optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps > 0 else lr
  tx = optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay)
  return optax.chain(optax.clip_by_global_norm(grad_clip), tx) if grad_clip > 0 else tx


def init_state(params, tx: optax.GradientTransformation, loss_state=None, hook_params=None) -> TrainState:
  z = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the step donates each of them
  opt_state = tx.init(params if hook_params is None else (params, hook_params))
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


def _all_finite(tree) -> Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def make_train_step(model_cfg: ModelConfig, tx: optax.GradientTransformation, loss_name: str,
                    loss_hparams: dict | None = None, *, temperature: float = 1.0,
                    agg_mode: str = "token-mean", drop_rejected: bool = False, norm_len: float | None = None,
                    kl_coef: float = 0.0, kl_estimator: str = "k3", entropy_coef: float = 0.0,
                    on_trace: Callable[[], None] | None = None):
  """Builds the jitted `train_step(state, batch, key) -> (state, metrics)` for one loss.

  A non-finite loss or gradient skips the update: parameters and optimiser state stay bitwise
  unchanged, `version` does not advance, and `update_skipped` / `skipped_consecutive` say so.
  """
  spec = losses.get(loss_name)
  hp = losses.make_hparams(spec, loss_hparams)
  with_entropy = "entropy" in spec.needs or entropy_coef > 0
  perturbed = "perturb" in spec.needs

  def loss_fn(trainable, state: TrainState, batch: Batch, key: Array):
    params, hook = trainable if perturbed else (trainable, None)
    n_new = batch.mask_BN.shape[1]
    # ALP: only the numerator forward is perturbed (fresh noise per step, deterministic given the key).
    perturb = (hook["log_sigma_L"], key) if perturbed else None
    out = completion_logprobs(params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, n_new,
                              model_cfg, temperature, with_entropy, perturb=perturb)
    inputs = LossInputs(
        logp_BT=out["logp_BT"], mask_BT=batch.mask_BN, adv_BT=batch.adv_BN,
        prox_logp_BT=batch.prox_logp_BN, behavior_logp_BT=batch.behavior_logp_BN, ref_logp_BT=batch.ref_logp_BN,
        entropy_BT=out.get("entropy_BT"), versions_BT=batch.versions_BN, current_version=state.version,
        lag_B=batch.lag_B, state=state.loss_state, tokens_BT=batch.sequence_BT[:, -n_new:])
    losses.check_needs(spec, inputs)
    loss_BT, aux = spec.fn(inputs, hp)
    aux = dict(aux)
    if kl_coef > 0:
      term, m = core.kl_to_ref_term(inputs, kl_coef, kl_estimator)
      loss_BT, aux = loss_BT + term, {**aux, **m}
    if entropy_coef > 0:
      term, m = core.entropy_term(inputs, entropy_coef)
      loss_BT, aux = loss_BT + term, {**aux, **m}
    loss = losses.reduce(loss_BT, batch.mask_BN, agg_mode, keep_BT=aux.get("keep_BT"), drop_rejected=drop_rejected,
                         norm_len=norm_len)
    # Divergence between the behaviour policy μ and π_θ on the sampled tokens (samples from μ).
    lr = core.safe_log_ratio(out["logp_BT"], batch.behavior_logp_BN, batch.mask_BN)
    aux["kl_mu_k1"] = core.metric(-lr, batch.mask_BN)
    aux["kl_mu_k3"] = core.metric(jnp.exp(lr) - lr - 1.0, batch.mask_BN)
    if "entropy_BT" in out and "entropy" not in aux:
      aux["entropy"] = core.metric(out["entropy_BT"], batch.mask_BN)
    return loss, aux

  def train_step(state: TrainState, batch: Batch, key: Array):
    if on_trace is not None:
      on_trace()
    trainable = (state.params, state.hook_params) if perturbed else state.params
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, state, batch, key)
    finite = jnp.isfinite(loss) & _all_finite(grads)
    updates, opt_state = tx.update(grads, state.opt_state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    params, hook_params = new_trainable if perturbed else (new_trainable, None)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_loss_state = aux.pop("state", state.loss_state)
    aux.pop("keep_BT", None)
    new_state = TrainState(
        params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state), step=state.step + 1,
        version=state.version + finite.astype(jnp.int32),
        loss_state=keep(new_loss_state, state.loss_state) if state.loss_state is not None else None,
        skipped=jnp.where(finite, 0, state.skipped + 1),
        hook_params=keep(hook_params, state.hook_params) if perturbed else None)
    if perturbed:
      aux["alp_sigma_mean"] = (jnp.exp(new_state.hook_params["log_sigma_L"]).mean(), jnp.ones(()))
    metrics = {**losses.combine_metrics(aux), "loss": loss, "grad_norm": optax.global_norm(grads),
               "update_skipped": (~finite).astype(jnp.int32), "skipped_consecutive": new_state.skipped}
    return new_state, metrics

  return jax.jit(train_step, donate_argnums=0)


def make_score_fn(model_cfg: ModelConfig, temperature: float):
  """Jitted no-grad scorer `(params, batch_fields...) -> logp_BN` (old-log-prob recompute, reference)."""

  @jax.jit
  def score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN):
    out = completion_logprobs(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN.shape[1], model_cfg,
                              temperature)
    return jnp.where(mask_BN > 0, out["logp_BT"], 0.0)

  return score


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
