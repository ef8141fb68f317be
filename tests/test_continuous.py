"""Continuous batching (`sampling.continuous`): per request the same tokens and μ as `generate` with the same
per-request keys, whatever the slot count; a publish between chunks; a loop run with `rollout.slots` on."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import ConfigError, load_file, validate
from jaxrl_llm.metrics import read_jsonl
from jaxrl_llm.models import ModelConfig, init_params, token_logprobs
from jaxrl_llm.sampling import SamplerConfig, continuous, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
R, P, N = 9, 5, 12
# Several stop ids of a 32-token vocabulary: completions end early for some requests, run to N for others.
SC = SamplerConfig(max_new_tokens=N, stop_ids=(2, 3), temperature=1.0)
PROMPTS = np.asarray(jax.random.randint(jax.random.key(1), (R, P), 4, 32))
PROMPT_LEN = np.array([5, 2, 3, 1, 4, 5, 2, 3, 5])
KEYS = jax.random.split(jax.random.key(3), R)


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(seed):
  """Weights scaled up from init so next-token distributions are far from uniform."""
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 3.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(CFG, jax.random.key(seed)))


OLD = random_params(0)


@functools.partial(jax.jit, static_argnums=(4,))
def _score(params, seq_BT, positions_BT, segment_ids_BT, temperature):
  return token_logprobs(params, seq_BT[:, :-1], seq_BT[:, 1:], CFG, positions_BT=positions_BT[:, :-1],
                        segment_ids_BT=segment_ids_BT[:, :-1], temperature=temperature)["logp_BT"][:, P - 1:]


def learner_logp(params, out, sc):
  """Learner scores of the completion tokens given their prefix (recipe of the `generate` docstring)."""
  return np.asarray(_score(params, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], sc.temperature))


@pytest.mark.parametrize("slots,chunk,sc", [
    (3, 2, SC), (4, 5, SamplerConfig(max_new_tokens=N, stop_ids=(2, 3), temperature=0.7, top_k=8)),
    # compressed caches: the cache format is a property of the one cache layer both loops use
    (3, 2, SamplerConfig(max_new_tokens=N, stop_ids=(2, 3), temperature=1.0, kv_cache="int8")),
    (4, 3, SamplerConfig(max_new_tokens=N, stop_ids=(2, 3), temperature=1.0, kv_cache="window", kv_sinks=1,
                         kv_window=3)),
    # μ's records: each row's from its own key, as generate records them given per-row keys
    (3, 2, SamplerConfig(max_new_tokens=N, stop_ids=(2, 3), temperature=0.9, behavior_topk=3, mc_samples=3))])
def test_per_request_equals_static_path_with_the_same_keys(slots, chunk, sc):
  ref = jax.device_get(generate(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, sc))
  lengths = ref["lengths_B"]
  assert lengths.min() <= 3 and lengths.max() == N and len(set(lengths.tolist())) >= 4, lengths  # a long tail
  out = continuous.generate_slots(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, sc, slots=slots, chunk=chunk)
  for name in ("tokens_BN", "mask_BN", "lengths_B", "finished_B", "sequence_BT", "positions_BT", "segment_ids_BT",
               "completion_mask_BT"):
    np.testing.assert_array_equal(out[name], ref[name], err_msg=name)
  np.testing.assert_allclose(out["behavior_logp_BN"], ref["behavior_logp_BN"], atol=2e-5)
  if not sc.truncated and sc.kv_cache == "full":  # μ is the full tempered distribution's: the learner's scores
    np.testing.assert_allclose(out["behavior_logp_BN"] * out["mask_BN"], learner_logp(OLD, out, sc) * out["mask_BN"],
                               atol=2e-5)
  if sc.kv_cache != "full":  # μ is the compressed cache's policy, not the learner's
    assert np.abs((out["behavior_logp_BN"] - learner_logp(OLD, out, sc)) * out["mask_BN"]).max() > 1e-4
  if sc.kv_cache == "window":
    np.testing.assert_array_equal(out["kv_window_B2"], ref["kv_window_B2"])
  if sc.records:
    m = ref["mask_BN"] > 0
    for name in ("behavior_topk_ids_BNk", "mc_ids_BNJ"):
      np.testing.assert_array_equal(out[name], ref[name], err_msg=name)
    for name in ("behavior_topk_logp_BNk", "mc_behavior_logp_BNJ"):
      np.testing.assert_allclose(out[name], ref[name], atol=2e-5, err_msg=name)
    np.testing.assert_array_equal(out["mc_ids_BNJ"][..., 0][m], out["tokens_BN"][m])  # column 0: the sampled token
    assert (out["mc_ids_BNJ"][..., 1:][m] != out["mc_ids_BNJ"][..., :1][m]).any()  # real draws, not copies
  assert np.all(out["versions_BN"] == 0)
  # Every sampled column after column 0 (drawn at prefill) took one live slot-step; the rest were wasted.
  assert out["live_steps"] == int(lengths.sum()) - R
  assert out["live_steps"] <= out["slot_steps"] and out["slot_steps"] % slots == 0


def test_generate_with_one_key_per_row_draws_each_row_alone():
  """`generate` given one key per row: each row's tokens and μ equal a batch of that row alone with its key."""
  out = jax.device_get(generate(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, SC))
  for r in (0, 4, 7):
    one = jax.device_get(generate(OLD, PROMPTS[r:r + 1], PROMPT_LEN[r:r + 1], KEYS[r:r + 1], CFG, SC))
    np.testing.assert_array_equal(one["tokens_BN"][0], out["tokens_BN"][r])
    np.testing.assert_allclose(one["behavior_logp_BN"][0], out["behavior_logp_BN"][r], atol=2e-5)
  rec = SamplerConfig(max_new_tokens=N, stop_ids=(2, 3), behavior_topk=2, mc_samples=2)  # records: per row too
  out = jax.device_get(generate(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, rec))
  one = jax.device_get(generate(OLD, PROMPTS[4:5], PROMPT_LEN[4:5], KEYS[4:5], CFG, rec))
  for name in ("mc_ids_BNJ", "behavior_topk_ids_BNk"):
    np.testing.assert_array_equal(one[name][0], out[name][4], err_msg=name)


