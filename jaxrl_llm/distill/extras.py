"""Distillation options of a run's learner batch: ADWIN horizons, several teachers (Open-MOPD), the teacher cache.

`distill.opd.make_batch_extras` hands a config with any of these on to `make_batch_extras` here; with none
on, nothing here runs. The returned `DistillExtras` is called by `batch.make_batch` like the plain extras,
`extras(ro, seq, mask_BN) -> dict` of `LossInputs` fields, and may add one reserved entry, "_batch":
  mask_BN  the loss mask to train on (ADWIN: the first H counted tokens of each row, `adwin.prefix_mask`)
  adv_BN   the advantages to train on (Open-MOPD `reward_advantage`: the routed teacher's token reward
           r_t = log p_d(y_t) − log μ(y_t), times the M1 × M2 weight of its row)
  info     host metrics for the step's row (adwin_horizon, mopd_*, topk_cache_*)

Config (all off by default; a missing section is off):
  distill.adwin        ADWIN adaptive prefix horizon (`distill.adwin`, a [GUESS] reconstruction)
    enabled            False
    h_init, h_min, h_max   512, 64, 8192: horizon H in counted response tokens, its bounds
    gamma_down, gamma_up   0.8, 1.5: H ← H·γ_down when a probe agrees (≥ tau), H·γ_up otherwise
    tau                0.8: agreement threshold
    probe_period       10: learner steps between probes (the first batch is a probe)
    max_probe_age      4: a probe whose rows are more than this many versions old (max lag_B) changes nothing
    anchor_threshold   0.0 (off): > 0 also cuts each row at its first token whose sampled-token reverse KL
                       log μ(y_t) − log p(y_t) exceeds it (`adwin.teacher_anchored_length`)
    A probe is the step's own batch: rollouts are generated at full length, so the teacher's per-token
    signal |log p(y_t) − log μ(y_t)| over the full mask is there; the agreement is the cheap proxy
    `adwin.kl_mass_alignment` (share of that signal's mass inside the first H tokens). A step trains on the
    horizon in force when its batch is built (`adwin_horizon`); its probe sets the next steps' horizon. The sampler
    stops at the horizon (`generation_budget`: the loop caps the step's new tokens), except on probe steps.
  distill.teachers     Open-MOPD: a list of teacher specs (with `distill.teacher = "mopd"`), one per domain y
                       (the list index); each spec has `teacher` ("sft" | HF folder) and, for "sft",
                       `teacher_d_model`, `teacher_n_layers`, `teacher_sft_steps`; optional `seed` (the
                       teacher's init/SFT seed, default `config.seed`) and `domain` (a name, see below)
  distill.mopd         Open-MOPD budget control (`distill.mopd`)
    token_share        False: M1 token-share balancing weights
    target_share       (): target token share g* per domain; empty = uniform
    gap_follow         False: M2 gap-following factors (multiply)
    gap_stat           "mean" | "q75" | "q90" | "top10": m_d, a statistic of |r_t| over domain d's tokens
    gap_alpha          1.0: factor clip((m_d / ref_d)^α, 0.05, 20)
    gap_reference      "anchored" (ref_d = the first m_d seen) | "ema" (of the earlier steps' m_d); a domain's
                       first m_d is its own reference (factor 1)
    gap_decay          0.9: the EMA's decay
    reward_advantage   False: True trains on adv_BN = w_b · r_t (M1 × M2 weight w_b of the row), with an
                       advantage loss (`ppo_clip`: the PPO surrogate on A = log p − log μ is exactly
                       opd_reverse_kl's advantage form). M1 / M2 multiply the advantage, which the OPD
                       losses do not read, so they need it.
    Domain of a prompt (M0 routing): the training example's `domain` when it has one (an int in [0, Y) or a
    teacher spec's `domain` name), else `example_id % Y`. The example is found from the rollout's prompt
    tokens; identical prompts take the first example's domain. The tiny tasks have no domain column, so
    their domains are `example_id % Y`; a dataset that has one must keep it in its examples
    (`rollout.collect.load_split` keeps prompt / answer / example_id today).
  distill.topk_cache   the teacher's scores of a row computed once and served again (`distill.topk_cache`)
    enabled            False
    capacity           4096 rows (least recently used ones leave first)
    Rows are keyed by their content (tokens, positions, segments, loss mask) and teacher: a replayed
    group, or any row seen before, is served from the cache instead of being re-scored. Rows that are
    new are scored a group at a time (the teacher runs each group's prompt once), the missing groups
    padded to a power of two (≤ log2(groups) + 1 compiled shapes). A frozen teacher gives a row the same
    scores each time, so a cached batch equals a freshly scored one up to the rounding of the batch shape.

Carried state (horizon, probe bookkeeping, step count, M2 references): `DistillExtras.state()` /
`restore(state)`, plain data (ints, floats, None) for a checkpoint. The cache itself is not carried: a
resumed run scores the rows again.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable

import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm.distill import adwin as adwin_lib
from jaxrl_llm.distill import mopd as mopd_lib
from jaxrl_llm.distill import teacher as teacher_lib
from jaxrl_llm.distill.topk_cache import RowCache
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder

MOPD_TEACHER = "mopd"  # `distill.teacher` of a run whose teachers are `distill.teachers`
# Fields of a section with their defaults (`validate` refuses others; missing ones take these).
ADWIN_DEFAULTS = {"enabled": False, **dataclasses.asdict(adwin_lib.AdwinConfig()), "anchor_threshold": 0.0}
MOPD_DEFAULTS = {"token_share": False, "target_share": (), "gap_follow": False, "gap_stat": "mean", "gap_alpha": 1.0,
                 "gap_reference": "anchored", "gap_decay": 0.9, "reward_advantage": False}
CACHE_DEFAULTS = {"enabled": False, "capacity": 4096}
GAP_REFERENCES = ("anchored", "ema")  # `distill.mopd.gap_reference`
SPEC_FIELDS = ("teacher", "teacher_d_model", "teacher_n_layers", "teacher_sft_steps", "seed", "domain")
# Scorer outputs the cache holds (per row); `teacher_head` (full distributions) is never cached.
SCORE_FIELDS = ("teacher_logp_BN", "teacher_topk_ids_BNk", "teacher_topk_logp_BNk", "teacher_topk_residual_logp_BN")


def _section(c, name: str, defaults: dict) -> dict:
  d = c.distill.get(name)
  return {**defaults, **(dict(d) if d is not None else {})}


def adwin_options(c) -> dict:
  return _section(c, "adwin", ADWIN_DEFAULTS)


def mopd_options(c) -> dict:
  return _section(c, "mopd", MOPD_DEFAULTS)


def cache_options(c) -> dict:
  return _section(c, "topk_cache", CACHE_DEFAULTS)


def teacher_specs(c) -> list[dict]:
  """`distill.teachers` as plain dicts (empty: the single `distill.teacher`)."""
  return [dict(s) for s in (c.distill.get("teachers") or ())]


def enabled(c: ml_collections.ConfigDict) -> bool:
  """Whether any option of this module is on (else `opd.make_batch_extras` keeps its plain extras)."""
  return bool(adwin_options(c)["enabled"] or teacher_specs(c) or cache_options(c)["enabled"])


def validate(c: ml_collections.ConfigDict, fields: tuple[str, ...]) -> None:
  """Raises ConfigError naming the first invalid `distill.adwin.*`, `distill.teachers`, `distill.mopd.*` or
  `distill.topk_cache.*` field; `fields` are the `LossInputs` fields the run's loss reads from the teacher."""
  from jaxrl_llm.config import ConfigError

  def need(ok, field, value, why):
    if not ok:
      raise ConfigError(f"config.distill.{field}={value!r}: {why}")

  for name, defaults in (("adwin", ADWIN_DEFAULTS), ("mopd", MOPD_DEFAULTS), ("topk_cache", CACHE_DEFAULTS)):
    d = c.distill.get(name)
    if d is not None:
      bad = sorted(set(d) - set(defaults))
      need(not bad, f"{name}.{bad[0] if bad else ''}", d.get(bad[0]) if bad else None,
           f"not a field of distill.{name}; valid: {sorted(defaults)}")
  a = adwin_options(c)
  if a["enabled"]:
    for f in ("h_init", "h_min", "h_max", "probe_period"):
      need(isinstance(a[f], int) and a[f] >= 1, f"adwin.{f}", a[f], "must be an int >= 1")
    need(a["h_min"] <= a["h_max"], "adwin.h_max", a["h_max"], f"must be >= adwin.h_min={a['h_min']}")
    need(isinstance(a["max_probe_age"], int) and a["max_probe_age"] >= 0, "adwin.max_probe_age", a["max_probe_age"],
         "must be an int >= 0")
    need(0 < a["gamma_down"] < 1, "adwin.gamma_down", a["gamma_down"], "must be in (0, 1)")
    need(a["gamma_up"] > 1, "adwin.gamma_up", a["gamma_up"], "must be > 1")
    need(0 <= a["tau"] <= 1, "adwin.tau", a["tau"], "must be in [0, 1]")
    need(a["anchor_threshold"] >= 0, "adwin.anchor_threshold", a["anchor_threshold"], "must be >= 0 (0 = off)")
  specs, m = teacher_specs(c), mopd_options(c)
  teacher = c.distill.teacher
  if specs or teacher == MOPD_TEACHER:
    need(teacher == MOPD_TEACHER, "teacher", teacher, f"must be {MOPD_TEACHER!r} when distill.teachers is set")
    need(len(specs) >= 1, "teachers", c.distill.get("teachers"), "must list at least one teacher spec")
    names = set()
    for i, s in enumerate(specs):
      bad = sorted(set(s) - set(SPEC_FIELDS))
      need(not bad, f"teachers[{i}]", s, f"unknown field {bad[:1]}; valid: {list(SPEC_FIELDS)}")
      need(isinstance(s.get("teacher"), str) and s.get("teacher") not in ("", MOPD_TEACHER), f"teachers[{i}].teacher",
           s.get("teacher"), "must be 'sft' or a Hugging Face checkpoint folder")
      if s["teacher"] == "sft":
        for f in ("teacher_d_model", "teacher_n_layers", "teacher_sft_steps"):
          need(isinstance(s.get(f), int) and s[f] > 0, f"teachers[{i}].{f}", s.get(f), "must be a positive int")
      if s.get("seed") is not None:
        need(isinstance(s["seed"], int) and s["seed"] >= 0, f"teachers[{i}].seed", s["seed"], "must be an int >= 0")
      if s.get("domain"):
        need(s["domain"] not in names, f"teachers[{i}].domain", s["domain"], "names another teacher's domain too")
        names.add(s["domain"])
    need("teacher_head" not in fields or len(specs) == 1, "teachers", f"{len(specs)} teachers",
         "full-distribution losses read one teacher's lm-head; route them with one teacher, or use a top-k or "
         "sampled-token OPD loss")
    tgt = tuple(m["target_share"])
    need(not tgt or (len(tgt) == len(specs) and all(x >= 0 for x in tgt) and sum(tgt) > 0), "mopd.target_share",
         tgt, f"must be empty (uniform) or {len(specs)} non-negative shares, one per teacher")
    need(m["gap_stat"] in mopd_lib.STATS, "mopd.gap_stat", m["gap_stat"], f"must be one of {mopd_lib.STATS}")
    need(m["gap_reference"] in GAP_REFERENCES, "mopd.gap_reference", m["gap_reference"],
         f"must be one of {GAP_REFERENCES}")
    need(0 <= m["gap_decay"] < 1, "mopd.gap_decay", m["gap_decay"], "must be in [0, 1)")
    need(m["gap_alpha"] >= 0, "mopd.gap_alpha", m["gap_alpha"], "must be >= 0")
  elif c.distill.get("mopd") is not None and (m["token_share"] or m["gap_follow"] or m["reward_advantage"]):
    need(False, "mopd", dict(c.distill.mopd), f"needs distill.teachers (and distill.teacher={MOPD_TEACHER!r})")
  if (m["token_share"] or m["gap_follow"]) and not m["reward_advantage"]:
    need(False, "mopd.reward_advantage", m["reward_advantage"],
         "M1 token-share weights and M2 gap factors multiply the advantage, which OPD losses do not read: set "
         "distill.mopd.reward_advantage=True with an advantage loss (loss.name='ppo_clip')")
  if m["reward_advantage"]:
    need(not fields, "mopd.reward_advantage", True,
         f"replaces the advantage, which loss {c.loss.name!r} does not read (it reads the teacher's {list(fields)}); "
         "use an advantage loss such as ppo_clip")
  k = cache_options(c)
  if k["enabled"]:
    need(isinstance(k["capacity"], int) and k["capacity"] >= 1, "topk_cache.capacity", k["capacity"],
         "must be an int >= 1 (rows)")
    need("teacher_head" not in fields, "topk_cache.enabled", True,
         f"loss {c.loss.name!r} reads the teacher's full distribution (teacher_head), which is not cached; use a "
         "top-k or sampled-token OPD loss")


