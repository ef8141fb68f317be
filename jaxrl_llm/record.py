"""The rollout record: the one form a batch takes from the sampler to the loss.

A `Rollout` holds B rows (sequences) as arrays that all lead with B (letters: `jaxrl_llm.types`):
T = P + N positions of a whole sequence (left-padded prompt, then response), N response positions.
The sampler fills the token ids, the loss mask, μ's log-probs and each token's version; scoring adds
rewards; the batch source adds lags (and, under replay, advantage weights); the loop adds advantages,
π_old and the teacher's outputs (`extra`); the learner adds the reference log-probs inside its step.
Every stage returns a new record (`replace`), so what a stage added is visible by name.

A multi-turn episode is the same record: its response positions hold the policy's turns and the
environment's tokens in order; `mask_BN` is 1 on the policy's tokens only (environment tokens are
context: no loss, no gradient), `env_mask_BN` marks the environment's, `turn_BN` numbers the turns.

`stats` is host-side bookkeeping about how the rows came to be (reward errors, sampler time, request
ids, buffer counters); it is not a pytree node and never enters a compiled step: the loop hands the
learner `record.replace(stats=None)`. Groups (the G rows of one prompt) are records too; `concat`
joins them and `rows` cuts them out again. `to_plain` / `from_plain` turn a record into plain data
for a checkpoint (nothing is ever unpickled).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np
from flax import struct

Array = Any  # numpy on the host, jax.Array on devices: the record moves between them unchanged


@struct.dataclass
class Rollout:
  """B rows from the sampler (or an environment) on their way to the loss (module docstring)."""

  sequence_BT: Array  # int32 token ids: left-padded prompt, then response
  positions_BT: Array  # int32 position ids
  segment_ids_BT: Array  # int32, 1 on real tokens, 0 on padding
  mask_BN: Array  # float32, 1 on response tokens that count in the loss (policy tokens, EOS included)
  behavior_logp_BN: Array  # float32 log μ of each sampled token (what the sampler drew from)
  versions_BN: Array  # int32 parameter version that generated each token
  reward_B: Optional[Array] = None  # float32 reward of each row (scoring)
  lag_B: Optional[Array] = None  # int32 learner version − the row's oldest generating version (batch source)
  group_B: Optional[Array] = None  # int32 id of the prompt group of each row (rows of a group are adjacent)
  request_B: Optional[Array] = None  # int64 async request id of each row (decides prompt and sampling key)
  adv_weight_B: Optional[Array] = None  # float32 advantage multiplier (replay's down-weighted stale groups)
  adv_BN: Optional[Array] = None  # float32 advantage of each token (the loop, from rewards)
  prox_logp_BN: Optional[Array] = None  # float32 log π_old; None in the learner: the current parameters
  ref_logp_BN: Optional[Array] = None  # float32 log π_ref (scored inside the learner step)
  routes_BTLk: Optional[Array] = None  # int32 MoE expert ids the sampler routed every fed token to (R3)
  behavior_topk_ids_BNk: Optional[Array] = None  # int32 μ's top-k ids at each response position (sampler.behavior_topk)
  behavior_topk_logp_BNk: Optional[Array] = None  # float32 log μ of those ids
  mc_ids_BNJ: Optional[Array] = None  # int32 J Monte-Carlo candidates per position: the sampled token, J-1 draws from μ
  mc_behavior_logp_BNJ: Optional[Array] = None  # float32 log μ of those candidates (`sampling.behavior`)
  turn_BN: Optional[Array] = None  # int32 turn index of each response token (multi-turn episodes)
  turn_reward_BK: Optional[Array] = None  # float32 step reward of each of K = env.max_turns turns (episodes)
  env_mask_BN: Optional[Array] = None  # float32 1 on tokens an environment inserted (multi-turn episodes)
  kv_window_B2: Optional[Array] = None  # int32 (sinks, window) of a sinks + window sampler KV cache: what each token saw
  pack: Optional[Any] = None  # `packing.Packing` of the learner's batch (`optim.pack_width`); never on the host record
  extra: Optional[dict] = None  # further loss inputs fixed at rollout time, by `LossInputs` field name (teachers)
  stats: Optional[dict] = struct.field(pytree_node=False, default=None)  # host bookkeeping (module docstring)

  @property
  def num_rows(self) -> int:
    return self.mask_BN.shape[0]

  def arrays(self) -> dict:
    """The non-None array fields by name (`extra` and `stats` excluded)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in ("extra", "stats", "pack") and getattr(self, f.name) is not None}

  def stat(self, name: str, default=0):
    return (self.stats or {}).get(name, default)

  def learner_view(self) -> "Rollout":
    """This record without the fields the learner's step does not read (rewards, turn rewards, group and request
    ids, advantage weights: advantages already hold them; stats: host data that must not enter a compiled step)."""
    return self.replace(reward_B=None, group_B=None, request_B=None, adv_weight_B=None, turn_reward_BK=None,
                        stats=None)

  def with_stats(self, **kw) -> "Rollout":
    """A copy whose stats are updated with `kw`."""
    return self.replace(stats={**(self.stats or {}), **kw})


