"""Episode turns from a kept KV cache (`rollout.turn_sampler.CachedTurns`) equal re-prefilled turns (`Reprefill`):
the same tokens and, up to float rounding, the same behaviour log-probs; rows leave, slots run out, versions change.

The contexts are driven by hand: each turn appends the sampled tokens and an "observation" of a row-dependent
length, so rows of one batch sit at different lengths and the cache's shared write index leaves gaps.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_llm.keys import fold_in
from jaxrl_llm.rollout.turn_sampler import CachedTurns, Reprefill, SlotTurns
from jaxrl_llm.tasks import tokenizer as char_tok
from test_episodes import PARAMS, make_gen

W = 32
bump = jax.jit(lambda p, k: jax.tree.map(lambda x: x + 0.3 * jax.random.normal(k, x.shape), p))


def play(sampler, turns=3, rows=(0, 1, 2, 3), leave_after=None, versions=None, **kv):
  """Plays `turns` turns on 4 episodes; episode 2 leaves after turn `leave_after`. Returns per-turn outputs.
  `kv`: the turns' cache format (`SamplerConfig.kv_cache`, ...)."""
  gen = make_gen(0.8)
  cfg = dataclasses.replace(gen.sampler_cfg, max_new_tokens=3, **kv)
  ctx = {b: char_tok.encode("go" + str(b), add_bos=True) for b in rows}
  outs = []
  for t in range(turns):
    live = [b for b in rows if not (leave_after is not None and b == 2 and t > leave_after)]
    rows_b = live + [live[0]] * (4 - len(live))  # a padded batch repeats its first episode
    version, params = (0, PARAMS) if versions is None else versions[t]
    out = sampler.turn(params, version, rows_b, [ctx[b] for b in rows_b], fold_in(jax.random.key(9), t), cfg)
    n = out["lengths_B"]
    outs.append({b: (out["tokens_BN"][i, :n[i]].tolist(), out["behavior_logp_BN"][i, :n[i]]) for i, b in enumerate(live)})
    for i, b in enumerate(live):
      ctx[b] = ctx[b] + outs[-1][b][0] + char_tok.encode("<" * (1 + (b + t) % 3))  # the observation
  return outs


def assert_same(a, b):
  assert len(a) == len(b)
  for ta, tb in zip(a, b):
    assert ta.keys() == tb.keys()
    for k in ta:
      assert ta[k][0] == tb[k][0]
      np.testing.assert_allclose(ta[k][1], tb[k][1], atol=2e-5)


@pytest.fixture(scope="module")
def reference():
  return play(Reprefill(make_gen(0.8), W))


def test_cached_turns_equal_reprefilled_turns(reference):
  cached = CachedTurns(make_gen(0.8), W)
  assert_same(play(cached), reference)
  assert cached.prefills == 1  # the first turn only: later turns append the observation to the kept cache
  assert int(cached.cache["index"]) > W  # turns were written after the prefilled width


def test_rows_leave_the_cache():
  cached = CachedTurns(make_gen(0.8), W)
  got = play(cached, turns=4, leave_after=1)
  assert_same(got, play(Reprefill(make_gen(0.8), W), turns=4, leave_after=1))
  assert 2 not in got[2] and cached.prefills == 1


def test_running_out_of_slots_reprefills(reference):
  cached = CachedTurns(make_gen(0.8), W)
  cached.slots = W + 3 + 4 + 3  # the first turn (3), then room for one more (observation bucket 4 + 3), not two
  assert_same(play(cached), reference)
  assert cached.prefills == 2


def test_a_new_version_reprefills():
  """Async episodes: a turn under newer parameters is computed from a cache of those parameters, not the old."""
  versions = [(0, PARAMS), (1, bump(PARAMS, jax.random.key(1))), (1, bump(PARAMS, jax.random.key(1)))]
  cached = CachedTurns(make_gen(0.8), W)
  assert_same(play(cached, versions=versions), play(Reprefill(make_gen(0.8), W), versions=versions))
  assert cached.prefills == 2  # turn 0, and turn 1 (new version); turn 2 continues the cache


@pytest.mark.parametrize("kv", [dict(kv_cache="int8"), dict(kv_cache="window", kv_sinks=1, kv_window=6)])
def test_compressed_cache_turns_equal_reprefilled_turns(kv):
  """The kept cache in the sampler's compressed format (int8 values, or sinks + window visibility) samples what a
  re-prefill into that format samples, and μ is that cache's policy, not the full cache's."""
  cached = CachedTurns(make_gen(0.8), W)
  got = play(cached, **kv)
  assert_same(got, play(Reprefill(make_gen(0.8), W), **kv))
  assert cached.prefills == 1
  full = play(Reprefill(make_gen(0.8), W))
  diff = max(float(np.abs(got[t][b][1] - full[t][b][1]).max()) for t in range(len(got)) for b in got[t]
             if got[t][b][0] == full[t][b][0] and len(got[t][b][0]))
  assert diff > 1e-4  # the compressed cache changed μ