def teacher_config(c: ml_collections.ConfigDict, spec: dict) -> ml_collections.ConfigDict:
  """A copy of `c` whose single `distill.teacher*` fields (and seed) are those of one `distill.teachers` spec:
  what `teacher.load_teacher` reads (cache key, architecture, SFT schedule)."""
  ci = copy.deepcopy(c)
  with ci.unlocked():
    for f in ("teacher", "teacher_d_model", "teacher_n_layers", "teacher_sft_steps"):
      if spec.get(f) is not None:
        ci.distill[f] = spec[f]
    if spec.get("seed") is not None:
      ci.seed = spec["seed"]
  return ci


def example_domains(examples, num_teachers: int, names: list[str]) -> np.ndarray:
  """Domain of each example: its `domain` (an int, or one of `names`) when present, else example_id % Y."""
  out = np.zeros(len(examples), np.int32)
  for i in range(len(examples)):
    ex = examples[i]
    d = ex.get("domain")
    if d is None:
      d = int(ex.get("example_id", i)) % num_teachers
    elif isinstance(d, str):
      if d not in names:
        raise ValueError(f"example {ex.get('example_id', i)}: domain {d!r} names no teacher (domains: {names})")
      d = names.index(d)
    if not 0 <= int(d) < num_teachers:
      raise ValueError(f"example {ex.get('example_id', i)}: domain {d} is not in [0, {num_teachers})")
    out[i] = int(d)
  return out