def test_tokens_depend_on_the_request_key_only():
  """A request keeps its tokens when its neighbours change (other prompts, other keys, other order)."""
  out = continuous.generate_slots(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, SC, slots=3, chunk=2)
  order = np.array([4, 0, 8, 2])
  sub = continuous.generate_slots(OLD, PROMPTS[order], PROMPT_LEN[order], KEYS[order], CFG, SC, slots=3, chunk=2)
  np.testing.assert_array_equal(sub["tokens_BN"], out["tokens_BN"][order])
  other = continuous.generate_slots(OLD, PROMPTS, PROMPT_LEN, jax.random.split(jax.random.key(4), R), CFG, SC,
                                    slots=3, chunk=2)
  assert not np.array_equal(other["tokens_BN"], out["tokens_BN"])


def test_host_keys_stack_to_the_device_keys():
  """`host_key_rows` reads typed keys (threefry and rbg) and raw uint32 keys once; an admission's stack of them
  is the device keys bit for bit, also mixed with device keys; and generate_slots given raw keys draws the same
  tokens as given their typed twins (the same threefry bits)."""
  rbg = jax.random.split(jax.random.key(5, impl="rbg"), 4)
  bits = lambda k: np.asarray(k if k.dtype == jnp.uint32 else jax.random.key_data(k))
  for keys in (KEYS[:4], jax.random.key_data(KEYS[:4]), rbg):
    rows = continuous.host_key_rows(keys)
    got = continuous._stack_keys([rows[2], rows[0], rows[2]])
    assert got.dtype == keys.dtype
    np.testing.assert_array_equal(bits(got), bits(keys)[[2, 0, 2]])
    mixed = continuous._stack_keys([rows[1], keys[3]])
    assert mixed.dtype == keys.dtype
  raw = continuous.generate_slots(OLD, PROMPTS, PROMPT_LEN, np.asarray(jax.random.key_data(KEYS)), CFG, SC, slots=3,
                                  chunk=2)
  typed = continuous.generate_slots(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, SC, slots=3, chunk=2)
  np.testing.assert_array_equal(raw["tokens_BN"], typed["tokens_BN"])


