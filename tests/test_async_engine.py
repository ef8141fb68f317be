"""AsyncRollout: lag ≤ η under real threads, no request id lost or duplicated, errors surface, resume."""

import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.rollout import async_engine
from jaxrl_llm.rollout.async_engine import AsyncRollout, make_group_rollout, prompt_for_request
from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout.buffer import group_record
from jaxrl_llm.rollout.generation import Generation
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.sampling import SamplerConfig
from jaxrl_llm.tasks import base, get_task
from jaxrl_llm.tasks import tokenizer as tok

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
G, N = 2, 4


def fake_group(snap, rid: int, delay: float = 0.0) -> Rollout:
  time.sleep(delay)
  z = np.zeros((G, N), np.int32)
  rows = Rollout(sequence_BT=z, positions_BT=z, segment_ids_BT=z, mask_BN=np.ones((G, N), np.float32),
                 behavior_logp_BN=np.zeros((G, N), np.float32), versions_BN=z + snap.version,
                 reward_B=np.zeros(G, np.float32))
  return group_record(rows, request_id=rid, example_id=rid, start_version=snap.version)


def generation(task, examples, width, sc, **kw) -> Generation:
  return Generation(task=task, train_examples=examples, width=width, model_cfg=CFG, sampler_cfg=sc,
                    key_root=jax.random.key(5), seed=3, **kw)


def fake_learner(engine: AsyncRollout, store: ParamStore, steps: int, skip_every: int = 0, sleep=lambda: None):
  """Consumes `steps` batches; publishes after each (except every `skip_every`-th: a skipped update)."""
  version, seen, lags = store.latest_version, [], []
  for t in range(steps):
    groups, stats = engine.next_batch(version, timeout=120.0)
    assert stats["time_learner_idle_s"] >= 0.0 and stats["dropped_stale"] == 0
    seen += [g.stat("request_id") for g in groups]
    lags += [version - g.stat("start_version") for g in groups]
    sleep()
    if not (skip_every and t % skip_every == skip_every - 1):
      version = store.publish({"w": jnp.full((2,), float(version + 1))})
  return seen, lags


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_threads_keep_lag_bound_and_every_request_id(eta):
  rng = random.Random(eta)
  store = ParamStore(keep_last=1)
  store.publish({"w": jnp.zeros(2)})
  engine = AsyncRollout(store, lambda s, r: fake_group(s, r, rng.random() * 0.004), batch_groups=3, eta=eta,
                        num_workers=3, poll_s=0.002)
  with engine:
    seen, lags = fake_learner(engine, store, steps=25, skip_every=4, sleep=lambda: time.sleep(rng.random() * 0.004))
  assert max(lags) <= eta and min(lags) >= 0
  assert len(seen) == len(set(seen)) == 75
  buffered = [g["stats"]["request_id"] for g in engine.buffer.snapshot()["groups"]]
  # Every id handed out was consumed or is still buffered: nothing lost, nothing twice.
  assert sorted(seen + buffered) == list(range(engine.generated)) and engine.state()["retry_request_ids"] == []
  assert engine.admission.running == 0 and not any(t.is_alive() for t in engine._threads)


def test_eta_zero_is_on_policy_and_bounds_buffer():
  store = ParamStore(keep_last=1)
  store.publish({"w": jnp.zeros(2)})
  engine = AsyncRollout(store, fake_group, batch_groups=2, eta=0, num_workers=2, poll_s=0.002)
  with engine:
    seen, lags = fake_learner(engine, store, steps=5)
    time.sleep(0.05)  # workers have had time to overfill, if admission let them
    assert len(engine.buffer) <= 2
  assert lags == [0] * 10


def test_worker_exception_reaches_the_learner():
  store = ParamStore(keep_last=1)
  store.publish({"w": jnp.zeros(2)})

  def broken(snap, rid):
    if rid == 3:
      raise ValueError("reward server down")
    return fake_group(snap, rid)

  engine = AsyncRollout(store, broken, batch_groups=2, eta=3, poll_s=0.002).start()
  with pytest.raises(RuntimeError, match="rollout worker failed") as info:
    for v in range(10):
      engine.next_batch(v, timeout=60.0)
      store.publish({"w": jnp.zeros(2)})
  assert isinstance(info.value.__cause__, ValueError)
  engine.stop()  # already surfaced: stop is clean
  assert 3 in engine.state()["retry_request_ids"]  # the failed request would be redone on resume