class PromptDomains:
  """Rollout rows -> domains, by looking the row's prompt tokens up among the encoded training prompts."""

  def __init__(self, examples, width: int, num_teachers: int, names: list[str], encoder: Encoder = CHAR_ENCODER):
    self.width = width
    dom = example_domains(examples, num_teachers, names)
    tokens, _ = encoder.pad_prompts([examples[i]["prompt"] for i in range(len(examples))], width)
    self._table: dict[bytes, int] = {}
    for row, d in zip(np.asarray(tokens, np.int32), dom):
      self._table.setdefault(row.tobytes(), int(d))  # identical prompts: the first example's domain

  def __call__(self, sequence_BT) -> np.ndarray:
    prompts = np.asarray(sequence_BT, np.int32)[:, :self.width]
    try:
      return np.array([self._table[p.tobytes()] for p in prompts], np.int32)
    except KeyError:
      raise ValueError("a rollout row's prompt is not among the training prompts: its domain is unknown") from None


def score_groups(score: Callable, params, seq: tuple, mask_BN, groups: np.ndarray, group_size: int,
                 n_groups: int) -> dict:
  """Teacher scores (`SCORE_FIELDS`, numpy) of the rows of whole `groups` (G rows each), in that order.

  The groups are padded to the next power of two (at most `n_groups`) with copies of the first one whose
  mask is zeroed, so at most log2(n_groups) + 1 shapes compile; all groups in order are the batch itself.
  """
  G, m = group_size, len(groups)
  bucket = min(1 << max(m - 1, 0).bit_length(), n_groups)
  gi = np.concatenate([groups, np.full(bucket - m, groups[0])]).astype(np.int64)
  rows = (gi[:, None] * G + np.arange(G)[None]).reshape(-1)
  live = np.repeat(np.arange(bucket) < m, G)
  mask = np.asarray(mask_BN)
  sub = tuple(np.asarray(x)[rows] for x in seq)
  out = score(params, *sub, np.where(live[:, None], mask[rows], 0).astype(mask.dtype))
  return {f: np.asarray(out[f])[:m * G] for f in SCORE_FIELDS}


