"""Async rollouts with continuous batching (`rollout.async_slots`): the slot worker, driven step by step from the
test (no thread timing), against `generate` with the same per-row keys; a publish mid-group (per-token versions,
pins, π_old at each token's version); abandon / resume of in-flight groups; errors; a 2-step run and its resume."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import learner, loop
from jaxrl_llm.config import ConfigError, load_file, validate
from jaxrl_llm.metrics import read_jsonl
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.rollout import collect
from jaxrl_llm.rollout.async_engine import AsyncRollout, prompt_for_request, rollout_key
from jaxrl_llm.rollout.async_slots import slot_worker
from jaxrl_llm.rollout.generation import Generation, request_keys
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.tasks import base, get_task
from jaxrl_llm.tasks import tokenizer as tok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
G, N, SLOTS, CHUNK = 2, 8, 3, 2
# Several stop ids: completions end after 1..N tokens (rows of one group finish in different chunks and slots).
SC = SamplerConfig(max_new_tokens=N, stop_ids=(tok.eos_id, 10, 20, 30, 40), pad_id=tok.pad_id, temperature=1.0)
ROOT_KEY = jax.random.key(5)


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(seed):
  """Weights scaled up from init so next-token distributions are far from uniform (no near-ties)."""
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 3.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(CFG, jax.random.key(seed)))


OLD = random_params(0)
# Differs from OLD in the final norm only, which no cached key or value depends on: a token sampled by NEW after a
# switch (keeping OLD's cache) is exactly a sample of NEW given its prefix, so μ equals the learner's score there.
NEW = {**OLD, "final_norm": OLD["final_norm"] * 1.7}


@pytest.fixture(scope="module")
def gen():
  task = get_task("arithmetic")
  examples = base.split_examples(task, "train", num_train=20, num_test=5)
  return Generation(task=task, train_examples=examples, width=task.max_prompt_len + 1, model_cfg=CFG,
                    sampler_cfg=SC, key_root=ROOT_KEY, seed=3, slots=SLOTS, slot_chunk=CHUNK)


def engine_and_worker(gen, store, *, batch_groups, eta, score_fn=None, **kw):
  """An engine (not started) and its slot worker, which the test steps itself."""
  engine = AsyncRollout(store, None, batch_groups=batch_groups, eta=eta,
                        make_worker=slot_worker(gen, group_size=G, score_fn=score_fn), **kw)
  return engine, engine.new_worker()


def drive(worker, until, max_steps=200):
  for _ in range(max_steps):
    if until():
      return
    worker.step()
  raise AssertionError("the slot worker made no progress")


def test_one_version_equals_generate_with_the_same_row_keys(gen):
  """No publish: every group equals `generate` of its G prompts with the per-row keys
  `request_keys(rollout_key(root, 0, request id), G)` (tokens, layout, rewards; μ up to rounding); every admitted
  id is delivered once; the slot counters reach the batch stats."""
  store = ParamStore(keep_last=1)
  store.publish(OLD)
  B = 5
  engine, worker = engine_and_worker(gen, store, batch_groups=B, eta=0)  # admission: exactly B groups
  drive(worker, lambda: engine.generated == B)
  assert not worker.step() and worker.slots.idle  # admission refuses a sixth group until the learner consumes
  groups, stats = engine.next_batch(0, timeout=1.0)
  assert sorted(g.stat("request_id") for g in groups) == list(range(B))
  lengths = []
  for g in groups:
    rid = g.stat("request_id")
    example = prompt_for_request(gen.train_examples, rid, gen.seed)
    assert g.stat("example_id") == example["example_id"] and g.stat("start_version") == 0
    p = collect.encode_prompts([example] * G, gen.width, gen.encoder)
    ref = jax.device_get(generate(OLD, p.tokens_BP, p.len_B, request_keys(rollout_key(ROOT_KEY, 0, rid), G), CFG, SC))
    for name in ("sequence_BT", "positions_BT", "segment_ids_BT", "mask_BN"):
      np.testing.assert_array_equal(getattr(g, name), ref[name], err_msg=name)
    np.testing.assert_allclose(g.behavior_logp_BN, ref["behavior_logp_BN"], atol=2e-5)
    np.testing.assert_array_equal(g.reward_B, gen.finish(ref, p.examples, np.zeros((G, N), np.int32)).reward_B)
    assert np.all(g.versions_BN == 0) and g.prox_logp_BN is None
    lengths += ref["lengths_B"].tolist()
  assert min(lengths) < N and len(set(lengths)) >= 3, lengths  # rows of unequal length: slots were refilled
  # Column 0 of a row is drawn at its prefill; each later column took one live slot-step.
  assert stats["live_steps"] == sum(lengths) - B * G
  assert stats["live_steps"] <= stats["slot_steps"] and stats["slot_steps"] % SLOTS == 0
  worker.close()
  assert store.held_versions() == [0] and engine.admission.running == 0


def test_publishes_mid_group_record_each_version_and_score_each(gen):
  """Two publishes while groups are in flight: the next chunk decodes with the newest version (keep-cache), tokens
  record it, older snapshots stay pinned (keep_last=1) until the groups whose tokens carry them are recorded, π_old
  is the learner's score at each token's version, μ what really sampled it, and every lag is within η."""
  score = learner.make_score_fn(CFG, 1.0)
  store = ParamStore(keep_last=1)
  store.publish(OLD)
  eta, B = 2, 2
  engine, worker = engine_and_worker(gen, store, batch_groups=B, eta=eta, score_fn=score)
  params = {0: OLD, 1: NEW, 2: {**OLD, "final_norm": OLD["final_norm"] * 0.6}}  # final norms only: see NEW
  worker.step()  # admits 2 groups at version 0 (4 rows, 3 slots) and decodes one chunk
  assert sorted(worker.groups) == [0, 1]
  for v in (1, 2):
    assert store.publish(params[v]) == v
    worker.step()
  assert store.held_versions() == [0, 1, 2]  # 0 and 1 are past keep_last, pinned by the groups in flight
  # Admission allows (η + 1)·B = 6 groups before the learner consumes; take the first 4 delivered.
  drive(worker, lambda: engine.generated >= 4)
  groups = engine.next_batch(2, timeout=1.0)[0] + engine.next_batch(2, timeout=1.0)[0]
  seen = set()
  for g in groups:
    start, live, v = g.stat("start_version"), g.mask_BN > 0, g.versions_BN
    assert 2 - start <= eta and np.all(v[live] >= start) and np.all(v[live] <= 2)
    assert np.all(np.diff(v, axis=1)[live[:, 1:]] >= 0)  # a row's versions never go back
    seen.add(tuple(np.unique(v[live]).tolist()))
    assert g.prox_logp_BN is not None  # every version it used was still held when it was recorded
    seq = (jnp.asarray(g.sequence_BT), jnp.asarray(g.positions_BT), jnp.asarray(g.segment_ids_BT))
    for ver in np.unique(v[live]):
      want = np.asarray(score(params[int(ver)], *seq, jnp.asarray(g.mask_BN)))
      at = live & (v == ver)
      np.testing.assert_allclose(g.prox_logp_BN[at], want[at], atol=1e-5)
      np.testing.assert_allclose(g.behavior_logp_BN[at], want[at], atol=2e-5)  # μ: what really sampled it
      if ver > 0:  # the versions do differ there
        assert np.abs(np.asarray(score(OLD, *seq, jnp.asarray(g.mask_BN)))[at] - want[at]).max() > 1e-3
  # A group with version-1 tokens recorded after the decode moved on to 2: only its own pin kept version 1.
  assert any(1 in s and 2 in s for s in seen), seen
  worker.close()
  assert store.held_versions() == [2] and engine.admission.running == 0


def test_close_abandons_in_flight_groups_and_a_resume_redoes_them(gen):
  store = ParamStore(keep_last=1)
  store.publish(OLD)
  engine, worker = engine_and_worker(gen, store, batch_groups=2, eta=1)
  worker.step()
  in_flight = sorted(worker.groups)
  assert in_flight and engine.generated == 0
  worker.close()  # what the thread does when the engine stops
  assert engine.admission.running == 0 and engine.admission.rejected == len(in_flight)
  assert store.held_versions() == [0] and not worker.groups
  state = engine.state()
  assert state["retry_request_ids"] == in_flight
  resumed = AsyncRollout.from_state(state, store, None, batch_groups=2, eta=1,
                                    make_worker=slot_worker(gen, group_size=G))
  again = resumed.new_worker()
  again.step()  # admits as many groups as before: the redone ids, no new one
  st = resumed.state()
  delivered = [g["stats"]["request_id"] for g in st["buffer"]["groups"]]
  assert sorted(st["retry_request_ids"] + delivered) == in_flight
  assert st["next_request_id"] == state["next_request_id"]
  again.close()


def test_worker_error_surfaces_and_releases_everything(gen):
  """A failing π_old scorer on the worker thread: next_batch raises it; the thread's close abandoned its groups."""
  store = ParamStore(keep_last=1)
  store.publish(OLD)

  def broken(*args):
    raise ZeroDivisionError("scorer down")

  engine = AsyncRollout(store, None, batch_groups=2, eta=1, poll_s=0.002,
                        make_worker=slot_worker(gen, group_size=G, score_fn=broken)).start()
  with pytest.raises(RuntimeError, match="rollout worker failed") as info:
    engine.next_batch(0, timeout=300.0)
  assert isinstance(info.value.__cause__, ZeroDivisionError)
  engine.stop()
  assert engine.admission.running == 0 and store.held_versions() == [0]
  assert engine.state()["retry_request_ids"]  # the failed groups are redone after a resume