def test_unsurfaced_exception_is_raised_by_stop():
  store = ParamStore(keep_last=1)
  store.publish({"w": jnp.zeros(2)})
  engine = AsyncRollout(store, lambda s, r: 1 / 0, batch_groups=1, eta=0).start()
  deadline = time.time() + 60
  while not engine._stop.is_set() and time.time() < deadline:
    time.sleep(0.005)
  with pytest.raises(RuntimeError) as info:
    engine.stop()
  assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_state_resume_continues_request_ids():
  store = ParamStore(keep_last=1)
  store.publish({"w": jnp.zeros(2)})
  engine = AsyncRollout(store, fake_group, batch_groups=2, eta=1, num_workers=2, poll_s=0.002)
  with engine:
    seen, _ = fake_learner(engine, store, steps=3)
  state = engine.state()
  assert state["admission"]["accepted"] - state["admission"]["consumed"] == len(state["buffer"]["groups"])
  resumed = AsyncRollout.from_state(state, store, fake_group, batch_groups=2, eta=1, poll_s=0.002)
  with resumed:
    more, lags = fake_learner(resumed, store, steps=3)
  assert max(lags) <= 1
  buffered = [g["stats"]["request_id"] for g in state["buffer"]["groups"]]
  assert more[:len(buffered[:2])] == buffered[:2]  # the restored FIFO is consumed first
  left = [g["stats"]["request_id"] for g in resumed.buffer.snapshot()["groups"]]
  assert sorted(seen + more + left) == list(range(engine.generated + resumed.generated))


@pytest.fixture(scope="module")
def task_setup():
  task = get_task("arithmetic")
  examples = base.split_examples(task, "train", num_train=20, num_test=5)
  return task, examples


@pytest.mark.parametrize("chunk", [None, 1])
def test_tiny_model_end_to_end(task_setup, chunk):
  task, examples = task_setup
  width = task.max_prompt_len + 1
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(tok.eos_id,), pad_id=tok.pad_id, temperature=1.0)
  params = init_params(CFG, jax.random.key(0))
  store = ParamStore(keep_last=1)
  store.publish(params)
  rollout = make_group_rollout(generation(task, examples, width, sc), group_size=G, store=store, chunk_steps=chunk)
  bump = jax.jit(lambda p, k: jax.tree.map(lambda x: x + 0.05 * jax.random.normal(k, x.shape), p))
  eta = 1
  version, lags, seen = 0, [], []
  with AsyncRollout(store, rollout, batch_groups=2, eta=eta, num_workers=2, poll_s=0.002) as engine:
    for t in range(4):
      groups, _ = engine.next_batch(version, timeout=300.0)
      for g in groups:
        seen.append(g.stat("request_id"))
        lags.append(version - g.stat("start_version"))
        assert g.stat("example_id") == prompt_for_request(examples, g.stat("request_id"), 3)["example_id"]
        assert g.sequence_BT.shape == (G, width + N) and g.reward_B.shape == (G,)
        np.testing.assert_array_equal(g.request_B, [g.stat("request_id")] * G)
        live = g.mask_BN > 0
        v = g.versions_BN
        assert np.all(v[live] >= g.stat("start_version")) and np.all(v[live] <= version)
        assert np.all(np.diff(v, axis=1)[live[:, 1:]] >= 0)  # versions never go back within a sequence
      params = bump(params, jax.random.key(t))
      version = store.publish(params)
  assert max(lags) <= eta and len(set(seen)) == len(seen) == 8
  assert store.held_versions() == [store.latest_version]  # every snapshot pinned by a worker was released


@pytest.mark.parametrize("chunk", [None, 1])
def test_worker_scores_prox_at_each_tokens_version(task_setup, chunk):
  """`score_fn`: the worker's π_old of every token equals the learner scorer at the token's generating version
  (partial rollouts mix versions inside a sequence)."""
  from jaxrl_llm import learner
  task, examples = task_setup
  width = task.max_prompt_len + 1
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(tok.eos_id,), pad_id=tok.pad_id, temperature=1.0)
  score = learner.make_score_fn(CFG, 1.0)
  params = {0: init_params(CFG, jax.random.key(0))}
  store = ParamStore(keep_last=8)
  store.publish(params[0])
  rollout = make_group_rollout(generation(task, examples, width, sc), group_size=G, store=store, chunk_steps=chunk,
                               score_fn=score)
  bump = jax.jit(lambda p, k: jax.tree.map(lambda x: x + 0.05 * jax.random.normal(k, x.shape), p))
  version, checked = 0, 0
  with AsyncRollout(store, rollout, batch_groups=2, eta=2, num_workers=2, poll_s=0.002) as engine:
    for t in range(4):
      groups, _ = engine.next_batch(version, timeout=300.0)
      for g in groups:
        assert g.prox_logp_BN is not None  # every version is still held (keep_last=8)
        seq = (jnp.asarray(g.sequence_BT), jnp.asarray(g.positions_BT), jnp.asarray(g.segment_ids_BT))
        for v in np.unique(g.versions_BN[g.mask_BN > 0]):
          want = np.asarray(score(params[int(v)], *seq, jnp.asarray(g.mask_BN)))
          at = (g.versions_BN == v) & (g.mask_BN > 0)
          np.testing.assert_allclose(g.prox_logp_BN[at], want[at], atol=1e-5)
          checked += int(at.sum())
      params[version + 1] = bump(params[version], jax.random.key(t))
      version = store.publish(params[version + 1])
  assert checked > 0