def test_publish_between_chunks_switches_version_and_scoring():
  """A newer version handed at the first boundary: the first chunk's tokens keep version 0 and μ of OLD, every
  later token carries version 1 and μ of NEW. NEW differs from OLD in the final norm only, which no cached key or
  value depends on, so the learner's full forward under NEW scores exactly what the engine sampled from."""
  new = {**OLD, "final_norm": OLD["final_norm"] * 1.7}
  calls = []

  def poll(version):
    calls.append(version)
    return (1, new) if len(calls) == 1 else None

  chunk, slots = 3, 3
  out = continuous.generate_slots(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, SC, slots=slots, chunk=chunk, poll=poll)
  mask, versions = out["mask_BN"] > 0, out["versions_BN"]
  assert calls[:2] == [0, 1]
  # The first `slots` requests: column 0 (prefill) and `chunk` decode steps with OLD, the rest with NEW.
  for r in range(slots):
    n = int(mask[r].sum())
    np.testing.assert_array_equal(versions[r][:n], (np.arange(n) > chunk).astype(np.int32))
  assert np.all(versions[slots:][mask[slots:]] == 1)
  assert (versions[mask] == 0).any() and (versions[mask] == 1).any()
  logp_old, logp_new = learner_logp(OLD, out, SC), learner_logp(new, out, SC)
  mu = out["behavior_logp_BN"]
  np.testing.assert_allclose(mu[mask & (versions == 0)], logp_old[mask & (versions == 0)], atol=2e-5)
  np.testing.assert_allclose(mu[mask & (versions == 1)], logp_new[mask & (versions == 1)], atol=2e-5)
  assert np.abs(logp_old - logp_new)[mask & (versions == 1)].max() > 1e-3  # the two versions do differ there


def test_unsupported_settings_raise():
  with pytest.raises(ValueError, match="spec_layout='min'"):  # the slots share one write index
    continuous.generate_slots(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, SamplerConfig(
        max_new_tokens=N, spec_gamma=2, spec_draft_layers=1, spec_layout="rows"), slots=2, chunk=2)
  with pytest.raises(ValueError, match="slots"):
    continuous.generate_slots(OLD, PROMPTS, PROMPT_LEN, KEYS, CFG, SC, slots=0, chunk=2)


def tiny(**over):
  c = load_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.log.tensorboard = False
  c.sft.steps, c.eval.every = 20, 100  # short: these tests check layouts and resumes, not learning
  for k, v in over.items():
    sec, key = k.split("__")
    c[sec][key] = v
  return c


@pytest.mark.parametrize("field,value,match", [("slots", -1, "rollout.slots"), ("slot_chunk", 0, "rollout.slot_chunk")])
def test_config_refuses_bad_slot_fields(field, value, match):
  with pytest.raises(ConfigError, match=match):
    validate(tiny(**{f"rollout__{field}": value}))


def test_config_takes_slots_with_records():  # harness with slots: tests/test_serve.py; async: test_async_slots.py
  validate(tiny(rollout__slots=4, sampler__behavior_topk=4, sampler__mc_samples=2))


