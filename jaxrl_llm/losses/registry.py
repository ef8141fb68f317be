"""Name -> (fn, Hparams, needs) registry for policy and distillation losses.

A loss is `fn(inputs: LossInputs, hp: Hparams) -> (loss_BN, aux)`: pure, jittable, per-token loss
already multiplied by the loss mask (aggregation happens once, in `reduce`). `aux` is a dict whose
entries are metrics as `(sum, count)` pairs, except two reserved keys:
  - "keep_BN": the mask after the loss's own rejection/masking (used by `reduce` when rejected tokens
    leave the denominator);
  - "state": the loss's carried state for the next step (e.g. R²VPO's dual variable).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import chex
import numpy as np

from jaxrl_llm.types import LossInputs

# Need name -> the LossInputs fields it requires.
NEED_FIELDS: dict[str, tuple[str, ...]] = {
    "prox_logp": ("prox_logp_BN",),
    "behavior_logp": ("behavior_logp_BN",),
    "ref_logp": ("ref_logp_BN",),
    "entropy": ("entropy_BN",),
    "versions": ("versions_BN", "current_version"),
    "lag": ("lag_B",),
    "behavior_topk": ("behavior_topk_ids_BNk", "behavior_topk_logp_BNk", "topk_logp_BNk"),
    "turn": ("turn_BN",),
    "teacher_logp": ("teacher_logp_BN",),
    "teacher_topk": ("teacher_topk_ids_BNk", "teacher_topk_logp_BNk"),
    "state": ("state",),
    "tokens": ("tokens_BN",),
    # Not an input field: the learner computes logp_BN with the ALP perturbed forward and trains the
    # per-layer log σ (`hp.perturb_std`, `hp.perturb_lr`) alongside the model (see learner.py).
    "perturb": (),
    # Not an input field either: prox_logp_BN must come from the EWMA copy of past weights (`rollout.old_logp="ewma"`,
    # PPO-EWMA); a run that recomputes π_old at the generating version would be plain decoupled PPO.
    "ewma_prox": (),
    "student_logits": ("student_logits_BNV",),
    "teacher_logits": ("teacher_logits_BNV",),
    "student_topk": ("student_topk_logp_BNk",),
    "teacher_ref_topk": ("teacher_ref_topk_logp_BNk",),
    "mc": ("mc_ids_BNJ", "mc_logp_BNJ", "mc_behavior_logp_BNJ", "mc_teacher_logp_BNJ"),
    "sup_drift": ("sup_drift_B",),
    "eviction": ("eviction_mask_BN",),
    # The learner's second forward under the sampler's KV visibility mask (sampler.kv_cache="window"), with
    # the dense forward's VocabHead alongside (`losses.smd`).
    "shadow": ("shadow_logp_BN", "shadow_head", "student_head"),
}
# Needs that another set of fields satisfies as well: full distributions as dense [B, N, V] logits or as
# chunked `vocab_chunks.VocabHead`s (hidden states + lm-head; see `losses.dense`).
NEED_ALTERNATIVES: dict[str, tuple[str, ...]] = {
    "student_logits": ("student_head",),
    "teacher_logits": ("teacher_head",),
}


class LossSpec(NamedTuple):
  name: str
  fn: Callable[[LossInputs, Any], tuple[Any, dict]]
  Hparams: type
  needs: frozenset[str]
  init_state: Callable[[Any], Any] | None  # hp -> initial carried state (None if stateless)
  # run config -> {hyper-parameter: value}: defaults that depend on the run (EPO's smoothing starts at half the
  # episode's turn limit); `loss.hparams` overrides them (`run_hparams`)
  run_defaults: Callable[[Any], dict] | None = None

  @property
  def doc(self) -> str:
    return (self.fn.__doc__ or "").strip()


_REGISTRY: dict[str, LossSpec] = {}


def register(name: str, fn, Hparams: type, needs=(), init_state=None, run_defaults=None) -> LossSpec:
  """Registers a loss. Duplicate names and unknown needs raise ValueError."""
  if name in _REGISTRY:
    raise ValueError(f"loss {name!r} is already registered")
  if not dataclasses.is_dataclass(Hparams):
    raise TypeError(f"Hparams of loss {name!r} must be a (frozen) dataclass")
  unknown = set(needs) - set(NEED_FIELDS)
  if unknown:
    raise ValueError(f"loss {name!r} declares unknown needs {sorted(unknown)}; known: {sorted(NEED_FIELDS)}")
  if "state" in needs and init_state is None:
    raise ValueError(f"loss {name!r} needs 'state' but gives no init_state")
  spec = LossSpec(name, fn, Hparams, frozenset(needs), init_state, run_defaults)
  _REGISTRY[name] = spec
  return spec


def unregister(name: str) -> None:
  """Removes a loss (notebooks re-running a cell that registers a prototype)."""
  _REGISTRY.pop(name, None)


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str) -> LossSpec:
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(f"unknown loss {name!r}; valid names: {', '.join(names())}") from None


def missing_needs(spec: LossSpec, available: set[str] | frozenset[str]) -> list[str]:
  """Needs of `spec` that a run providing `available` need names cannot satisfy."""
  return sorted(set(spec.needs) - set(available))


def micro_batching_error(spec: LossSpec, grad_accum) -> str | None:
  """Why `optim.grad_accum=grad_accum` cannot run loss `spec` (None when it can): the one rule, read by config
  validation and by the learner. Micro-batches are scanned, so a count must be an int >= 1, and a loss that
  carries state across steps needs whole-batch statistics."""
  if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
    return "must be an int >= 1"
  if grad_accum > 1 and spec.init_state is not None:
    return f"loss {spec.name!r} carries state across steps and needs whole-batch statistics; use grad_accum=1"
  return None


def check_needs(spec: LossSpec, inputs: LossInputs) -> None:
  """The shared entry check of every loss call (`spec.fn(inputs, hp)` follows it in the learner).

  Raises ValueError naming every declared need whose fields (or their `NEED_ALTERNATIVES`) are absent
  (None), then checks the shapes of the fields present (`check_shapes`).
  """
  has = lambda fields: bool(fields) and all(getattr(inputs, f) is not None for f in fields)
  absent = [n for n in sorted(spec.needs)
            if NEED_FIELDS[n] and not (has(NEED_FIELDS[n]) or has(NEED_ALTERNATIVES.get(n, ())))]
  if absent:
    fields = [f for n in absent for f in NEED_FIELDS[n] + NEED_ALTERNATIVES.get(n, ())]
    raise ValueError(f"loss {spec.name!r} needs {absent} but LossInputs lacks {fields}")
  check_shapes(inputs)


# Shape contract of `LossInputs` (see `check_shapes`); the dimension key is in `jaxrl_llm.types`.
# [B, N] fields over the response positions; the first three are always present.
BN_FIELDS = ("logp_BN", "mask_BN", "adv_BN", "prox_logp_BN", "behavior_logp_BN", "ref_logp_BN", "entropy_BN",
             "versions_BN", "turn_BN", "teacher_logp_BN", "tokens_BN", "eviction_mask_BN",
             "shadow_logp_BN")
B_FIELDS = ("lag_B", "sup_drift_B")
# [B, N, k] groups: top-k ids first, then the log-probs at those ids (the same k).
BNK_GROUPS = (("behavior_topk_ids_BNk", "behavior_topk_logp_BNk", "topk_logp_BNk"),
              ("teacher_topk_ids_BNk", "teacher_topk_logp_BNk", "student_topk_logp_BNk", "teacher_ref_topk_logp_BNk"))
BNJ_FIELDS = ("mc_ids_BNJ", "mc_logp_BNJ", "mc_behavior_logp_BNJ", "mc_teacher_logp_BNJ")
BNV_FIELDS = ("student_logits_BNV", "teacher_logits_BNV")
HEAD_FIELDS = ("student_head", "teacher_head", "shadow_head")  # `vocab_chunks.VocabHead`: hidden_BND [B, N, D], w_DV [D, V]


def _assert(name: str, x, expected: str, assertion: Callable[..., None], *args) -> None:
  """Runs a chex assertion on `x`; a failure becomes a ValueError naming the `LossInputs` field."""
  try:
    assertion(x, *args)
  except AssertionError as e:
    raise ValueError(f"LossInputs.{name} has shape {tuple(np.shape(x))}, expected {expected} ({e})") from None


def check_shapes(inputs: LossInputs) -> None:
  """Checks the shapes of the `LossInputs` fields present (None fields are skipped) with chex.

  Static shapes only, so under `jax.jit` it runs once at trace time and costs nothing per step:
  `logp_BN` is [B, N] and every other [B, N] field (`BN_FIELDS`) has its shape; `lag_B` and
  `sup_drift_B` are [B]; each top-k group (`BNK_GROUPS`) is [B, N, k] with one k for its ids and
  log-probs; the Monte-Carlo fields [B, N, J] with one J; dense logits [B, N, V] with one V; a
  `VocabHead`'s hidden states [B, N, D] and lm-head [D, V]; `current_version` a scalar.
  Raises ValueError naming the first field that breaks it.
  """
  get = lambda name: getattr(inputs, name)
  logp = inputs.logp_BN
  _assert("logp_BN", logp, "[B, N] (rank 2)", chex.assert_rank, 2)
  B, N = np.shape(logp)
  for name in BN_FIELDS[1:]:
    if get(name) is not None:
      _assert(name, get(name), f"[B, N] = {(B, N)} like logp_BN", chex.assert_shape, (B, N))
  for name in B_FIELDS:
    if get(name) is not None:
      _assert(name, get(name), f"[B] = {(B,)} like logp_BN's rows", chex.assert_shape, (B,))
  if inputs.current_version is not None:
    _assert("current_version", inputs.current_version, "a scalar", chex.assert_rank, 0)
  for group, last in [(g, "k") for g in BNK_GROUPS] + [(BNJ_FIELDS, "J"), (BNV_FIELDS, "V")]:
    size, first = None, None
    for name in group:
      x = get(name)
      if x is None:
        continue
      _assert(name, x, f"[B, N, {last}] with [B, N] = {(B, N)}", chex.assert_shape, (B, N, None))
      if size is None:
        size, first = np.shape(x)[-1], name
      else:
        _assert(name, x, f"[B, N, {last}] = {(B, N, size)} like {first}", chex.assert_shape, (B, N, size))
  for name in HEAD_FIELDS:
    head = get(name)
    if head is not None:
      _assert(f"{name}.hidden_BND", head.hidden_BND, f"[B, N, D] with [B, N] = {(B, N)}", chex.assert_shape,
              (B, N, None))
      D = np.shape(head.hidden_BND)[-1]
      _assert(f"{name}.w_DV", head.w_DV, f"[D, V] with D = {D} like {name}.hidden_BND", chex.assert_shape, (D, None))


def run_hparams(c) -> dict:
  """The hyper-parameter overrides of run config `c`: `c.loss.hparams` over the loss's run-derived defaults."""
  spec = get(c.loss.name)
  return {**(spec.run_defaults(c) if spec.run_defaults else {}), **dict(c.loss.hparams)}


def make_hparams(spec: LossSpec, overrides: dict | None = None):
  """Builds `spec.Hparams` from overrides, naming any unknown field."""
  overrides = dict(overrides or {})
  valid = {f.name for f in dataclasses.fields(spec.Hparams)}
  bad = sorted(set(overrides) - valid)
  if bad:
    raise ValueError(f"loss.hparams.{bad[0]}: not a hyper-parameter of {spec.name!r}; valid: {sorted(valid)}")
  return spec.Hparams(**overrides)
