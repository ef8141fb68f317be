"""Buffer: FIFO order, stale groups dropped and counted, blocking wait, snapshot/restore, collate."""

import threading

import numpy as np

from jaxrl_llm.rollout.buffer import Buffer, Trajectory, collate, lag

G, T, N = 2, 5, 3


def group(rid: int, version: int, versions_GN=None) -> Trajectory:
  r = np.random.default_rng(rid)
  return Trajectory(
      request_id=rid, group_id=100 + rid, start_version=version,
      sequence_GT=r.integers(0, 9, (G, T)).astype(np.int32), positions_GT=np.tile(np.arange(T, dtype=np.int32), (G, 1)),
      segment_ids_GT=np.ones((G, T), np.int32), tokens_GN=r.integers(0, 9, (G, N)).astype(np.int32),
      mask_GN=np.ones((G, N), np.float32), behavior_logp_GN=-r.random((G, N)).astype(np.float32),
      versions_GN=np.full((G, N), version, np.int32) if versions_GN is None else versions_GN,
      reward_G=r.random(G).astype(np.float32), prompt={"prompt": f"p{rid}", "answer": "1", "example_id": 100 + rid})


def test_fifo_and_partial_availability():
  b = Buffer()
  for rid in range(3):
    b.put(group(rid, 0))
  got, dropped = b.get_batch(2, learner_version=0, eta=0)
  assert [g.request_id for g in got] == [0, 1] and dropped == 0
  assert b.get_batch(2, 0, 0) == (None, 0)  # only one left: nothing taken
  assert len(b) == 1


def test_stale_groups_are_dropped_and_counted():
  b = Buffer()
  for rid, v in enumerate([0, 2, 1, 3, 3]):
    b.put(group(rid, v))
  got, dropped = b.get_batch(2, learner_version=3, eta=1)  # versions 0 and 1 have lag 3, 2 > η
  assert dropped == 2 and b.dropped == 2
  assert [g.request_id for g in got] == [1, 3]
  assert [lag(g, 3) for g in got] == [1, 0]
  got, _ = b.get_batch(1, 3, None)  # η None: nothing is stale
  assert got[0].request_id == 4


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
  assert sorted(g.request_id for g in got) == sorted(10 * k + i for k in range(4) for i in range(10))
  for k in range(4):  # each producer's groups stay in its put order
    mine = [g.request_id for g in got if g.request_id // 10 == k]
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
  for name in Trajectory._fields:
    np.testing.assert_array_equal(np.asarray(getattr(x[0], name), dtype=object),
                                  np.asarray(getattr(y[0], name), dtype=object))


def test_collate_layout():
  versions = np.array([[1, 1, 2], [1, 2, 2]], np.int32)  # a partial rollout across a publish
  gs = [group(7, 1, versions), group(8, 2)]
  out = collate(gs, learner_version=3)
  np.testing.assert_array_equal(out["group_id_B"], [0, 0, 1, 1])
  np.testing.assert_array_equal(out["lag_B"], [2, 2, 1, 1])
  np.testing.assert_array_equal(out["request_id_B"], [7, 7, 8, 8])
  np.testing.assert_array_equal(out["versions_BN"][:2], versions)
  np.testing.assert_array_equal(out["reward_B"], np.concatenate([gs[0].reward_G, gs[1].reward_G]))
  assert out["sequence_BT"].shape == (4, T) and out["mask_BN"].shape == (4, N)
