"""Continuous batching of episode turns (`rollout.turn_sampler.SlotTurns`, `rollout.slots` with `env`).

A turn of slot-decoded rows equals `Reprefill`'s turn given the same per-row keys (`generation.request_keys`):
the same tokens and, up to float rounding, the same behaviour log-probs, with fewer slots than rows and contexts
of very different lengths. Whole episode batches with slots keep the record's invariants and equal the
re-prefilled batch drawn with per-row keys; configs/agent_tiny.py trains and resumes exactly with slots on.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import validate
from jaxrl_llm.keys import fold_in
from jaxrl_llm.metrics import read_jsonl
from jaxrl_llm.rollout import episodes, turn_sampler
from jaxrl_llm.rollout.episodes import EnvSettings, run_episodes
from jaxrl_llm.rollout.generation import request_keys
from jaxrl_llm.rollout.turn_sampler import Reprefill, SlotTurns
from jaxrl_llm.tasks import tokenizer as char_tok
from test_agent_run import agent
from test_episodes import P, PARAMS, learner_logp, make_gen

W = 32


class RowKeyed(Reprefill):
  """`Reprefill` drawing episode b's row with `request_keys(key, B)[b]`: the reference `SlotTurns` must equal."""

  def turn(self, params, version, rows_b, contexts, key, cfg):
    keys = request_keys(key, max(rows_b) + 1)[np.asarray(rows_b)]
    return super().turn(params, version, rows_b, contexts, keys, cfg)


def contexts(n: int) -> list[list[int]]:
  """n contexts of very different lengths (2 to 26 ids)."""
  return [char_tok.encode("ab<>=" * (b % 6) + "g" + str(b), add_bos=True) for b in range(n)]


def test_slot_turn_equals_reprefilled_turn_with_row_keys():
  gen = make_gen(0.8)
  # ten more stop ids: on this model turns end after 1 to 6 tokens (a long tail, so slots refill mid-turn)
  cfg = dataclasses.replace(gen.sampler_cfg, max_new_tokens=6, stop_ids=(char_tok.eos_id,) + tuple(range(30, 40)))
  ctx = contexts(7)
  rows_b = list(range(7)) + [0]  # a padded batch: the pad repeats the first episode
  ctx_b = ctx + [ctx[0]]
  assert min(map(len, ctx)) <= 3 and max(map(len, ctx)) >= 25
  key = fold_in(jax.random.key(9), 1)
  want = RowKeyed(gen, W).turn(PARAMS, 0, rows_b, ctx_b, key, cfg)
  slots = SlotTurns(gen, W, slots=3, chunk=2)
  got = slots.turn(PARAMS, 0, rows_b, ctx_b, key, cfg)
  lengths = want["lengths_B"][:7]
  assert lengths.min() <= 2 and lengths.max() == 6, lengths
  for k in ("tokens_BN", "lengths_B"):  # the pad row: a copy of the first (decoded again in the reference)
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  np.testing.assert_allclose(got["behavior_logp_BN"], want["behavior_logp_BN"], atol=2e-5)
  assert slots.prefills >= 3  # 7 rows through 3 slots: several admissions
  assert slots.live_steps == int(lengths.sum()) - 7  # each row's column 0 is sampled at admission, not decoded
  assert slots.slot_steps >= slots.live_steps
  # the engine is idle and reused: a second turn on other contexts still matches
  ctx2 = [c + char_tok.encode("<<") for c in ctx[:3]] + [ctx[3]]
  want2 = RowKeyed(gen, W).turn(PARAMS, 1, [4, 1, 2, 6], ctx2, fold_in(key, 2), cfg)
  got2 = slots.turn(PARAMS, 1, [4, 1, 2, 6], ctx2, fold_in(key, 2), cfg)
  np.testing.assert_array_equal(got2["tokens_BN"], want2["tokens_BN"])
  np.testing.assert_allclose(got2["behavior_logp_BN"], want2["behavior_logp_BN"], atol=2e-5)


ECHO = EnvSettings(name="test_echo", max_turns=3, turn_tokens=4, max_episode_tokens=20, timeout_s=5.0)


@pytest.fixture(scope="module")
def slot_record():
  gen = dataclasses.replace(make_gen(0.7), slots=3, slot_chunk=2)
  return run_episodes(gen, PARAMS, [3, 7], 3, ECHO, jax.random.key(5), version=2, keep_turns=True)


def test_episode_batch_with_slots_keeps_the_record_invariants(slot_record):
  r = slot_record
  pol, env = r.mask_BN > 0, r.env_mask_BN > 0
  assert pol.sum() > 10 and env.any() and not (pol & env).any()
  lp = np.asarray(learner_logp(PARAMS, jnp.asarray(r.sequence_BT), jnp.asarray(r.positions_BT),
                               jnp.asarray(r.segment_ids_BT), 0.7))
  np.testing.assert_allclose(lp[pol], r.behavior_logp_BN[pol], atol=1e-5)
  assert (r.behavior_logp_BN[~pol] == 0).all() and (r.versions_BN == 2).all()
  st = r.stats
  assert st["env_slot_steps"] >= st["env_live_steps"] > 0
  # `env.kv_cache` (default): later turns continue their episode's keys/values resident in its slot; first turns
  # (6 episodes through 3 slots: at least 2 admissions) and turns whose slot was reclaimed prefill
  assert st["env_prefills"] >= 2 and 0 < st["env_slot_resumes"] <= st["env_turns"] - 6, st


