"""Admission: AReaL's capacity numbers, the lag bound over random interleavings, liveness, state."""

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.rollout.admission import Admission


def test_single_worker_matches_areal_formula():
  # One worker, no skipped update: admitted iff accepted + running < (η + v + 1)·B (AReaL).
  B, eta = 2, 1
  a = Admission(B, eta)
  started = 0
  while a.try_start(0):
    a.finish(0)
    started += 1
  assert started == (eta + 0 + 1) * B == 4
  a.set_version(0)
  a.consume(B, 0)  # learner takes a batch at v0 and publishes v1
  assert a.capacity(1) == (eta + 1 + 1) * B - (4 + 0) == 2
  assert a.try_start(1) and a.capacity(1) == 1
  assert a.capacity(0) == a.capacity(1) - B == -1  # a snapshot one version behind gets B fewer slots


def test_out_of_order_finish_cannot_starve_a_slow_rollout():
  # AReaL's plain rule admits Z and W below while X (version 0) is still running; X would then be
  # consumed at version 3 > η = 1. The oldest-running rule refuses them.
  a = Admission(batch_size=1, eta=1)
  assert a.try_start(0)  # X, slow
  assert a.try_start(0)  # Y
  a.finish(0)  # Y done, consumed at v0
  a.set_version(0)
  a.consume(1, 0)
  assert not a.try_start(1)  # AReaL: accepted 1 + running 1 < (1 + 1 + 1)·1 would admit
  a.finish(0)  # X done
  a.consume(1, 1)  # X consumed at v1: lag 1
  assert a.try_start(2)


def test_unbounded_and_max_running():
  a = Admission(batch_size=1, eta=None, max_running=3)
  assert [a.try_start(0) for _ in range(4)] == [True, True, True, False]
  a.finish(0, accepted=False)
  assert a.try_start(0) and a.rejected == 1


def test_finish_of_unknown_rollout_raises():
  a = Admission(batch_size=1, eta=0)
  with pytest.raises(ValueError, match="not running"):
    a.finish(0)
  with pytest.raises(ValueError):
    Admission(batch_size=0, eta=0)


def test_state_roundtrip():
  a = Admission(batch_size=2, eta=1)
  for _ in range(3):
    assert a.try_start(0)
    a.finish(0)
  a.set_version(0)
  a.consume(2, 0)
  b = Admission.from_state(a.state(), batch_size=2, eta=1)
  assert b.state() == a.state() == {"accepted": 3, "rejected": 0, "consumed": 2, "next_version": 1}
  assert b.capacity(1) == a.capacity(1) == (1 + 1 + 1 - 1) * 2 - 1


OPS = st.lists(st.tuples(st.sampled_from(["start", "finish", "learn"]), st.integers(0, 7), st.booleans()),
               min_size=30, max_size=300)


@settings(max_examples=300, deadline=None)
@given(B=st.integers(1, 3), eta=st.integers(0, 3), ops=OPS)
def test_every_consumed_group_has_lag_at_most_eta(B, eta, ops):
  """Random interleavings: stale snapshots, out-of-order finishes, rejections, skipped updates."""
  a = Admission(B, eta)
  version = 0  # learner version == newest published version
  running, fifo = [], collections.deque()  # start versions; buffer in finish order
  consumed = 0
  for op, n, flag in ops:
    if op == "start":
      s = max(0, version - n % 3)  # a worker may hold a snapshot up to 2 versions old
      if a.try_start(s):
        running.append(s)
    elif op == "finish" and running:
      s = running.pop(0 if n == 0 else -1)  # LIFO mostly: old rollouts straggle, later ones overtake
      if flag or n % 4:  # mostly accepted
        fifo.append(s)
        a.finish(s, accepted=True)
      else:
        a.finish(s, accepted=False)
    elif op == "learn":
      a.set_version(version)
      if len(fifo) >= B:
        batch = [fifo.popleft() for _ in range(B)]
        assert all(version - s <= eta for s in batch), (version, batch)
        a.consume(B, version)
        consumed += B
        version += 1 if (flag or n % 3) else 0  # sometimes the update is skipped: no publish
      elif not running:
        # Liveness: a learner short of data with nothing in flight must let the newest version start.
        assert a.capacity(version) > 0
  assert a.accepted - a.consumed == len(fifo) and a.running == len(running) and a.consumed == consumed