def test_sync_loop_with_slots_trains_with_the_same_record_layout(tmp_path):
  """Two sync steps with continuous batching: finite losses, and the metrics rows carry the static run's fields
  and the slot counters of each row's sampler call (4 slots, 3 decode steps a chunk)."""
  static, slots = tiny(), tiny(rollout__slots=4, rollout__slot_chunk=3)
  for c in (static, slots):
    c.num_steps, c.loss.entropy_coef = 2, 0.01  # a gradient even when every reward of a group is equal
  a = loop.run(static, str(tmp_path / "static"))
  b = loop.run(slots, str(tmp_path / "slots"))
  assert [sorted(r) for r in b] == [sorted({*r, "slot_steps", "slot_live_steps"}) for r in a]
  assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in b)
  B = slots.rollout.prompts_per_step * slots.rollout.group_size
  # every column of a request but the first (drawn at admission, from the prefill's logits) is one live slot-step
  lengths = [(r["completion_len"] - 1) * B for r in b]
  for r, n in zip(b, lengths):
    assert r["slot_live_steps"] == pytest.approx(n, abs=1e-3) and r["slot_live_steps"] <= r["slot_steps"]
    assert r["slot_steps"] % 4 == 0  # S slots per decode step


@pytest.mark.slow  # three short runs: ~40 s on one core
def test_fixed_lag_with_slots_resumes_exactly(tmp_path):
  """fixed_lag (k = 1) with slots: a run stopped after 2 steps and continued to 3 equals the uninterrupted one."""
  c = tiny(rollout__mode="fixed_lag", rollout__lag=1, rollout__slots=3, rollout__slot_chunk=2, optim__lr=1e-2,
           optim__warmup_steps=0)
  c.loss.entropy_coef = 0.01
  c.num_steps = 3
  whole = loop.run(c, str(tmp_path / "whole"))
  c.num_steps = 2
  loop.run(c, str(tmp_path / "split"))
  c.num_steps = 3
  loop.run(c, str(tmp_path / "split"))
  # A run's last step also evaluates: the split run's step 1 row carries eval fields the whole run's lacks.
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time_", "eval_"))} for r in rows]
  assert all(r["grad_norm"] > 0 for r in whole)
  assert strip(read_jsonl(str(tmp_path / "split" / "metrics.jsonl"))) == strip(whole)


def test_a_group_shares_its_prefill_and_keeps_its_tokens():
  """Requests with one prompt (a GRPO group, admitted together) are prefilled once: the same tokens and μ as
  `generate` prefilling every row, and the distinct-prompt map the engine uses."""
  G = 3
  prompts, lens = np.repeat(PROMPTS[:3], G, 0), np.repeat(PROMPT_LEN[:3], G)
  firsts, src = continuous._distinct_prompts(prompts[:4], lens[:4])
  assert firsts == [0, 3] and src.tolist() == [0, 0, 0, 1]
  ref = jax.device_get(generate(OLD, prompts, lens, KEYS, CFG, SC))
  out = continuous.generate_slots(OLD, prompts, lens, KEYS, CFG, SC, slots=4, chunk=3)
  np.testing.assert_array_equal(out["tokens_BN"], ref["tokens_BN"])
  np.testing.assert_allclose(out["behavior_logp_BN"], ref["behavior_logp_BN"], atol=2e-5)


def test_moe_routes_equal_the_static_paths():
  """MoE: each request's routes (prompt and completion, read from its slots; a stop token is fed once, as `generate`
  feeds it) equal `generate`'s at every real input position the learner replays (`routes_BTLk[:, :-1]`)."""
  import dataclasses
  mcfg = dataclasses.replace(CFG, num_experts=4, experts_per_token=2)
  from jaxrl_llm.models import init_params
  params = init_params(mcfg, jax.random.key(3))
  ref = jax.device_get(generate(params, PROMPTS, PROMPT_LEN, KEYS, mcfg, SC))
  real = (ref["segment_ids_BT"] > 0)[:, :-1]
  for slots, chunk in [(3, 2), (2, 1)]:
    out = continuous.generate_slots(params, PROMPTS, PROMPT_LEN, KEYS, mcfg, SC, slots=slots, chunk=chunk)
    np.testing.assert_array_equal(out["tokens_BN"], ref["tokens_BN"])
    assert out["routes_BTLk"].shape == ref["routes_BTLk"].shape
    np.testing.assert_array_equal(out["routes_BTLk"][:, :-1][real], ref["routes_BTLk"][:, :-1][real])
    assert out["live_steps"] == int(ref["lengths_B"].sum()) - R  # fed stop tokens are not live slot-steps


