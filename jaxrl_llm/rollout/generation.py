"""Generating and scoring completions: the one home every batch source and the async workers use.

`Generation` holds the static wiring (task, prompts, encoder, sampler settings, reward policy, key root)
and turns a pinned snapshot's parameters plus prompts into a `Rollout` record:
`sample` runs the sampler (on a mesh: split over its batch axes and every process), `finish` scores the
completions (each row once, by the process that generated it) and packs the record. The async workers
generate their own way (partial rollouts switch parameters mid-sequence) and call `finish` too.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import multiprocess, sharding
from jaxrl_llm.keys import fold_in
from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout import collect
from jaxrl_llm.sampling import behavior, continuous, generate
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder
from jaxrl_llm.tasks.reward import RewardPolicy

SPEC_STATS = ("spec_accept_rate", "spec_tokens_per_call")  # speculative decoding's metrics (`sampling.speculative`)
# a sampler call's settings chosen per call: the γ of a `speculative.GammaTuner`, a `TokenBudget`'s cap; the cache
# format it decoded from (`cache.kv_bits`, read off the cache's arrays: what shows a compressed cache is on); and a
# partial rollout's chunk boundaries at which it asked for newer parameters (`partial.generate_partial`)
CALL_STATS = ("spec_gamma", "gen_max_new_tokens", "gen_kv_bits", "gen_partial_polls")
RATE_STATS = SPEC_STATS + CALL_STATS  # per-call values: several calls report their mean (counts are summed)
# continuous batching's counters of a sampler call (`sampling.continuous`): slot-steps run, and those that decoded
# an unfinished request (1 - live / run: the share spent on free or finished slots)
SLOT_STATS = {"slot_steps": "slot_steps", "live_steps": "slot_live_steps"}
SAMPLER_STATS = RATE_STATS + tuple(SLOT_STATS.values())  # what a sampler call reports beyond its rows


def join_shares(shares: list[dict]) -> dict:
  """Sampler outputs of consecutive row shares (one per process) as one: arrays concatenated along their rows,
  counters (slot-steps, speculative calls) summed, speculative rates averaged weighted by each share's calls, per-call
  settings (`CALL_STATS`) averaged."""
  calls = [float(s.get("spec_calls", 0)) for s in shares]
  out = {}
  for k, v in shares[0].items():
    vals = [s[k] for s in shares]
    if isinstance(v, np.ndarray) and v.ndim:
      out[k] = np.concatenate(vals)
    elif k in SPEC_STATS:
      out[k] = float(np.average(vals, weights=calls)) if sum(calls) else float(np.mean(vals))
    elif k in CALL_STATS:
      out[k] = float(np.mean(vals))
    else:
      out[k] = sum(vals)
  return out


def slot_layout(mesh, slots: int) -> continuous.SlotLayout | None:
  """The slot engine's layout on `mesh` (None: one device): its slot axis split over the sampler's batch axes
  (`sharding.SAMPLER`: data, fsdp, expert), as a static batch's rows are; a slot count they do not divide keeps
  the longest dividing prefix of them (`sharding.logical_to_spec`)."""
  if mesh is None:
    return None
  entry = sharding.logical_to_spec(("batch",), (slots,), mesh, sharding.SAMPLER)[0]
  return continuous.SlotLayout(mesh, () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))


@functools.partial(jax.jit, static_argnums=1)
def request_keys(key, n: int):
  """One sampling key per request: request r draws its column t with `fold_in(fold_in(key, r), t)`, so its tokens
  do not depend on where it is decoded (continuous batching, `sampling.continuous`)."""
  return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(n))


class DrafterSlot:
  """Where the sampler reads the speculative drafter's current parameters (`sampler.spec_drafter="distilled"` or
  "head", `distill.drafter`): the loop sets `params` at the start and after every distillation step; None: the policy's
  first `spec_draft_layers` layers draft (a view of the snapshot being sampled)."""

  def __init__(self, params=None):
    self.params = params


class TokenBudget:
  """A cap on the new tokens of the next static sampler calls (`Generation.sample`), set by the loop before each
  batch from the batch extras' plan (`DistillExtras.generation_budget`: ADWIN's horizon, None on its full-length
  probe steps); None = the sampler's own `max_new_tokens`."""

  def __init__(self):
    self.max_new_tokens: int | None = None


def budget_bucket(n: int, N: int) -> int:
  """The new tokens a call generates for a cap of n (≤ N): the next power of two, at most N (few compiled shapes)."""
  return min(N, 1 << max(0, int(n) - 1).bit_length())


