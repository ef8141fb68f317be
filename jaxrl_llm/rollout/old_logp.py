"""π_old, the proximal policy of the importance ratio: one strategy per `rollout.old_logp` name.

  recompute   exact: each token scored by the learner at the version that generated it (one forward
              per distinct version in the batch; partial rollouts mix versions within a sequence)
  behavior    π_old := μ (bypass)
  step_start  the parameters at the start of this learner step (before its first update)
  ewma        an EWMA copy of past parameters (Hilton's PPO-EWMA)
  a3po        A-3PO: log μ + α·(log π_step_start − log μ) with α from per-token versions

Every mode calls them the same way: `compute(name, ctx, ro, seq, routes)` with an `OldLogpContext`.
`recompute` depends only on the generating versions, so a source that drops a snapshot before its batch
is consumed (fixed_lag's queue, the replay buffer) scores it at generation time (`at_generation`) and the
async workers score their own groups (`score_at_versions`); the learner then takes the stored values.
`is_current` says when π_old is the learner's current parameters by construction: the learner then takes
sg(log π_θ) from its own forward, with no scoring pass. The names are `config.OLD_LOGP` (tested equal).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.losses.a3po import approx_prox_logp, interpolation_weight
from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout.param_store import ParamStore, Snapshot

Array = jax.Array
# score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, routes_BTLk) -> log-probs [B, N]
ScoreFn = Callable[..., Array]


@dataclasses.dataclass(frozen=True)
class OldLogpContext:
  """What a strategy may read: the learner's scorer, the snapshots, and the learner's copies at the step start."""
  score: ScoreFn
  store: ParamStore
  params: Any  # the learner's parameters at the start of this step
  version: Any  # their version (an int or a scalar array)
  ewma: Any = None  # the EWMA copy (old_logp="ewma")


Strategy = Callable[[OldLogpContext, Rollout, tuple, Any], Array]
_STRATEGIES: dict[str, Strategy] = {}


def register(name: str):
  def deco(fn: Strategy) -> Strategy:
    _STRATEGIES[name] = fn
    return fn
  return deco


def names() -> tuple[str, ...]:
  return tuple(_STRATEGIES)


def compute(name: str, ctx: OldLogpContext, ro: Rollout, seq: tuple, routes=None) -> Array:
  """log π_old [B, N] of the sampled tokens of rollout `ro` (its `mask_BN`, `versions_BN`, `behavior_logp_BN`)."""
  return _STRATEGIES[name](ctx, ro, seq, routes)


def is_current(name: str, on_policy: bool, perturbed: bool) -> bool:
  """Whether π_old is, by construction, the learner's current parameters (decided once per run).

  True for `step_start` and for `recompute` when the batch source is `on_policy` (every token generated
  by the current version: sync without replay; the recompute uses the learner-dtype copy of it). With several updates per
  step (`optim.minibatches`/`epochs`) the step scores π_old once, at its start, from these parameters.
  Not when the learner's forward is perturbed (ALP) while π_old is not.
  """
  if perturbed:
    return False
  return name == "step_start" or (name == "recompute" and on_policy)


def learner_copy(snap: Snapshot):
  return snap.learner_params if snap.learner_params is not None else snap.params


def score_at_versions(score: ScoreFn, versions_BN, mask_BN, seq: tuple, routes,
                      pinned: Callable[[int], contextlib.AbstractContextManager], default_version: int | None = None
                      ) -> Array:
  """Each token scored by the learner-dtype copy of the version that generated it: one forward per distinct
  version among the masked tokens (`default_version` when there is none; else zeros). `pinned(v)` holds
  version v's snapshot while it is scored (raises KeyError when it is gone)."""
  versions = jnp.asarray(versions_BN)
  out = jnp.zeros(np.shape(mask_BN), jnp.float32)
  used = np.unique(np.asarray(versions_BN)[np.asarray(mask_BN) > 0]).tolist()
  for v in used or ([] if default_version is None else [default_version]):
    with pinned(int(v)) as snap:
      logp = score(learner_copy(snap), *seq, jnp.asarray(mask_BN), routes)
    out = jnp.where(versions == v, logp, out)
  return out


def store_pin(store: ParamStore):
  """`pinned` over a ParamStore: acquires version v for the duration and releases it."""
  @contextlib.contextmanager
  def pinned(v: int) -> Iterator[Snapshot]:
    snap = store.acquire(v)
    try:
      yield snap
    finally:
      store.release(snap)
  return pinned


@register("recompute")
def _recompute(ctx: OldLogpContext, ro: Rollout, seq: tuple, routes) -> Array:
  return score_at_versions(ctx.score, ro.versions_BN, ro.mask_BN, seq, routes, store_pin(ctx.store),
                           default_version=ctx.store.latest_version)


@register("behavior")
def _behavior(ctx: OldLogpContext, ro: Rollout, seq: tuple, routes) -> Array:
  del ctx, seq, routes
  return jnp.asarray(ro.behavior_logp_BN)


@register("step_start")
def _step_start(ctx: OldLogpContext, ro: Rollout, seq: tuple, routes) -> Array:
  return ctx.score(ctx.params, *seq, ro.mask_BN, routes)


@register("ewma")
def _ewma(ctx: OldLogpContext, ro: Rollout, seq: tuple, routes) -> Array:
  return ctx.score(ctx.ewma, *seq, ro.mask_BN, routes)


@register("a3po")
def _a3po(ctx: OldLogpContext, ro: Rollout, seq: tuple, routes) -> Array:
  alpha = interpolation_weight(jnp.asarray(ro.versions_BN), ctx.version)
  return approx_prox_logp(ctx.score(ctx.params, *seq, ro.mask_BN, routes), jnp.asarray(ro.behavior_logp_BN),
                          alpha, ro.mask_BN)


def rollout_seq(ro: Rollout) -> tuple:
  """(sequence_BT, positions_BT, segment_ids_BT) of a rollout, as device arrays."""
  return tuple(jnp.asarray(x) for x in (ro.sequence_BT, ro.positions_BT, ro.segment_ids_BT))


def at_generation(score: ScoreFn, store: ParamStore, ro: Rollout) -> Array:
  """`recompute`'s π_old of a freshly generated rollout, while its generating snapshot is still held."""
  routes = None if ro.routes_BTLk is None else jnp.asarray(ro.routes_BTLk)
  return _recompute(OldLogpContext(score, store, None, None), ro, rollout_seq(ro), routes)
