"""Multi-turn agents through the loop: configs/agent_tiny.py trains in the synchronous sources; `env` validation."""

import math
import os

import numpy as np
import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import loop
from jaxrl_llm.config import ConfigError, load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def agent(**over):
  c = load_file(os.path.join(ROOT, "configs", "agent_tiny.py"))
  c.log.tensorboard, c.log.progress = False, False
  c.num_steps, c.checkpoint.every = 2, 0
  for k, v in over.items():
    sec, key = k.split("__")
    c[sec][key] = v
  return c


@pytest.mark.parametrize("mode,lag,kv_cache", [("sync", 0, True), ("sync", 0, False), ("fixed_lag", 1, True),
                                               ("staged", 2, True), ("replay", 1, True)])
def test_agent_tiny_trains_two_steps(tmp_path, mode, lag, kv_cache):
  c = agent(rollout__mode="fixed_lag" if mode == "replay" else mode, rollout__lag=lag, env__kv_cache=kv_cache)
  if mode == "replay":
    c.rollout.replay.capacity, c.rollout.replay.fresh_per_step, c.rollout.replay.reuse_limit = 8, 2, 2
  rows = loop.run(c, str(tmp_path / mode))
  assert [r["step"] for r in rows] == [0, 1]
  assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
  assert sum(r["updates_applied"] for r in rows) >= 1
  # every step reports its own episodes, also when staged plays a stage's steps in one call (issue 48); the call's
  # sampler counters (prefills) are on the stage's first step
  B = c.rollout.prompts_per_step * c.rollout.group_size
  for r in rows:  # replay: the episodes generated for that step (its first fills the buffer with several calls)
    assert r["env_episodes"] == B or mode == "replay" and r["env_episodes"] % 2 == 0, rows
    assert r["env_policy_tokens"] > 0 and r["env_turns_mean"] >= 1, rows
    assert sum(r[f"env_{k}"] for k in ("done", "max_turns", "truncated", "too_long", "errors", "timeouts",
                                       "invalid")) == r["env_episodes"], rows
  # the kept cache prefills once per sampler call (one version per call, enough slots); else once per turn
  if kv_cache and mode != "replay":
    assert rows[0]["env_prefills"] == 1, rows
  elif not kv_cache:
    assert rows[0]["env_prefills"] >= max(2, math.ceil(rows[0]["env_turns_mean"])), rows
  if mode == "sync":  # π_old recomputed by the learner at the generating version equals μ on every policy token
    assert all(r["mismatch_abs_max"] < 1e-5 for r in rows), rows


def test_env_absent_or_empty_is_single_turn():
  c = load_file(os.path.join(ROOT, "configs", "tiny.py"))
  assert not config_lib.env_on(c) and config_lib.env_length(c) == 0 and "turn" not in config_lib.available_needs(c)
  c.loss.name = "epo"
  with pytest.raises(ConfigError, match="needs \\['turn'\\]"):
    config_lib.validate(c)
  a = agent()
  a.env.name = ""
  assert not config_lib.env_on(a)
  assert "turn" in config_lib.available_needs(agent())


def test_turn_level_credit_trains_and_is_validated(tmp_path):
  """advantage.turn_level: the batch's token advantages come from each turn's return-to-go (guess_number's reward
  is the last turn's, so they equal the sequence advantages there); it needs episodes and a group baseline."""
  from jaxrl_llm.rollout import collect
  from jaxrl_llm.rollout.sources.common import sync_rollout
  from test_loop import fresh_run
  c = agent(advantage__turn_level=True)
  r, state, extra, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  batch, _ = loop.make_batch(r, store, state, extra, ro)
  G = c.rollout.group_size
  adv_B = np.asarray(collect.group_advantages(ro.reward_B, G, c.advantage.name, c.advantage.std_normalize))
  want = collect.turn_advantages(ro.reward_B, ro.turn_reward_BK, ro.turn_BN, adv_B, G, c.advantage.name,
                                 c.advantage.std_normalize) * np.asarray(ro.mask_BN)
  np.testing.assert_allclose(np.asarray(batch.adv_BN), want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(want, adv_B[:, None] * np.asarray(ro.mask_BN), rtol=1e-5, atol=1e-6)  # final reward
  rows = loop.run(c, str(tmp_path / "turns"))
  assert [r["step"] for r in rows] == [0, 1] and all(math.isfinite(r["loss"]) for r in rows), rows
  for over, needle in (({"env.name": ""}, "set env.name"), ({"advantage.name": "reinforce_pp"}, "group baseline")):
    bad = agent(advantage__turn_level=True)
    for k, v in over.items():
      bad[k.split(".")[0]][k.split(".")[1]] = v
    with pytest.raises(ConfigError, match=f"config.advantage.turn_level=True: .*{needle}"):
      config_lib.validate(bad)


@pytest.mark.parametrize("field,value,named", [
    ("name", "nope", "env.name"), ("max_turns", 0, "env.max_turns"), ("turn_tokens", 0, "env.turn_tokens"),
    ("max_episode_tokens", 2, "env.max_episode_tokens"), ("timeout_s", 0, "env.timeout_s"),
    ("prompt_width", -1, "env.prompt_width"), ("kwargs", {"nope": 1}, "env.kwargs.nope"),
    ("kv_cache", 1, "env.kv_cache"),
])
def test_env_validation_names_the_field(field, value, named):
  c = agent()
  if field == "kwargs":
    c.env.kwargs = config_lib.ml_collections.ConfigDict(value)
  elif field == "kv_cache":  # a bool field: ml_collections refuses another type on assignment, not on a new section
    c.env = config_lib.ml_collections.ConfigDict({**c.env.to_dict(), field: value})
  else:
    c.env[field] = value
  with pytest.raises(ConfigError, match=f"config.{named}="):
    config_lib.validate(c)


def test_agent_tiny_trains_in_async_mode(tmp_path):
  """Async episodes through the loop: worker threads play, admission bounds the lag, π_old is recomputed per token
  at its version (by the workers), and the episode counters of the batch's groups are merged."""
  c = agent(rollout__mode="async", rollout__lag=1, rollout__num_workers=2)
  c.num_steps = 3
  rows = loop.run(c, str(tmp_path / "async"))
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert all(math.isfinite(r["loss"]) for r in rows), rows
  for r in rows:
    assert len(r["async_lag_hist"]) == 2 and sum(r["async_lag_hist"]) == c.rollout.prompts_per_step
    assert r["env_episodes"] == c.rollout.prompts_per_step * c.rollout.group_size
    statuses = ("env_done", "env_max_turns", "env_truncated", "env_too_long", "env_errors", "env_timeouts",
                "env_invalid")
    assert sum(r[k] for k in statuses) == r["env_episodes"] and r["env_turns_mean"] >= 1
    assert 0 <= r["env_version_span_max"] <= c.rollout.lag
  assert rows[0]["async_lag_hist"] == [c.rollout.prompts_per_step, 0]  # nothing older than version 0 exists


@pytest.mark.parametrize("field,value,named", [
    ("env.newest_each_turn", 1, "env.newest_each_turn"), ("rollout.partial_chunk", 2, "rollout.partial_chunk")])
def test_async_episode_validation_names_the_field(field, value, named):
  c = agent(rollout__mode="async", rollout__lag=1)
  sec, key = field.split(".")
  c[sec] = config_lib.ml_collections.ConfigDict({**c[sec].to_dict(), key: value})  # (a bool field: see above)
  with pytest.raises(ConfigError, match=f"config.{named}="):
    config_lib.validate(c)