@pytest.mark.parametrize("at_switch", [False, True])
def test_interruption_route_keeps_old_logits_the_store_dropped(task_setup, at_switch):
  """The missing-old-logits paper's interruption route (`score_at_switch`): with a store that keeps only the newest
  version, partial rollouts spanning versions lose the snapshots of their earlier versions before they finish, so
  the snapshot route (`prox_at_versions`) cannot score them (π_old left to the learner); scored at each switch,
  every group has π_old, equal to the learner's scorer at each token's version. The sequences themselves do not
  depend on the route."""
  from jaxrl_llm import learner
  task, examples = task_setup
  width = task.max_prompt_len + 1
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(), pad_id=tok.pad_id, temperature=1.0)  # full length: switches
  score = learner.make_score_fn(CFG, 1.0)
  params = {0: init_params(CFG, jax.random.key(0))}
  store = ParamStore(keep_last=1)
  store.publish(params[0])
  rollout = make_group_rollout(generation(task, examples, width, sc), group_size=G, store=store, chunk_steps=1,
                               score_fn=score, score_at_switch=at_switch)
  bump = jax.jit(lambda p, k: jax.tree.map(lambda x: x + 0.05 * jax.random.normal(k, x.shape), p))
  snap = store.acquire()  # the admitted version, as a worker holds it

  class Publishing(async_engine.StorePoller):  # publishes a new version before every poll: each chunk switches
    def __call__(self, v):
      if v is not None:
        params[store.latest_version + 1] = bump(params[store.latest_version], jax.random.key(store.latest_version))
        store.publish(params[store.latest_version + 1])
      return super().__call__(v)

  real_poller = async_engine.store_poller
  async_engine.store_poller = Publishing
  try:
    g = rollout(snap, 0)
  finally:
    async_engine.store_poller = real_poller
    store.release(snap)
  live = g.mask_BN > 0
  used = np.unique(g.versions_BN[live])
  assert len(used) >= 3  # the group spans versions the store no longer keeps
  if not at_switch:
    assert g.prox_logp_BN is None  # the snapshot route: an earlier version was freed
    return
  seq = (jnp.asarray(g.sequence_BT), jnp.asarray(g.positions_BT), jnp.asarray(g.segment_ids_BT))
  for v in used:
    want = np.asarray(score(params[int(v)], *seq, jnp.asarray(g.mask_BN)))
    at = (g.versions_BN == v) & live
    np.testing.assert_allclose(g.prox_logp_BN[at], want[at], atol=1e-5)
  assert store.held_versions() == [store.latest_version]  # the route released what it scored with


def test_rollout_key_depends_on_version_and_request():
  root = jax.random.key(0)
  keys = {(v, r): tuple(np.asarray(jax.random.key_data(async_engine.rollout_key(root, v, r))).tolist())
          for v in range(3) for r in range(3)}
  assert len(set(keys.values())) == 9


def test_flush_throws_buffered_groups_away_and_workers_refill_from_the_newest_version():
  """f-OPD's adaptive refresh (`AsyncRollout.flush`), stepped by hand (no threads): the buffered groups of version 0
  are thrown away and counted, their admission budget freed (accepted − consumed = what is buffered), and the next
  batch holds groups started from the newer version only."""
  store = ParamStore(keep_last=2)
  store.publish({"w": jnp.zeros(2)})
  engine = AsyncRollout(store, fake_group, batch_groups=2, eta=2, poll_s=0.002)
  while engine._one_rollout():  # admission fills the buffer as far as η allows
    pass
  old = len(engine.buffer)
  assert old >= 2 and all(g.stat("start_version") == 0 for g in engine.buffer._groups)
  store.publish({"w": jnp.ones(2)})
  assert engine.flush() == old and len(engine.buffer) == 0 and engine.flushed == old
  a = engine.admission.state()
  assert a["accepted"] - a["consumed"] == 0
  assert engine._one_rollout() and engine._one_rollout()
  groups, stats = engine.next_batch(1, timeout=60.0)
  assert [g.stat("start_version") for g in groups] == [1, 1] and stats["flushed"] == old
  assert stats["dropped_stale"] == 0