def test_records_of_kept_cache_turns_equal_reprefilled_ones():
  """μ's top-k and Monte-Carlo candidates of every turn: the kept cache records what a re-prefill records."""
  recs = dict(behavior_topk=3, mc_samples=2)
  gen = make_gen(0.8)
  cfg = dataclasses.replace(gen.sampler_cfg, max_new_tokens=3, **recs)
  ctx = [char_tok.encode("go" + str(b), add_bos=True) for b in range(4)]
  a = CachedTurns(make_gen(0.8), W).turn(PARAMS, 0, [0, 1, 2, 3], ctx, jax.random.key(2), cfg)
  b = Reprefill(make_gen(0.8), W).turn(PARAMS, 0, [0, 1, 2, 3], ctx, jax.random.key(2), cfg)
  m = np.asarray(b["mask_BN"]) > 0
  for k in ("behavior_topk_ids_BNk", "mc_ids_BNJ"):
    np.testing.assert_array_equal(np.asarray(a[k])[m], np.asarray(b[k])[m], err_msg=k)
  np.testing.assert_allclose(np.asarray(a["behavior_topk_logp_BNk"])[m], np.asarray(b["behavior_topk_logp_BNk"])[m],
                             atol=2e-5)


SPEC = dict(spec_gamma=2, spec_draft_layers=1)


@pytest.mark.parametrize("kv", [dict(), dict(spec_layout="rows"), dict(kv_cache="int8"),
                                dict(kv_cache="window", kv_sinks=1, kv_window=6)])
def test_speculative_cached_turns_equal_speculative_reprefilled_turns(kv):
  """Speculative decoding from kept caches (the policy's and the drafter's): every turn draws what a speculative
  re-prefill of the whole episode draws, so the kept caches hold exactly the episode (a token the loop fed past
  a row's end would change every later turn's logits), and the turns report their acceptance."""
  cached = CachedTurns(make_gen(0.8), W)
  cached.slots = 4 * W  # "rows" writes N·(γ + 1) + 1 slots a turn: room for all four turns
  got = play(cached, turns=4, leave_after=1, **SPEC, **kv)
  assert_same(got, play(Reprefill(make_gen(0.8), W), turns=4, leave_after=1, **SPEC, **kv))
  assert cached.prefills == 1 and len(cached.spec) == 4
  assert 0 < np.mean([s["spec_accept_rate"] for s in cached.spec]) < 1  # the drafter both hit and missed


def test_speculative_cached_turns_reprefill_when_slots_run_out():
  cached = CachedTurns(make_gen(0.8), W)
  cached.slots = W + 2 * (3 + 2 + 2) + 4  # room for two turns of N + γ + 2 slots and one observation, not three
  assert_same(play(cached, **SPEC), play(Reprefill(make_gen(0.8), W), **SPEC))
  assert cached.prefills == 2


@pytest.mark.parametrize("kv", [dict(), dict(kv_cache="int8"), dict(kv_cache="window", kv_sinks=1, kv_window=6), SPEC],
                         ids=["full", "int8", "window", "speculative"])
def test_resident_slot_turns_equal_reprefilled_slot_turns(kv):
  """Slots with `env.kv_cache` (`SlotTurns(resident=True)`): a later turn continues its episode's keys/values resident
  in its slot (in the sampler's cache format; a layers drafter's cache too), feeding only the last sampled token and
  the observation, and draws what the same engine draws when it re-prefills every turn. 4 episodes through 4 slots:
  every later turn of a live episode resumes; episode 2 leaves after turn 1 and its slot stays parked, unread."""
  resident = SlotTurns(make_gen(0.8), W, slots=4, chunk=2, resident=True)
  got = play(resident, turns=4, leave_after=1, **kv)
  assert_same(got, play(SlotTurns(make_gen(0.8), W, slots=4, chunk=2), turns=4, leave_after=1, **kv))
  assert resident.prefills == 1 and resident.resumed == 4 + 3 + 3


def test_resident_slots_are_reclaimed_and_reprefill():
  """Fewer slots than episodes: a queued turn takes the least recently parked slot, whose episode's next turn then
  re-prefills; a new version, or a context that no longer extends the slot's (`forget`: an eviction), re-prefills
  too."""
  plain = SlotTurns(make_gen(0.8), W, slots=3, chunk=2)
  resident = SlotTurns(make_gen(0.8), W, slots=3, chunk=2, resident=True)
  assert_same(play(resident), play(plain))
  assert 0 < resident.resumed < 4 + 4 and resident.prefills > plain.prefills / 2

  versions = [(0, PARAMS), (1, bump(PARAMS, jax.random.key(1))), (1, bump(PARAMS, jax.random.key(1)))]
  resident = SlotTurns(make_gen(0.8), W, slots=4, chunk=2, resident=True)
  assert_same(play(resident, versions=versions), play(SlotTurns(make_gen(0.8), W, slots=4, chunk=2),
                                                      versions=versions))
  assert resident.resumed == 4  # turn 1 (a new version) re-prefilled; turn 2 continues it

  class Forgetting(SlotTurns):
    def turn(self, params, version, rows_b, contexts, key, cfg):
      self.forget(1)  # episode 1's context "changed": its next turn re-prefills
      return super().turn(params, version, rows_b, contexts, key, cfg)

  forgetting = Forgetting(make_gen(0.8), W, slots=4, chunk=2, resident=True)
  assert_same(play(forgetting), play(plain))
  assert forgetting.resumed == 3 + 3
