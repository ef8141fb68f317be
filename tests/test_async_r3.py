"""MoE routing replay (R3) in async mode: partial rollouts return routes, trajectories carry them through
the buffer (and old checkpoints without them), and the learner's replayed recompute equals the behaviour."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import learner, loop
from jaxrl_llm.config import load_file
from jaxrl_llm.models import ModelConfig, hidden_with_routing, init_params
from jaxrl_llm.rollout.async_engine import make_group_rollout
from jaxrl_llm.rollout.generation import Generation
from jaxrl_llm.rollout.buffer import Buffer, collate
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.sampling import partial
from jaxrl_llm.tasks import base, get_task
from jaxrl_llm.tasks import tokenizer as tok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=32,
                  num_experts=4, experts_per_token=2, max_seq_len=32)
B, P, N = 4, 5, 8
SC = SamplerConfig(max_new_tokens=N, stop_ids=(2,), temperature=1.0)
PROMPTS = jax.random.randint(jax.random.key(1), (B, P), 4, 64)
PROMPT_LEN = jnp.array([5, 2, 3, 4])
KEY = jax.random.key(7)


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(seed):
  """Init scaled up (norms excepted) so routing and next-token distributions are far from uniform."""
  f = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 5.0 * x
  return jax.tree_util.tree_map_with_path(f, init_params(CFG, jax.random.key(seed)))


OLD, NEW = random_params(0), random_params(1)


def switch_once(version, params):
  """A poll that offers (version, params) at its first call, then nothing."""
  calls = []

  def poll(current):
    calls.append(current)
    return (version, params) if len(calls) == 1 else None

  return poll


def native_routes(params, out):
  """Expert ids a full forward of `params` picks for every fed token (the learner's native routing)."""
  _, routing = hidden_with_routing(params, out["sequence_BT"][:, :-1], CFG, positions_BT=out["positions_BT"][:, :-1],
                                   segment_ids_BT=out["segment_ids_BT"][:, :-1])
  return np.asarray(routing["routes_BTLk"])


def replay_logp(params, out):
  score = learner.make_score_fn(CFG, SC.temperature)
  return np.asarray(score(params, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], out["mask_BN"],
                          out["routes_BTLk"]))


@pytest.mark.parametrize("chunk", [1, 3])
def test_chunked_routes_with_one_version_equal_one_shot(chunk):
  ref = generate(OLD, PROMPTS, PROMPT_LEN, KEY, CFG, SC)
  out = partial.generate_partial(0, OLD, lambda v: None, PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=chunk)
  assert out["routes_BTLk"].shape == (B, P + N, CFG.n_layers, 2) and out["routes_BTLk"].dtype == jnp.int32
  for name, value in ref.items():  # routes included: every slot, fed or not
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(value), err_msg=name)
  assert float(ref["mask_BN"].sum()) > 2 * B  # decode steps were taken, not only the first token


def _switched(reprefill: bool):
  out = partial.generate_partial(0, OLD, switch_once(1, NEW), PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=3,
                                 reprefill=reprefill)
  ref = generate(OLD, PROMPTS, PROMPT_LEN, KEY, CFG, SC)  # the same key: equal up to the switch
  real = np.asarray(out["segment_ids_BT"][:, :-1]) > 0
  return out, ref, real


def test_switch_keeping_cache_keeps_old_routes_for_earlier_tokens():
  out, ref, real = _switched(reprefill=False)
  routes, old = np.asarray(out["routes_BTLk"]), np.asarray(ref["routes_BTLk"])
  # Slots fed before the switch (prompt + columns 0, 1) were routed by version 0 and stay so.
  np.testing.assert_array_equal(routes[:, :P + 2], old[:, :P + 2])
  # Later slots were fed by version 1 (over version 0's cached keys/values): new routes appear there.
  assert np.any((routes[:, P + 2:-1] != old[:, P + 2:-1])[real[:, P + 2:]])
  np.testing.assert_array_equal(routes[:, -1], np.broadcast_to(np.arange(2), routes[:, -1].shape))  # never fed


def test_switch_with_reprefill_routes_are_the_new_versions_and_replay_exactly():
  out, _, real = _switched(reprefill=True)
  routes = np.asarray(out["routes_BTLk"])
  # After a reprefill every fed slot holds version 1's routing of its prefix: a full forward of NEW.
  np.testing.assert_array_equal(routes[:, :-1][real], native_routes(NEW, out)[real])
  np.testing.assert_array_equal(routes[:, -1], np.broadcast_to(np.arange(2), routes[:, -1].shape))
  after = (np.asarray(out["mask_BN"]) > 0) & (np.asarray(out["versions_BN"]) == 1)
  assert after.sum() >= B
  np.testing.assert_allclose(replay_logp(NEW, out)[after], np.asarray(out["behavior_logp_BN"])[after], atol=2e-5)


@pytest.fixture(scope="module")
def task_setup():
  task = get_task("arithmetic")
  return task, base.split_examples(task, "train", num_train=20, num_test=5)


