"""Async multi-turn episodes: an episode spans policy versions, each token's version is recorded, π_old is
scored per token at its generating version, and admission keeps every policy token's lag ≤ η.

A random tiny model on the character vocabulary plays `test_countdown` (done after seed % 3 + 1 turns) and
`test_echo` (never done), registered by tests/test_episodes.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import learner
from jaxrl_llm.rollout.async_engine import AsyncRollout, episode_seed, make_episode_rollout
from jaxrl_llm.rollout.episodes import EnvSettings, merge_stats, run_episodes
from jaxrl_llm.rollout.param_store import ParamStore
from test_episodes import CFG, P, PARAMS, learner_logp, make_gen

ECHO = EnvSettings(name="test_echo", max_turns=3, turn_tokens=3, max_episode_tokens=16, timeout_s=30.0,
                   prompt_width=P)
bump = jax.jit(lambda p, k: jax.tree.map(lambda x: x + 0.3 * jax.random.normal(k, x.shape), p))


def test_poll_switches_parameters_between_turns():
  """A poll that offers a newer version before every later turn: turn t's tokens carry version 10 + t and their
  behaviour log-probs are those of that version's parameters (recomputed by the learner per turn)."""
  versions = {10: PARAMS, 11: bump(PARAMS, jax.random.key(1)), 12: bump(PARAMS, jax.random.key(2))}
  asked = []

  def poll(current):
    asked.append(current)
    return None if current is None else (current + 1, versions[current + 1])

  r = run_episodes(make_gen(), PARAMS, [3, 4], 2, ECHO, jax.random.key(7), version=10, poll=poll)
  assert asked == [10, 11, None]  # before turns 1 and 2, then the end
  m = r.mask_BN > 0
  assert (r.turn_BN[m] >= 0).all()
  np.testing.assert_array_equal(r.versions_BN[m], 10 + r.turn_BN[m])
  env = r.env_mask_BN > 0  # an observation carries the version of the turn it answers
  np.testing.assert_array_equal(r.versions_BN[env], 10 + r.turn_BN[env])
  seq = [jnp.asarray(x) for x in (r.sequence_BT, r.positions_BT, r.segment_ids_BT)]
  for v, params in versions.items():
    at = m & (r.versions_BN == v)
    assert at.any()
    lp = np.asarray(learner_logp(params, *seq, 1.0))
    np.testing.assert_allclose(lp[at], r.behavior_logp_BN[at], atol=1e-5)
    if v > 10:  # a later version's parameters do not explain turn 0's tokens
      first = m & (r.versions_BN == 10)
      assert np.abs(lp[first] - r.behavior_logp_BN[first]).max() > 1e-3
  assert r.stats["env_version_span_max"] == 2


def test_poll_is_released_when_an_episode_batch_fails():
  """The runner tells the poll the end even when it raises (the worker's pinned snapshots are released)."""
  asked = []
  with pytest.raises(ValueError, match="takes no argument 'nope'"):
    run_episodes(make_gen(), PARAMS, [1], 1, dataclasses.replace(ECHO, kwargs=(("nope", 1),)), jax.random.key(0), 0,
                 poll=lambda v: asked.append(v))
  assert asked == [None]


def test_merge_stats_adds_counts_and_recomputes_the_turn_mean():
  a = {"episode_status": {"done": 2, "error": 0}, "env_episodes": 2, "env_turns": 6, "env_turns_mean": 3.0,
       "env_version_span_max": 1, "env_errors": 0, "reward_errors": 0}
  b = {"episode_status": {"done": 1, "error": 1}, "env_episodes": 2, "env_turns": 2, "env_turns_mean": 1.0,
       "env_version_span_max": 3, "env_errors": 1, "reward_errors": 1, "other": 5}
  got = merge_stats([a, b])
  assert got == {"episode_status": {"done": 3, "error": 1}, "env_episodes": 4, "env_turns": 8, "env_turns_mean": 2.0,
                 "env_version_span_max": 3, "env_errors": 1, "reward_errors": 1}


