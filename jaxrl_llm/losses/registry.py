"""Name -> (fn, Hparams, needs) registry for policy and distillation losses.

A loss is `fn(inputs: LossInputs, hp: Hparams) -> (loss_BT, aux)`: pure, jittable, per-token loss
already multiplied by the loss mask (aggregation happens once, in `reduce`). `aux` is a dict whose
entries are metrics as `(sum, count)` pairs, except two reserved keys:
  - "keep_BT": the mask after the loss's own rejection/masking (used by `reduce` when rejected tokens
    leave the denominator);
  - "state": the loss's carried state for the next step (e.g. R²VPO's dual variable).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from jaxrl_llm.types import LossInputs

# Need name -> the LossInputs fields it requires.
NEED_FIELDS: dict[str, tuple[str, ...]] = {
    "prox_logp": ("prox_logp_BT",),
    "behavior_logp": ("behavior_logp_BT",),
    "ref_logp": ("ref_logp_BT",),
    "entropy": ("entropy_BT",),
    "versions": ("versions_BT", "current_version"),
    "lag": ("lag_B",),
    "behavior_topk": ("behavior_topk_ids_BTK", "behavior_topk_logp_BTK", "topk_logp_BTK"),
    "turn": ("turn_BT",),
    "teacher_logp": ("teacher_logp_BT",),
    "teacher_topk": ("teacher_topk_ids_BTK", "teacher_topk_logp_BTK"),
    "state": ("state",),
    "tokens": ("tokens_BT",),
    # Not an input field: the learner computes logp_BT with the ALP perturbed forward and trains the
    # per-layer log σ (`hp.perturb_std`, `hp.perturb_lr`) alongside the model (see learner.py).
    "perturb": (),
    "student_logits": ("student_logits_BTV",),
    "teacher_logits": ("teacher_logits_BTV",),
    "student_topk": ("student_topk_logp_BTK",),
    "teacher_ref_topk": ("teacher_ref_topk_logp_BTK",),
    "mc": ("mc_ids_BTN", "mc_logp_BTN", "mc_behavior_logp_BTN", "mc_teacher_logp_BTN"),
    "sup_drift": ("sup_drift_B",),
    "eviction": ("eviction_mask_BT",),
}
# Needs that another set of fields satisfies as well: full distributions as dense [B, T, V] logits or as
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

  @property
  def doc(self) -> str:
    return (self.fn.__doc__ or "").strip()


_REGISTRY: dict[str, LossSpec] = {}


def register(name: str, fn, Hparams: type, needs=(), init_state=None) -> LossSpec:
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
  spec = LossSpec(name, fn, Hparams, frozenset(needs), init_state)
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


def check_needs(spec: LossSpec, inputs: LossInputs) -> None:
  """Raises ValueError naming every declared need whose fields (or their `NEED_ALTERNATIVES`) are absent (None)."""
  has = lambda fields: bool(fields) and all(getattr(inputs, f) is not None for f in fields)
  absent = [n for n in sorted(spec.needs)
            if NEED_FIELDS[n] and not (has(NEED_FIELDS[n]) or has(NEED_ALTERNATIVES.get(n, ())))]
  if absent:
    fields = [f for n in absent for f in NEED_FIELDS[n] + NEED_ALTERNATIVES.get(n, ())]
    raise ValueError(f"loss {spec.name!r} needs {absent} but LossInputs lacks {fields}")


def make_hparams(spec: LossSpec, overrides: dict | None = None):
  """Builds `spec.Hparams` from overrides, naming any unknown field."""
  overrides = dict(overrides or {})
  valid = {f.name for f in dataclasses.fields(spec.Hparams)}
  bad = sorted(set(overrides) - valid)
  if bad:
    raise ValueError(f"loss.hparams.{bad[0]}: not a hyper-parameter of {spec.name!r}; valid: {sorted(valid)}")
  return spec.Hparams(**overrides)