def pad_response(out: dict, N: int, pad_id: int) -> dict:
  """A sampler output of n < N response columns laid out as one of N: the missing columns are what a row that
  stopped before them holds (pad ids, mask 0, log-probs 0, segment 0, positions counting on)."""
  n = np.asarray(out["tokens_BN"]).shape[1]
  if n >= N:
    return out
  res = {}
  for k, v in out.items():
    v = np.asarray(v) if hasattr(v, "shape") else v
    if not hasattr(v, "shape") or v.ndim < 2 or k in ("kv_window_B2",):
      res[k] = v
      continue
    width = [(0, 0)] * v.ndim
    width[1] = (0, N - n)
    if k == "positions_BT":
      last = v[:, -1:]
      res[k] = np.concatenate([v, last + np.arange(1, N - n + 1, dtype=v.dtype)[None, :]], axis=1)
    else:
      fill = pad_id if k in ("tokens_BN", "sequence_BT") or k.endswith(("ids_BNk", "ids_BNJ")) else 0
      res[k] = np.pad(v, width, constant_values=fill)
  return res


@dataclasses.dataclass(frozen=True)
class Generation:
  """The static wiring of generation (references only).

  `train_examples`: the prompts' examples; `width`: the prompt bucket P; `model_cfg`: the sampler's model
  config (its dtype); `key_root`: the root of every sampling key; `keep_routes`: an MoE sampler's expert
  ids travel with the record (routing replay, R3); `mesh`: None (one device) or the sampler's mesh;
  `slots` > 0: `sample` decodes with continuous batching (`sampling.continuous`, `slot_chunk` steps per chunk);
  `drafter`: None, or the slot holding a distilled speculative drafter's parameters (`DrafterSlot`).
  """
  task: Any
  train_examples: Any
  width: int
  model_cfg: Any
  sampler_cfg: Any
  key_root: Any
  seed: int
  encoder: Encoder = CHAR_ENCODER
  reward: RewardPolicy = RewardPolicy()
  keep_routes: bool = False
  mesh: Any = None
  slots: int = 0
  slot_chunk: int = 8
  drafter: DrafterSlot | None = None
  gamma_tuner: Any = None  # `sampler.spec_gamma="auto"`: `speculative.GammaTuner`, γ per call from measured cost
  budget: TokenBudget | None = None  # a cap on the new tokens of `sample`'s calls (ADWIN's horizon)

  def step_prompts(self, steps: list[int], n: int, group_size: int, call: int = 0) -> collect.Prompts:
    """The prompts of learner steps `steps` (n each, a pure function of (seed, step, call)), each
    repeated `group_size` times in a row (a group)."""
    ps = [collect.prompts_for_step(self.train_examples, t, n, self.seed, self.width, call, self.encoder) for t in steps]
    return collect.Prompts(np.repeat(np.concatenate([q.tokens_BP for q in ps]), group_size, 0),
                           np.repeat(np.concatenate([q.len_B for q in ps]), group_size),
                           [ex for q in ps for ex in q.examples for _ in range(group_size)])

  def step_key(self, version: int, step: int, call: int = 0):
    """Sampling key of a learner step's sampler call: (root, generating version, step[, call])."""
    key = fold_in(fold_in(self.key_root, version), step)
    return fold_in(key, call) if call else key

  def sample(self, params, prompts: collect.Prompts, key) -> tuple[dict, np.ndarray | None]:
    """(sampler output as host arrays, row owners or None): `sampling.generate` on the mesh, if any (drafting with
    the `drafter` slot's parameters when set); with `slots` > 0 the slot engine (`_sample_slots`: one per process),
    request r drawing with `fold_in(key, r)` (`request_keys`)."""
    if self.slots:
      return self._sample_slots(params, prompts, key)
    cfg, extra, N = self.sampler_cfg, {}, self.sampler_cfg.max_new_tokens
    cap = self.budget.max_new_tokens if self.budget is not None else None
    if cap is not None and cap < N:  # fewer new tokens (ADWIN: nothing past the horizon is trained on)
      cfg = dataclasses.replace(cfg, max_new_tokens=budget_bucket(cap, N))
      extra["gen_max_new_tokens"] = cfg.max_new_tokens
    tune = self.gamma_tuner is not None and cfg.spec_gamma == "auto"
    if tune:  # ReSpec's adaptive γ: the tuner picks this call's γ and learns from its seconds per emitted token
      B = len(prompts.len_B)
      cfg = dataclasses.replace(cfg, spec_gamma=self.gamma_tuner.choose(B))
      extra["spec_gamma"] = cfg.spec_gamma
    t0 = time.perf_counter()
    out, owners = multiprocess.generate_on_mesh(self.generate_fn(), params, prompts.tokens_BP, prompts.len_B, key,
                                                self.model_cfg, cfg, self.mesh)  # numpy in: no eager put
    if tune:
      self.gamma_tuner.observe(B, cfg.spec_gamma, time.perf_counter() - t0, float(np.asarray(out["mask_BN"]).sum()))
    if cfg.max_new_tokens < N:
      out = pad_response(out, N, cfg.pad_id)
    return ({**out, **extra} if extra else out), owners

  def _sample_slots(self, params, prompts: collect.Prompts, key) -> tuple[dict, np.ndarray | None]:
    """`sample` with the slot engine. Several processes: each runs its engine over an equal, contiguous share of
    the rows on its own replica (`params` as the store's view gives them), request r still drawing with
    `fold_in(key, r)`, so the tokens do not depend on the process count; the shares are all-gathered in process
    order and every row is owned (scored) by the process that decoded it."""
    B = len(prompts.len_B)
    keys = request_keys(key, B)
    rows = multiprocess.my_rows(B) if multiprocess.multi() else np.arange(B)
    out = continuous.generate_slots(params, prompts.tokens_BP[rows], prompts.len_B[rows], keys[rows], self.model_cfg,
                                    self.sampler_cfg, slots=self.slots, chunk=self.slot_chunk,
                                    draft_params=self.draft_params(), layout=self.slot_layout())
    out = {SLOT_STATS.get(k, k): v for k, v in out.items()}
    if not multiprocess.multi():
      return out, None
    n_proc = jax.process_count()
    return join_shares(multiprocess.allgather_host(out)), np.repeat(np.arange(n_proc), B // n_proc)

  def slot_layout(self) -> continuous.SlotLayout | None:
    """Where a slot engine's slots live (`continuous.SlotEngine`): split over the sampler's mesh with one process
    (`slot_layout`); None with several, each decoding its share of the rows on a replica of its own."""
    return None if multiprocess.multi() else slot_layout(self.mesh, self.slots)

  def draft_params(self):
    """The distilled drafter's newest parameters when the `drafter` slot holds them, else None (the slot engine
    then drafts with the policy's first `spec_draft_layers` layers)."""
    return self.drafter.params if self.drafter is not None else None

  def generate_fn(self):
    """`sampling.generate`, drafting with the distilled drafter's newest parameters when the `drafter` slot holds
    them (they change speed, never μ); every static sampler call of a run goes through it."""
    d = self.draft_params()
    return generate if d is None else functools.partial(generate, draft_params=d)

  def finish(self, out: dict, examples: list[dict], versions_BN: np.ndarray, owners: np.ndarray | None = None,
             **stats) -> Rollout:
    """The record of sampled completions: rewards scored (each row once, by the process that owns it;
    a reward that raises or hangs costs that sample), μ's log-probs, per-token versions, routes when kept,
    μ's top-k and Monte-Carlo candidates when the sampler recorded them.
    `stats` (host bookkeeping) is added to the record's, with the number of failed reward calls, speculative
    decoding's metrics (`SPEC_STATS`) when the sampler speculated and the slot counters with continuous batching."""
    reward_B, status = multiprocess.score_rows(
        lambda ex, t: collect.score_completions(self.task, ex, t, self.reward, tokenizer=self.encoder.tokenizer)[:2],
        examples, out["tokens_BN"], owners)
    routes = out.get("routes_BTLk") if self.keep_routes else None
    # μ's top-k and Monte-Carlo candidates, when the sampler records them (`sampling.behavior`)
    recorded = {k: out[k] for k in behavior.TOPK_FIELDS + behavior.MC_FIELDS if out.get(k) is not None}
    if out.get("kv_window_B2") is not None:  # a sinks + window KV cache: what each token could see (SMD)
      recorded["kv_window_B2"] = out["kv_window_B2"]
    return Rollout(sequence_BT=out["sequence_BT"], positions_BT=out["positions_BT"],
                   segment_ids_BT=out["segment_ids_BT"], mask_BN=out["mask_BN"],
                   behavior_logp_BN=out["behavior_logp_BN"], versions_BN=np.asarray(versions_BN, np.int32),
                   reward_B=np.asarray(reward_B, np.float32), routes_BTLk=routes, **recorded,
                   stats={"reward_errors": int(status.get("error", 0) + status.get("timeout", 0)),
                          **{k: float(out[k]) for k in SAMPLER_STATS if k in out}, **stats})