def test_episode_batch_with_slots_equals_row_keyed_reprefill(slot_record, monkeypatch):
  """The same batch re-prefilled every turn with per-row keys: the same episodes, statuses and rewards."""
  monkeypatch.setattr(turn_sampler, "Reprefill", RowKeyed)
  want = run_episodes(make_gen(0.7), PARAMS, [3, 7], 3, dataclasses.replace(ECHO, kv_cache=False), jax.random.key(5),
                      version=2)
  got = slot_record
  for k in ("sequence_BT", "positions_BT", "segment_ids_BT", "mask_BN", "env_mask_BN", "turn_BN", "reward_B"):
    np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=k)
  np.testing.assert_allclose(got.behavior_logp_BN, want.behavior_logp_BN, atol=2e-5)
  assert got.stats["episode_statuses"] == want.stats["episode_statuses"]


class Logged(SlotTurns):
  """`SlotTurns` that logs its events: ("submit", episode) and ("done", episode), in both drivers."""
  events: list = []

  def _put(self, tag, prompt_W, length, row_key, cfg, keep=None):
    Logged.events.append(("submit", tag))
    super()._put(tag, prompt_W, length, row_key, cfg, keep)

  def step(self, params, version):
    done = super().step(params, version)
    Logged.events += [("done", tag) for tag, _ in done]
    return done


SAME_STATS = ("episode_status", "episode_statuses", "env_turns", "env_policy_tokens", "env_tokens", "env_evictions",
              "env_copied_tokens", "env_sdcc_skipped", "evict_segment_starts")


def assert_same_record(a, b):
  for k, v in a.arrays().items():
    if k == "behavior_logp_BN":
      np.testing.assert_allclose(v, b.behavior_logp_BN, atol=2e-5)
    else:
      np.testing.assert_array_equal(v, getattr(b, k), err_msg=k)
  for k in (a.extra or {}):
    np.testing.assert_array_equal(a.extra[k], b.extra[k], err_msg=k)
  assert (a.extra is None) == (b.extra is None)
  for k in SAME_STATS:
    assert a.stats.get(k) == b.stats.get(k), k


@pytest.mark.parametrize("env", ["echo", "countdown"])
def test_cross_turn_refill_equals_turn_synchronous_slots(env, monkeypatch):
  """Without `poll`, slots play episodes with no turn barrier: episode b's next turn is queued as soon as its
  environment answered, while other episodes' turns still decode. Per-episode keys make the record the one the
  turn-synchronous driver (`poll` given: every turn ends before the environments step) gives, per-turn outputs
  included."""
  s = ECHO if env == "echo" else EnvSettings(name="test_countdown", max_turns=4, turn_tokens=3, max_episode_tokens=20)
  gen = dataclasses.replace(make_gen(0.7), slots=3, slot_chunk=2)
  monkeypatch.setattr(turn_sampler, "SlotTurns", Logged)
  Logged.events = []
  refill = run_episodes(gen, PARAMS, [0, 1, 2], 2, s, jax.random.key(5), version=2, keep_turns=True)
  events = list(Logged.events)
  Logged.events = []
  synced = run_episodes(gen, PARAMS, [0, 1, 2], 2, s, jax.random.key(5), version=2, keep_turns=True,
                        poll=lambda v: None)
  assert_same_record(refill, synced)
  for x, y in zip(refill.stats["turn_outputs"], synced.stats["turn_outputs"], strict=True):
    for k in ("tokens_BN", "lengths_B", "live_B", "start_B"):
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    np.testing.assert_allclose(x["behavior_logp_BN"], y["behavior_logp_BN"], atol=2e-5)
  if env == "countdown":
    assert refill.stats["episode_statuses"] == ("done",) * 6 and refill.stats["env_turns"] == 2 * (1 + 2 + 3)

  def overlaps(ev):  # a turn queued before some other episode's earlier turn finished
    turn, queued_at, done_at = {}, {}, {}
    for i, (kind, b) in enumerate(ev):
      if kind == "submit":
        turn[b] = turn.get(b, -1) + 1
        queued_at[b, turn[b]] = i
      else:
        done_at[b, turn[b]] = i
    return any(queued_at[b, t] < done_at[c, u] for (b, t) in queued_at for (c, u) in done_at if u < t)

  assert overlaps(events) and not overlaps(Logged.events)  # the synchronous driver keeps its barrier
  assert synced.stats["env_live_steps"] == refill.stats["env_live_steps"]  # the same turns decoded
  assert refill.stats["env_slot_steps"] <= synced.stats["env_slot_steps"]