@pytest.mark.parametrize("chunk", [None, 2])
def test_group_rollout_carries_routes_through_buffer_and_collate(task_setup, chunk):
  task, examples = task_setup
  width, G = task.max_prompt_len + 1, 3
  cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size, max_seq_len=width + 4)
  sc = SamplerConfig(max_new_tokens=4, stop_ids=(tok.eos_id,), pad_id=tok.pad_id, temperature=1.0)
  store = ParamStore(keep_last=1)
  store.publish(init_params(cfg, jax.random.key(0)))
  gen = Generation(task=task, train_examples=examples, width=width, model_cfg=cfg, sampler_cfg=sc,
                   key_root=jax.random.key(5), seed=3)
  kw = dict(group_size=G, store=store, chunk_steps=chunk)
  snap = store.acquire()
  try:
    groups = [make_group_rollout(dataclasses.replace(gen, keep_routes=True), **kw)(snap, rid) for rid in range(2)]
    plain = make_group_rollout(gen, **kw)(snap, 0)
  finally:
    store.release(snap)
  g = groups[0]
  assert g.routes_BTLk.shape == (G, width + 4, cfg.n_layers, 2) and plain.routes_BTLk is None
  # The sampler's routes are what the learner would route natively on the fed real tokens (fp32, one version).
  _, routing = hidden_with_routing(snap.params, g.sequence_BT[:, :-1], cfg, positions_BT=g.positions_BT[:, :-1],
                                   segment_ids_BT=g.segment_ids_BT[:, :-1])
  real = g.segment_ids_BT[:, :-1] > 0
  np.testing.assert_array_equal(np.asarray(routing["routes_BTLk"])[real], g.routes_BTLk[:, :-1][real])
  # Buffer snapshot / restore (the async checkpoint) keeps them; collate hands them to the learner batch.
  restored = Buffer.restore(Buffer(groups).snapshot())
  batch = collate(restored.get_batch(2, 0, None)[0], 0)
  np.testing.assert_array_equal(batch.routes_BTLk, np.concatenate([x.routes_BTLk for x in groups]))
  assert collate([plain, groups[1]], 0).routes_BTLk is None  # a group without routes: the batch routes natively
  # A checkpoint written before R3 and before the record in async mode (Trajectory fields, no routes) still loads.
  old = {"request_id": 0, "group_id": 1, "start_version": 0, "reward_errors": 0, "sequence_GT": plain.sequence_BT,
         "positions_GT": plain.positions_BT, "segment_ids_GT": plain.segment_ids_BT, "mask_GN": plain.mask_BN,
         "behavior_logp_GN": plain.behavior_logp_BN, "versions_GN": plain.versions_BN, "reward_G": plain.reward_B}
  assert Buffer.restore({"groups": [old], "dropped": 0}).get_batch(1, 0, None)[0][0].routes_BTLk is None


def _moe_tiny():
  c = load_file(os.path.join(ROOT, "configs", "moe_tiny.py"))
  c.log.tensorboard = False
  return c


def test_async_moe_run_replays_sampler_routes(tmp_path, monkeypatch):
  """Mirror of the sync-mode check: sampler and learner in fp32, π_old recomputed at the generating version
  with the replayed routes equals the behaviour log-prob (`mismatch_abs_max` is |π_old − μ| over the batch)."""
  seen = []
  make_batch = loop.make_batch

  def spy(run, store, state, extra, ro):
    batch, info = make_batch(run, store, state, extra, ro)
    seen.append((ro.routes_BTLk, batch.routes_BTLk, ro.sequence_BT.shape))
    return batch, info

  monkeypatch.setattr(loop, "make_batch", spy)
  c = _moe_tiny()
  c.rollout.mode, c.rollout.lag = "async", 1
  c.rollout.weight_sync = "sparse"  # also: sparse publishes while the worker thread acquires snapshots
  c.num_steps, c.eval.every = 3, 0
  rows = loop.run(c, str(tmp_path))
  assert len(rows) == 3 and len(seen) == 3
  for routes, batch_routes, (Bn, T) in seen:
    assert routes is not None and routes.shape == (Bn, T, c.model.n_layers, c.model.experts_per_token)
    np.testing.assert_array_equal(np.asarray(batch_routes), routes)
  for r in rows:
    assert r["mismatch_abs_max"] < 2e-5 and "sync_payload_ratio" in r
  assert max(r["lag_max"] for r in rows) <= 1


@pytest.mark.parametrize("over", [{"env.kv_cache": True}, {"rollout.slots": 4},
                                  {"rollout.slots": 4, "env.kv_cache": False},
                                  {"env.kv_cache": False, "env.evict": "drop_oldest", "env.context_budget": 8}],
                         ids=["kept_cache", "resident_slots", "slots", "reprefill_evicting"])
def test_moe_episodes_replay_the_sampler_routes(tmp_path, over):
  """MoE episodes (routing replay): each row carries every token's routes from where a turn sampler fed it (the
  kept cache, the slot engine continuing an episode resident in its slot or re-prefilling each turn, a re-prefill of
  an evicted context), so the learner's π_old, replaying them, equals μ at every policy token (sync: one version).
  Replaying routes in the wrong order misses by ~1e-2 here."""
  c = load_file(os.path.join(ROOT, "configs", "agent_tiny.py"))
  c.log.tensorboard = False
  c.sft.steps, c.eval.every, c.num_steps = 0, 0, 2
  c.model.num_experts, c.model.experts_per_token = 4, 2
  for k, v in over.items():
    sec, key = k.split(".")
    c[sec][key] = v
  rows = loop.run(c, str(tmp_path))
  assert all(r["mismatch_abs_max"] < 1e-5 and r["env_turns_mean"] > 1 for r in rows), rows
  assert np.isfinite(rows[-1]["loss"])
  if "rollout.slots" in over:  # later turns continue their slot's routes with `env.kv_cache` (default), else not
    assert (sum(r["env_slot_resumes"] for r in rows) > 0) == over.get("env.kv_cache", True), rows