def test_episode_rollout_takes_the_newest_version_each_turn_and_scores_prox_per_version():
  """The async rollout function: turn 0 from the admitted snapshot, later turns from the newest published one;
  the worker's π_old equals the learner scorer at each token's version; the G episodes share the request's seed."""
  store = ParamStore(keep_last=4)
  params = {0: PARAMS, 1: bump(PARAMS, jax.random.key(3))}
  store.publish(params[0])
  snap = store.acquire()
  store.publish(params[1])  # published while the request is admitted at version 0
  score = learner.make_score_fn(CFG, 1.0)
  fn = make_episode_rollout(make_gen(), ECHO, group_size=2, store=store, score_fn=score)
  try:
    g = fn(snap, 5)
  finally:
    store.release(snap)
  m = g.mask_BN > 0
  np.testing.assert_array_equal(g.versions_BN[m], np.minimum(g.turn_BN[m], 1))
  assert g.stat("start_version") == 0 and g.stat("request_id") == 5 and g.stat("example_id") == episode_seed(0, 5)
  np.testing.assert_array_equal(g.request_B, [5, 5])
  seq = [jnp.asarray(x) for x in (g.sequence_BT, g.positions_BT, g.segment_ids_BT)]
  for v in (0, 1):
    want = np.asarray(score(params[v], *seq, jnp.asarray(g.mask_BN)))
    at = m & (g.versions_BN == v)
    np.testing.assert_allclose(g.prox_logp_BN[at], want[at], atol=1e-5)
  assert store.held_versions() == [0, 1] and all(store._refs.get(v, 0) == 0 for v in (0, 1))  # nothing left pinned
  pinned = make_episode_rollout(make_gen(), dataclasses.replace(ECHO, newest_each_turn=False), group_size=2,
                                store=store)
  snap = store.acquire(0)
  try:
    assert (pinned(snap, 5).versions_BN == 0).all()
  finally:
    store.release(snap)


@pytest.mark.parametrize("eta", [0, 1])
def test_async_engine_keeps_every_policy_tokens_lag_within_eta(eta):
  """Worker threads play episodes while the learner publishes: whatever the timing, every policy token's version
  is between the group's admitted version and the learner's, never decreases along an episode, and its lag
  (learner version − token version) is ≤ η."""
  env = EnvSettings(name="test_countdown", max_turns=4, turn_tokens=2, max_episode_tokens=12, timeout_s=30.0,
                    prompt_width=P)
  store = ParamStore(keep_last=1)
  params = PARAMS
  store.publish(params)
  fn = make_episode_rollout(make_gen(), env, group_size=2, store=store)
  version, lags, stats = 0, [], []
  with AsyncRollout(store, fn, batch_groups=2, eta=eta, num_workers=2, poll_s=0.002) as engine:
    for t in range(4):
      groups, _ = engine.next_batch(version, timeout=300.0)
      for g in groups:
        m = g.mask_BN > 0
        v = np.where(m, g.versions_BN, -1)
        assert np.all(g.versions_BN[m] >= g.stat("start_version")) and np.all(g.versions_BN[m] <= version)
        assert version - g.versions_BN[m].min() <= eta
        for b in range(g.num_rows):  # turn by turn, versions never go back
          per_turn = [v[b][g.turn_BN[b] == k].max() for k in range(g.turn_BN[b].max() + 1)]
          assert per_turn == sorted(per_turn)
        lags.append(version - g.stat("start_version"))
        stats.append(g.stats)
      params = bump(params, jax.random.key(t))
      version = store.publish(params)
  assert max(lags) <= eta
  assert merge_stats(stats)["env_episodes"] == 16
  assert store.held_versions() == [store.latest_version]


def test_runner_closes_environments_that_have_close():
  """Environments holding a resource (a simulator process) get `close()` once the batch is formed, even when one
  raises from it."""
  from jaxrl_llm import envs
  closed = []

  class Closing:
    def reset(self, seed):
      return "go"

    def step(self, action):
      return "=", 1.0, True

    def close(self):
      closed.append(self)
      if len(closed) == 1:
        raise RuntimeError("close failed")

  if "test_closing" not in envs.names():
    envs.register("test_closing")(Closing)
  r = run_episodes(make_gen(), PARAMS, [1, 2], 2, dataclasses.replace(ECHO, name="test_closing"), jax.random.key(0), 0)
  assert len(closed) == 4 and len({id(e) for e in closed}) == 4 and r.stats["env_done"] == 4
