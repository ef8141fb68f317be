"""ADWIN (arXiv 2605.28396, spec A5): adaptive prefix horizon for OPD, audited by delayed full-rollout probes.

[GUESS] reconstruction: only the abstract is public (addendum §8.2). The rule implemented here:
  - train on the first H response tokens of each rollout (`prefix_mask`), optionally cut earlier at the
    first token whose reverse KL to the teacher exceeds a threshold (`teacher_anchored_length`);
  - every `probe_period` steps launch full-length probe rollouts; when one returns, measure how well the
    prefix update agrees with the full one (`cosine_alignment` of update directions, or the cheap proxy
    `kl_mass_alignment`, the share of the full rollout's OPD loss inside the first H tokens);
  - agreement ≥ τ: the prefix suffices, shrink H ← H·γ_down; otherwise grow H ← H·γ_up; H stays in
    [H_min, H_max] (rounded, and moved by at least one token unless at a bound);
  - staleness control: a probe generated more than `max_probe_age` versions ago changes nothing.
State is an explicit `AdwinState`; every function is pure.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class AdwinConfig:
  h_init: int = 512
  h_min: int = 64
  h_max: int = 8192
  gamma_down: float = 0.8  # < 1
  gamma_up: float = 1.5  # > 1
  tau: float = 0.8  # agreement threshold
  probe_period: int = 10  # steps between probe launches
  max_probe_age: int = 4  # versions


class AdwinState(NamedTuple):
  horizon: int
  last_probe_step: int


def init_state(cfg: AdwinConfig) -> AdwinState:
  return AdwinState(min(max(cfg.h_init, cfg.h_min), cfg.h_max), -cfg.probe_period)


def should_probe(state: AdwinState, step: int, cfg: AdwinConfig) -> bool:
  return step - state.last_probe_step >= cfg.probe_period


def mark_probe(state: AdwinState, step: int) -> AdwinState:
  return state._replace(last_probe_step=step)


def update_horizon(state: AdwinState, agreement: float, probe_version: int, current_version: int,
                   cfg: AdwinConfig) -> AdwinState:
  """Next horizon from one probe's agreement; stale probes (age > max_probe_age) are ignored."""
  if current_version - probe_version > cfg.max_probe_age:
    return state
  h = state.horizon
  if agreement >= cfg.tau:
    new = min(math.floor(h * cfg.gamma_down), h - 1)
  else:
    new = max(math.ceil(h * cfg.gamma_up), h + 1)
  return state._replace(horizon=int(min(max(new, cfg.h_min), cfg.h_max)))


def prefix_mask(mask_BN: Array, horizon_B) -> Array:
  """The mask restricted to the first `horizon` counted tokens of each row (works with left padding)."""
  m = mask_BN > 0
  rank = jnp.cumsum(m, axis=-1)
  return (m & (rank <= jnp.broadcast_to(jnp.asarray(horizon_B), (mask_BN.shape[0],))[:, None])).astype(mask_BN.dtype)


def teacher_anchored_length(rkl_BN: Array, mask_BN: Array, threshold: float, horizon: int) -> Array:
  """Per row, counted tokens up to and including the first whose reverse KL exceeds `threshold`, capped at H."""
  m = mask_BN > 0
  rank = jnp.cumsum(m, axis=-1)
  hit = m & (rkl_BN > threshold)
  first = jnp.min(jnp.where(hit, rank, jnp.iinfo(jnp.int32).max), axis=-1)
  return jnp.minimum(jnp.minimum(first, m.sum(-1)), horizon)


def kl_mass_alignment(loss_BN: Array, mask_BN: Array, horizon_B) -> Array:
  """Share of the full rollouts' OPD loss mass (|ℓ|) inside the first H tokens; 1 for an empty mask."""
  a = jnp.where(mask_BN > 0, jnp.abs(loss_BN), 0.0)
  inside = jnp.where(prefix_mask(mask_BN, horizon_B) > 0, a, 0.0).sum()
  total = a.sum()
  return jnp.where(total > 0, inside / jnp.where(total > 0, total, 1.0), 1.0)


def cosine_alignment(g_pref, g_full) -> Array:
  """cos(g_pref, g_full) over whole pytrees (flattened); 0 if either is zero."""
  leaves = lambda g: jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree_util.tree_leaves(g)])
  a, b = leaves(g_pref), leaves(g_full)
  den = jnp.linalg.norm(a) * jnp.linalg.norm(b)
  return jnp.where(den > 0, jnp.dot(a, b) / jnp.where(den > 0, den, 1.0), 0.0)
