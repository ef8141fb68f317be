"""Buffer: FIFO order, stale groups dropped and counted, blocking wait, snapshot/restore, collate."""

import threading

import numpy as np

from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout.buffer import Buffer, collate, group_record, lag

G, T, N = 2, 5, 3


def group(rid: int, version: int, versions_GN=None) -> Rollout:
  r = np.random.default_rng(rid)
  rows = Rollout(
      sequence_BT=r.integers(0, 9, (G, T)).astype(np.int32), positions_BT=np.tile(np.arange(T, dtype=np.int32), (G, 1)),
      segment_ids_BT=np.ones((G, T), np.int32), mask_BN=np.ones((G, N), np.float32),
      behavior_logp_BN=-r.random((G, N)).astype(np.float32),
      versions_BN=np.full((G, N), version, np.int32) if versions_GN is None else versions_GN,
      reward_B=r.random(G).astype(np.float32))
  return group_record(rows, request_id=rid, example_id=100 + rid, start_version=version, reward_errors=rid % 2)


def request_id(g: Rollout) -> int:
  return g.stat("request_id")


def test_fifo_and_partial_availability():
  b = Buffer()
  for rid in range(3):
    b.put(group(rid, 0))
  got, dropped = b.get_batch(2, learner_version=0, eta=0)
  assert [request_id(g) for g in got] == [0, 1] and dropped == 0
  assert b.get_batch(2, 0, 0) == (None, 0)  # only one left: nothing taken
  assert len(b) == 1


def test_stale_groups_are_dropped_and_counted():
  b = Buffer()
  for rid, v in enumerate([0, 2, 1, 3, 3]):
    b.put(group(rid, v))
  got, dropped = b.get_batch(2, learner_version=3, eta=1)  # versions 0 and 1 have lag 3, 2 > η
  assert dropped == 2 and b.dropped == 2
  assert [request_id(g) for g in got] == [1, 3]
  assert [lag(g, 3) for g in got] == [1, 0]
  got, _ = b.get_batch(1, 3, None)  # η None: nothing is stale
  assert request_id(got[0]) == 4


def test_wait_blocks_until_enough_groups():
  b = Buffer()
  assert not b.wait(1, timeout=0.01)
  t = threading.Thread(target=lambda: [b.put(group(i, 0)) for i in range(2)])
  t.start()
  assert b.wait(2, timeout=30.0)
  t.join()


def test_concurrent_producers_lose_and_duplicate_nothing():
  b = Buffer()
  threads = [threading.Thread(target=lambda k=k: [b.put(group(10 * k + i, 0)) for i in range(10)]) for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  got, _ = b.get_batch(40, 0, 0)
  assert sorted(request_id(g) for g in got) == sorted(10 * k + i for k in range(4) for i in range(10))
  for k in range(4):  # each producer's groups stay in its put order
    mine = [request_id(g) for g in got if request_id(g) // 10 == k]
    assert mine == sorted(mine)


def test_snapshot_restore_roundtrip():
  b = Buffer()
  for rid, v in enumerate([0, 1, 1]):
    b.put(group(rid, v))
  b.get_batch(1, learner_version=2, eta=1)  # drops group 0 (lag 2), takes group 1
  c = Buffer.restore(b.snapshot())
  assert c.dropped == b.dropped == 1
  x, _ = b.get_batch(1, 1, 1)
  y, _ = c.get_batch(1, 1, 1)
  assert x[0].arrays().keys() == y[0].arrays().keys() and x[0].stats == y[0].stats
  for name, v in x[0].arrays().items():
    np.testing.assert_array_equal(v, getattr(y[0], name), err_msg=name)


def test_restore_reads_groups_of_checkpoints_written_before_the_record():
  g = group(5, 2)
  old = {"request_id": 5, "group_id": 105, "start_version": 2, "reward_errors": 1, "prompt": {"prompt": "p5"},
         "sequence_GT": g.sequence_BT, "positions_GT": g.positions_BT, "segment_ids_GT": g.segment_ids_BT,
         "tokens_GN": g.sequence_BT[:, -N:], "mask_GN": g.mask_BN, "behavior_logp_GN": g.behavior_logp_BN,
         "versions_GN": g.versions_BN, "reward_G": g.reward_B, "routes_GTLk": None, "prox_logp_GN": None}
  (got,), _ = Buffer.restore({"groups": [old], "dropped": 0}).get_batch(1, 2, None)
  assert got.stats == g.stats and lag(got, 4) == 2
  for name, v in g.arrays().items():
    np.testing.assert_array_equal(getattr(got, name), v, err_msg=name)


def test_collate_layout():
  versions = np.array([[1, 1, 2], [1, 2, 2]], np.int32)  # a partial rollout across a publish
  gs = [group(7, 1, versions), group(8, 2)]
  out = collate(gs, learner_version=3)
  np.testing.assert_array_equal(out.group_B, [0, 0, 1, 1])
  np.testing.assert_array_equal(out.lag_B, [2, 2, 1, 1])
  np.testing.assert_array_equal(out.request_B, [7, 7, 8, 8])
  np.testing.assert_array_equal(out.versions_BN[:2], versions)
  np.testing.assert_array_equal(out.reward_B, np.concatenate([gs[0].reward_B, gs[1].reward_B]))
  assert out.sequence_BT.shape == (4, T) and out.mask_BN.shape == (4, N)
  assert out.stats == {"reward_errors": 1}  # group 7's one failed reward call