def tiny(**over):
  c = load_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.log.tensorboard = False
  c.sft.steps, c.eval.every = 0, 0  # short: these tests check the plumbing, not learning
  for k, v in over.items():
    sec, key = k.split("__")
    c[sec][key] = v
  return c


def test_config_accepts_async_slots_and_names_the_conflicting_field():
  validate(tiny(rollout__mode="async", rollout__slots=4))
  with pytest.raises(ConfigError, match=r"config\.rollout\.num_workers=2"):
    validate(tiny(rollout__mode="async", rollout__slots=4, rollout__num_workers=2))
  with pytest.raises(ConfigError, match=r"config\.rollout\.partial_chunk=2"):
    validate(tiny(rollout__mode="async", rollout__slots=4, rollout__partial_chunk=2))
  agent = load_file(os.path.join(ROOT, "configs", "agent_tiny.py"))
  agent.rollout.mode, agent.rollout.slots = "async", 4
  with pytest.raises(ConfigError, match=r"config\.rollout\.slots=4.*episodes"):
    validate(agent)


@pytest.mark.slow  # two short runs: ~30 s on one core
def test_async_run_with_slots_trains_and_resumes(tmp_path):
  """Two async steps with 4 slots, then a resume to step 4: every step trains, lags ≤ η, no request is consumed
  twice, and the slot counters are in the metrics."""
  c = tiny(rollout__mode="async", rollout__lag=1, rollout__slots=4, rollout__slot_chunk=2)
  c.loss.entropy_coef = 0.01  # a gradient even when every reward of a group is equal
  c.checkpoint.every, c.num_steps = 2, 2
  d = str(tmp_path / "run")
  assert len(loop.run(c, d)) == 2
  c.num_steps = 4
  assert len(loop.run(c, d)) == 2
  rows = read_jsonl(os.path.join(d, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(4))
  ids = [i for r in rows for i in r["request_ids"]]
  assert len(ids) == len(set(ids)) == 4 * c.rollout.prompts_per_step, "a request was consumed twice"
  assert all(r["lag_max"] <= 1 and np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
  assert all(0 < r["async_slot_live_steps"] <= r["async_slot_steps"] for r in rows[:1])
  assert all(r["async_slot_steps"] % 4 == 0 for r in rows)