@pytest.mark.parametrize("policy", ["drop_oldest", "summary"])
def test_cross_turn_refill_with_evictions(policy):
  """Context compression under cross-turn refill: the same segments, SDCC rows and stats as turn-synchronous."""
  import test_evict  # noqa: PLC0415  (its environment, model and eviction settings)
  s = dataclasses.replace(test_evict.SETTINGS, evict=policy)
  gen = dataclasses.replace(test_evict.make_gen(), slots=2, slot_chunk=2)
  a = run_episodes(gen, test_evict.PARAMS, [1, 2], 2, s, jax.random.key(7), version=0, width=test_evict.P)
  b = run_episodes(gen, test_evict.PARAMS, [1, 2], 2, s, jax.random.key(7), version=0, width=test_evict.P,
                   poll=lambda v: None)
  assert a.stats["env_evictions"] >= 2
  assert_same_record(a, b)


def test_cross_turn_refill_failing_environments():
  """Errors, rejected actions and failed resets end their episode; the others play on (statuses as synchronous)."""
  s = EnvSettings(name="test_faulty", max_turns=2, turn_tokens=3, max_episode_tokens=12, timeout_s=5.0)
  gen = dataclasses.replace(make_gen(), slots=2, slot_chunk=2)
  r = run_episodes(gen, PARAMS, [0, 1, 3, 4], 2, s, jax.random.key(9), version=0)
  assert r.stats["episode_statuses"] == ("done",) * 2 + ("error",) * 2 + ("invalid",) * 2 + ("error",) * 2
  np.testing.assert_array_equal(r.reward_B, [1, 1, 0, 0, 0, 0, 0, 0])
  assert_same_record(r, run_episodes(gen, PARAMS, [0, 1, 3, 4], 2, s, jax.random.key(9), version=0,
                                     poll=lambda v: None))


def test_turn_sampler_choice():
  """Slots first, then the kept cache, on one device and on a mesh (tests/test_mesh_features.py runs both there)."""
  gen = dataclasses.replace(make_gen(), slots=2, mesh=object())
  assert isinstance(episodes._turn_sampler(gen, ECHO, W, gen.mesh), SlotTurns)
  assert isinstance(episodes._turn_sampler(dataclasses.replace(gen, mesh=None), ECHO, W, None), SlotTurns)
  assert isinstance(episodes._turn_sampler(make_gen(), ECHO, W, None), turn_sampler.CachedTurns)
  assert isinstance(episodes._turn_sampler(make_gen(), ECHO, W, object()), turn_sampler.CachedTurns)
  assert isinstance(episodes._turn_sampler(make_gen(), dataclasses.replace(ECHO, kv_cache=False), W, None),
                    turn_sampler.Reprefill)


def test_config_accepts_episodes_with_slots_and_still_names_the_field():
  validate(agent(rollout__slots=4))
  validate(agent(rollout__slots=4, rollout__mode="fixed_lag", rollout__lag=1, env__kv_cache=False))
  validate(agent(rollout__slots=4, sampler__behavior_topk=4, sampler__mc_samples=4))  # μ's records: every loop
  validate(agent(rollout__slots=4, model__num_experts=4, model__routing_replay=True))  # episodes keep MoE routes
  validate(agent(rollout__slots=4, sampler__kv_cache="int8"))  # the cache format is the engine's cache layer's


def test_agent_tiny_trains_two_sync_steps_with_slots(tmp_path):
  rows = loop.run(agent(rollout__slots=4, rollout__slot_chunk=2), str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1]
  assert all(np.isfinite(r["loss"]) for r in rows) and rows[0]["env_policy_tokens"] > 0, rows
  assert rows[0]["env_slot_steps"] >= rows[0]["env_live_steps"] > 0, rows
  assert all(r["mismatch_abs_max"] < 1e-5 for r in rows), rows  # π_old recomputed by the learner equals μ


@pytest.mark.slow  # three short runs (~30 s on one core)
def test_agent_fixed_lag_with_slots_resumes_exactly(tmp_path):
  c = agent(rollout__mode="fixed_lag", rollout__lag=1, rollout__slots=3, rollout__slot_chunk=2, optim__lr=1e-2,
            optim__warmup_steps=0)
  c.loss.entropy_coef = 0.01  # a gradient even when every reward of a group is equal
  c.checkpoint.every, c.num_steps = 1, 2
  whole = loop.run(c, str(tmp_path / "whole"))
  c.num_steps = 1
  loop.run(c, str(tmp_path / "split"))  # stops with step 1's episodes (generated by version 0) queued
  c.num_steps = 2
  loop.run(c, str(tmp_path / "split"))
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time_", "eval_"))} for r in rows]
  assert len(whole) == 2 and all(r["grad_norm"] > 0 for r in whole) and whole[1]["env_slot_steps"] > 0
  assert strip(read_jsonl(str(tmp_path / "split" / "metrics.jsonl"))) == strip(whole)