def rows(r: Rollout, start: int, stop: int) -> Rollout:
  """Rows start..stop-1 as a new record (numpy copies: the caller owns them); stats are not carried."""
  cut = jax.tree.map(lambda x: np.array(x[start:stop]), r.replace(stats=None))
  return cut


def sampler_metrics(r: Rollout) -> dict:
  """What the record says about the sampler features that made it, each present only when its field is:
  `mu_topk_mass` (μ's mass on its recorded top-k, mean over the trained tokens), `mu_mc_hit` (the share of the J-1
  Monte-Carlo draws equal to the sampled token: an unbiased estimate of the mean μ of the sampled tokens),
  `kv_window` (the mean sinks + window a token of a window cache could see) and `routes_replayed` (1: the sampler's
  MoE routes reach the learner, which replays them)."""
  mask_BN = np.asarray(r.mask_BN, np.float32)
  mean = lambda x_BN: float((x_BN * mask_BN).sum() / max(mask_BN.sum(), 1.0))
  out = {}
  if r.behavior_topk_logp_BNk is not None:
    out["mu_topk_mass"] = mean(np.exp(np.asarray(r.behavior_topk_logp_BNk, np.float64)).sum(-1))
  if r.mc_ids_BNJ is not None and np.shape(r.mc_ids_BNJ)[-1] > 1:
    ids_BNJ = np.asarray(r.mc_ids_BNJ)
    out["mu_mc_hit"] = mean((ids_BNJ[..., 1:] == ids_BNJ[..., :1]).mean(-1))
  if r.kv_window_B2 is not None:
    out["kv_window"] = float(np.asarray(r.kv_window_B2).sum(-1).mean())
  if r.routes_BTLk is not None:
    out["routes_replayed"] = 1
  return out


def concat(records: list[Rollout], stats: dict | None = None) -> Rollout:
  """The rows of `records` in order. An optional field is kept only when every record has it."""
  fields = [f.name for f in dataclasses.fields(Rollout) if f.name not in ("extra", "stats", "pack")]
  out = {}
  for name in fields:
    vals = [getattr(r, name) for r in records]
    if all(v is not None for v in vals):
      out[name] = np.concatenate([np.asarray(v) for v in vals], axis=0)
  if all(r.extra is not None for r in records) and records[0].extra:
    out["extra"] = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs], 0), *[r.extra for r in records])
  return Rollout(**out, stats=stats)


def to_plain(r: Rollout) -> dict:
  """The record as plain data (field name -> numpy array, plus `stats`), for a checkpoint. Host arrays in
  `extra` (rollout data, e.g. episodes' eviction layout, `rollout.evict`) are kept as "extra.<name>"; teacher
  outputs (device arrays, `VocabHead`s) are not: they are recomputed."""
  if r.extra and not all(isinstance(v, np.ndarray) for v in r.extra.values()):
    raise ValueError("a record with teacher outputs (extra) is not checkpointed: they are recomputed")
  return {**{k: np.asarray(v) for k, v in r.arrays().items()},
          **{f"extra.{k}": v for k, v in (r.extra or {}).items()}, **({"stats": dict(r.stats)} if r.stats else {})}


# Array names of checkpoints written before the record: async groups (`_G*`) and their extra fields.
_LEGACY = {"sequence_GT": "sequence_BT", "positions_GT": "positions_BT", "segment_ids_GT": "segment_ids_BT",
           "mask_GN": "mask_BN", "behavior_logp_GN": "behavior_logp_BN", "versions_GN": "versions_BN",
           "reward_G": "reward_B", "routes_GTLk": "routes_BTLk", "prox_logp_GN": "prox_logp_BN"}


def from_plain(d: dict) -> Rollout:
  """Inverse of `to_plain` (also reads the field names of checkpoints written before the record)."""
  names = {f.name for f in dataclasses.fields(Rollout)} - {"extra", "stats"}
  kw, extra = {}, {}
  for k, v in d.items():
    k = _LEGACY.get(k, k)
    if k in names and v is not None:
      kw[k] = np.asarray(v)
    elif k.startswith("extra.") and v is not None:
      extra[k[len("extra."):]] = np.asarray(v)
  return Rollout(**kw, extra=extra or None, stats=dict(d["stats"]) if d.get("stats") else None)