@dataclasses.dataclass
class Teacher:
  params: Any
  score: Callable  # (params, sequence_BT, positions_BT, segment_ids_BT, mask_BN) -> dict (`make_teacher_scorer`)


class DistillExtras:
  """`extras(ro, seq, mask_BN) -> dict` with ADWIN horizons, routed teachers and the row cache (module docstring).

  `teachers`: one per domain (one: no routing); `domains(sequence_BT) -> [B] int` (None with one teacher);
  `fields`: the `LossInputs` fields the loss reads (a `teacher_head` only from one uncached teacher, which
  scores the whole batch); `topk`: the scorers' k; `adwin` / `mopd` / `cache`: the options (None: off).
  """

  def __init__(self, teachers: list[Teacher], fields: tuple[str, ...], group_size: int, topk: int, *, domains=None,
               adwin: dict | None = None, mopd: dict | None = None, cache: RowCache | None = None):
    self.teachers, self.fields, self.G, self.topk, self.domains = teachers, fields, group_size, topk, domains
    self.adwin_opts, self.mopd_opts, self.cache = adwin, mopd, cache
    self.adwin_cfg = None
    if adwin is not None:
      names = [f.name for f in dataclasses.fields(adwin_lib.AdwinConfig)]
      self.adwin_cfg = adwin_lib.AdwinConfig(**{k: adwin[k] for k in names})
    self.step = 0  # batches built so far (= learner steps)
    self.adwin_state = adwin_lib.init_state(self.adwin_cfg) if self.adwin_cfg is not None else None
    self.gap_ref = np.full(len(teachers), np.nan)  # M2 reference per domain (NaN: not seen yet)

  # --- carried state -------------------------------------------------------------------------------
  def state(self) -> dict:
    """Plain data for a checkpoint: step count, ADWIN horizon and last probe step, M2 references."""
    out = {"step": self.step, "gap_ref": [None if not math.isfinite(x) else float(x) for x in self.gap_ref]}
    if self.adwin_state is not None:
      s = self.adwin_state
      out["adwin"] = {"horizon": int(s.horizon), "last_probe_step": int(s.last_probe_step)}
    return out

  def restore(self, state: dict) -> None:
    """Continues from `state()`; a missing part (an option turned on at resume) starts fresh."""
    self.step = int(state["step"])
    ref = state.get("gap_ref")
    if ref is not None and len(ref) == len(self.teachers):
      self.gap_ref = np.array([np.nan if x is None else float(x) for x in ref])
    if self.adwin_state is not None and state.get("adwin"):
      a = state["adwin"]
      self.adwin_state = adwin_lib.AdwinState(int(a["horizon"]), int(a["last_probe_step"]))

  # --- scoring -------------------------------------------------------------------------------------
  def _score(self, seq: tuple, mask_BN, domain_B: np.ndarray, info: dict) -> dict:
    """The routed (and cached) teacher scores of every row: `SCORE_FIELDS` [B, N(, k)], numpy.

    Each teacher scores only the groups of its domain that are neither cached nor wholly masked out
    (DAPO-filtered groups get zeros, which is what scoring them would give)."""
    B, N = np.shape(mask_BN)
    G, k = self.G, self.topk
    n = B // G
    out = {"teacher_logp_BN": np.zeros((B, N), np.float32), "teacher_topk_ids_BNk": np.zeros((B, N, k), np.int32),
           "teacher_topk_logp_BNk": np.zeros((B, N, k), np.float32),
           "teacher_topk_residual_logp_BN": np.zeros((B, N), np.float32)}
    dom_b = domain_B[::G]
    live_b = (np.asarray(mask_BN) > 0).reshape(n, G * N).any(axis=1)
    hits = misses = 0
    for y, t in enumerate(self.teachers):
      keys = RowCache.keys(y, *seq, mask_BN) if self.cache is not None else None
      todo = []
      for g in np.flatnonzero((dom_b == y) & live_b):
        rows = range(g * G, (g + 1) * G)
        got = [self.cache.get(keys[b]) for b in rows] if self.cache is not None else [None]
        if any(r is None for r in got):
          todo.append(g)
          continue
        hits += G
        for b, r in zip(rows, got):
          for f in SCORE_FIELDS:
            out[f][b] = r[f]
      if not todo:
        continue
      misses += G * len(todo)
      fresh = score_groups(t.score, t.params, seq, mask_BN, np.asarray(todo, np.int64), G, n)
      for i, g in enumerate(todo):
        for j in range(G):
          row = {f: fresh[f][i * G + j] for f in SCORE_FIELDS}
          for f in SCORE_FIELDS:
            out[f][g * G + j] = row[f]
          if self.cache is not None:
            self.cache.put(keys[g * G + j], row)
    if self.cache is not None:
      info.update(topk_cache_hits=float(hits), topk_cache_misses=float(misses), topk_cache_rows=float(len(self.cache)))
    return out

  def __call__(self, ro, seq: tuple, mask_BN) -> dict:
    info: dict = {}
    B = np.shape(mask_BN)[0]
    domain_B = self.domains(seq[0]) if self.domains is not None else np.zeros(B, np.int32)
    routed_or_cached = len(self.teachers) > 1 or self.cache is not None
    if routed_or_cached:
      scores = self._score(seq, mask_BN, domain_B, info)
    else:  # one teacher, nothing cached: the plain extras' single forward over the batch
      t = self.teachers[0]
      scores = dict(t.score(t.params, *seq, mask_BN))
    out = {f: scores[f] for f in self.fields if f != "sup_drift_B"}
    if "sup_drift_B" in self.fields:
      out["sup_drift_B"] = jnp.zeros((B,), jnp.float32)  # a frozen teacher never drifts
    batch: dict = {"info": info}
    mask = jnp.asarray(mask_BN)
    # The teacher's sampled-token signal r_t = log p(y_t) − log μ(y_t) on the full-length rows.
    reward_BN = jnp.where(mask > 0, jnp.asarray(scores["teacher_logp_BN"]) - jnp.asarray(ro.behavior_logp_BN), 0.0)
    if self.adwin_cfg is not None:
      mask = self._adwin(ro, mask, reward_BN, info)
      batch["mask_BN"] = mask
    if self.mopd_opts is not None:
      w_B = self._mopd_weights(domain_B, mask, reward_BN, info)
      if self.mopd_opts["reward_advantage"]:
        batch["adv_BN"] = jnp.asarray(w_B, jnp.float32)[:, None] * reward_BN
    self.step += 1
    out["_batch"] = batch
    return out

  # --- ADWIN ---------------------------------------------------------------------------------------
  def generation_budget(self, step: int) -> int | None:
    """The new tokens the next batch needs (`generation.TokenBudget`): ADWIN's horizon H, so no decode step is spent
    on tokens the loss will not train on; None (full length) when that batch is a probe, or without ADWIN."""
    del step  # the next batch built is the one the horizon and the probe schedule are counted in
    if self.adwin_cfg is None or adwin_lib.should_probe(self.adwin_state, self.step, self.adwin_cfg):
      return None
    return int(self.adwin_state.horizon)

  def _adwin(self, ro, mask, reward_BN, info: dict):
    """The prefix-masked loss mask of this step's horizon; a due probe updates the next steps' horizon."""
    cfg, s, a = self.adwin_cfg, self.adwin_state, self.adwin_opts
    H = s.horizon
    horizon_B = jnp.full((mask.shape[0],), H, jnp.int32)
    if a["anchor_threshold"] > 0:  # cut at the first token whose reverse KL log μ − log p exceeds the threshold
      horizon_B = adwin_lib.teacher_anchored_length(-reward_BN, mask, a["anchor_threshold"], H)
    kept = adwin_lib.prefix_mask(mask, horizon_B)
    info["adwin_horizon"] = float(H)
    info["adwin_kept_frac"] = float(kept.sum() / jnp.maximum(mask.sum(), 1.0))
    if adwin_lib.should_probe(s, self.step, cfg):
      agreement = float(adwin_lib.kl_mass_alignment(reward_BN, mask, H))
      age = int(np.max(np.asarray(ro.lag_B))) if ro.lag_B is not None else 0
      # `update_horizon` compares versions: the probe's rows are `age` versions behind the learner.
      s = adwin_lib.update_horizon(adwin_lib.mark_probe(s, self.step), agreement, -age, 0, cfg)
      info["adwin_agreement"] = agreement
      info["adwin_probe_age"] = float(age)
    self.adwin_state = s
    return kept

  # --- Open-MOPD -----------------------------------------------------------------------------------
  def _mopd_weights(self, domain_B: np.ndarray, mask, reward_BN, info: dict) -> np.ndarray:
    """M1 × M2 per-row weights [B] (1 when both are off); logs each domain's token share and weight."""
    m, Y = self.mopd_opts, len(self.teachers)
    m_np, mask_np = np.asarray(mask), np.asarray(mask) > 0
    ntok_B = mask_np.sum(-1).astype(np.float64)
    target = np.asarray(m["target_share"] or [1.0 / Y] * Y, np.float64)
    w = np.ones(len(domain_B))
    mag = ref = None
    if m["gap_follow"]:
      mag = mopd_lib.domain_magnitude(np.abs(np.asarray(reward_BN)), m_np, domain_B, Y, m["gap_stat"])
      # m_d against the reference of the steps before (a domain's first magnitude is its own reference: factor 1);
      # then the reference takes this step's magnitude in ("anchored": only a first one; "ema": every one).
      ref = mopd_lib.update_reference(self.gap_ref, mag, "anchored")
      self.gap_ref = mopd_lib.update_reference(self.gap_ref, mag, m["gap_reference"], m["gap_decay"])
      factor = mopd_lib.gap_factor(mag, ref, m["gap_alpha"])
      for y in range(Y):
        info[f"mopd_gap_factor_{y}"] = float(factor[y])
    if m["token_share"] or m["gap_follow"]:
      w = mopd_lib.domain_loss_weights(domain_B, ntok_B, target if m["token_share"] else _observed(domain_B, ntok_B, Y),
                                       mag, ref, m["gap_alpha"])
    total = max(ntok_B.sum(), 1.0)
    for y in range(Y):
      rows = domain_B == y
      info[f"mopd_token_share_{y}"] = float(ntok_B[rows].sum() / total)
      if rows.any():
        info[f"mopd_weight_{y}"] = float(w[rows].mean())
    return w