@pytest.mark.parametrize("run", ["sync", "async", "episodes"])
def test_runs_with_slots_speculate(tmp_path, run):
  """rollout.slots with sampler.spec_gamma: the slot engine drafts and verifies in sync and async runs and in
  episodes' turns; both features show in each step's metrics (slot counters and the acceptance rate), and μ is the
  policy's (sync: the learner's π_old at the generating version equals it)."""
  if run == "episodes":
    c = load_file(os.path.join(ROOT, "configs", "agent_tiny.py"))
    c.log.tensorboard = False
  else:
    c = tiny()
  c.sft.steps, c.eval.every, c.num_steps = 0, 0, 2
  c.rollout.slots, c.rollout.slot_chunk = 4, 2
  c.sampler.spec_gamma, c.sampler.spec_draft_layers = 2, 1
  if run == "async":
    c.rollout.mode, c.rollout.lag = "async", 1
  rows = loop.run(c, str(tmp_path))
  slot_key = {"sync": "slot_steps", "async": "async_slot_steps", "episodes": "env_slot_steps"}[run]
  for r in rows:
    assert np.isfinite(r["loss"]) and r[slot_key] > 0, r
    assert 0.0 <= r["spec_accept_rate"] <= 1.0 and r["spec_tokens_per_call"] >= 1.0, r
  if run != "async":
    assert all(r["mismatch_abs_max"] < 1e-4 for r in rows), rows


def test_a_resident_row_resumes_until_the_write_index_runs_past_it():
  """`SlotEngine(resident=True)`: a finished request submitted with a `keep` id stays parked in its slot, and the next
  request of that id whose context extends it resumes there (one forward over the appended ids). The parked row
  holds the cache's shift back only so far: once the write index ran more than P + N + P slots past its first token
  it is dropped (the index never leaves room for less than a chunk) and the next request prefills. Either way its
  tokens are those a plain engine draws with the same key, and μ theirs up to float rounding. The other requests
  (no `keep` id, one context) continue each other's slot: each shares its prefix with the last one's."""
  W = 24
  sc = SamplerConfig(max_new_tokens=6, stop_ids=(2, 3), temperature=1.0)

  def run(eng, tag, ids, key, keep=None):
    prompt = np.zeros((W,), np.int32)
    prompt[W - len(ids):] = ids
    eng.submit(tag, prompt, len(ids), key, keep=keep)
    got = {}
    while not eng.idle:
      got.update(eng.step(OLD, 0))
      assert eng.index + continuous.chunk_room(eng.chunk, 0) <= eng.state["cache"]["segment_ids_BS"].shape[1]
    cols = got[tag]
    return list(ids) + cols["tokens_N"][:int(cols["mask_N"].sum())].tolist(), cols

  resident = continuous.SlotEngine(CFG, sc, slots=2, chunk=2, width=W, resident=True)
  plain = continuous.SlotEngine(CFG, sc, slots=2, chunk=2, width=W)
  ids = [5, 6, 7]
  for turn in range(3):  # turn 2 comes after other requests pushed the write index past the parked row
    if turn == 2:
      n = 0
      while "a" in resident.parked:
        run(resident, ("other", n), [9, 10], KEYS[n % R])
        n += 1
      assert n > 2  # it stayed parked while the index ran P + N + P slots
    key = KEYS[turn]
    got, cols = run(resident, ("a", turn), ids, key, keep="a")
    want, want_cols = run(plain, ("a", turn), ids, key)
    assert got == want
    np.testing.assert_allclose(cols["behavior_logp_N"], want_cols["behavior_logp_N"], atol=2e-5)
    others = (n - 1, 1) if turn == 2 else (0, 0)  # the first other prefilled, the later ones resumed its slot
    assert resident.resumed == min(turn, 1) + others[0] and resident.prefill_calls == 1 + (turn == 2) + others[1]
    ids = got + [11 + turn]  # the next request: this one's context and completion, then an "observation"