def _observed(domain_B, ntok_B, Y: int) -> np.ndarray:
  """The batch's own token shares as M1 targets: M1 off (weights 1), so M2 factors alone move the budget."""
  tok = np.bincount(domain_B, weights=ntok_B, minlength=Y)
  return tok / tok.sum() if tok.sum() > 0 else np.full(Y, 1.0 / Y)


def make_batch_extras(c: ml_collections.ConfigDict, *, fields: tuple[str, ...], temperature: float, width: int,
                      train_examples, student_cfg, encoder: Encoder = CHAR_ENCODER) -> DistillExtras:
  """Loads the teacher(s) (`teacher.load_teacher`, cached SFT teachers as for one) and builds the extras.

  `fields`, `temperature`: what `opd.extra_fields` / `opd.scoring_temperature` give for the run's loss.
  """
  validate(c, fields)
  specs = teacher_specs(c) or [{}]
  head = "teacher_head" in fields
  teachers = []
  for spec in specs:
    ci = teacher_config(c, spec) if spec else c
    cfg, params = teacher_lib.load_teacher(ci, width, train_examples, student_cfg.vocab_size, encoder)
    score = teacher_lib.make_teacher_scorer(cfg, temperature, c.distill.topk, head=head,
                                            group_size=c.rollout.group_size)
    teachers.append(Teacher(params, score))
  domains = None
  if len(teachers) > 1:
    domains = PromptDomains(train_examples, width, len(teachers), [s.get("domain") or "" for s in specs], encoder)
  a, k = adwin_options(c), cache_options(c)
  return DistillExtras(teachers, fields, c.rollout.group_size, c.distill.topk, domains=domains,
                       adwin=a if a["enabled"] else None, mopd=mopd_options(c) if teacher_specs(c) else None,
                       cache=RowCache(k["capacity"]) if k["enabled"] else None)
