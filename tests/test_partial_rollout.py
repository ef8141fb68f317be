"""Partial rollouts: chunked decoding equals `generate`; a mid-generation switch scores with the new params."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, init_params, token_logprobs
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.sampling import partial

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
B, P, N = 3, 5, 8
EOS = 2
SC = SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.8)
PROMPTS = jax.random.randint(jax.random.key(1), (B, P), 4, 64)
PROMPT_LEN = jnp.array([5, 2, 3])
KEY = jax.random.key(7)


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(seed):
  """Weights scaled up from init so next-token distributions are far from uniform."""
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 8.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(CFG, jax.random.key(seed)))


OLD = random_params(0)


@jax.jit
def learner_logp(params, out):
  """Learner scores of the completion tokens given their prefix (recipe of the `generate` docstring)."""
  seq = out["sequence_BT"]
  return token_logprobs(params, seq[:, :-1], seq[:, 1:], CFG, positions_BT=out["positions_BT"][:, :-1],
                        segment_ids_BT=out["segment_ids_BT"][:, :-1], temperature=SC.temperature)["logp_BT"][:, P - 1:]


def switch_at_first_poll(version, params):
  """A poll that offers (version, params) once, then nothing; records its calls."""
  calls = []

  def poll(current):
    calls.append(current)
    return (version, params) if len(calls) == 1 else None

  return poll, calls


@pytest.mark.parametrize("chunk", [1, 3, N])
def test_without_publish_equals_generate(chunk):
  ref = generate(OLD, PROMPTS, PROMPT_LEN, KEY, CFG, SC)
  calls = []
  out = partial.generate_partial(0, OLD, lambda v: calls.append(v), PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=chunk)
  for name, value in ref.items():  # the tokens exactly; μ up to float rounding (two compilations of one sum)
    if np.issubdtype(np.asarray(value).dtype, np.floating):
      np.testing.assert_allclose(np.asarray(out[name]), np.asarray(value), rtol=0, atol=1e-6, err_msg=name)
    else:
      np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(value), err_msg=name)
  assert np.all(np.asarray(out["versions_BN"]) == 0)
  assert calls[-1] is None and all(c == 0 for c in calls[:-1])
  assert float(ref["mask_BN"].sum()) > B  # the test covers decode steps, not just the first token


def test_one_compilation_for_every_chunking():
  sizes = lambda: (partial.decode_until._cache_size(), partial.prefill._cache_size())
  partial.generate_partial(0, OLD, lambda v: None, PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=1)
  before = sizes()
  for chunk, version in ((2, 4), (5, 9)):  # other chunk boundaries and versions: no new compilation
    partial.generate_partial(version, OLD, lambda v: None, PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=chunk)
  assert sizes() == before


def post_switch_check(out, old, new, switch_col):
  versions = np.asarray(out["versions_BN"])
  mask = np.asarray(out["mask_BN"]) > 0
  assert np.all(versions[:, :switch_col] == 0) and np.all(versions[:, switch_col:] == 1)
  logp = np.asarray(out["behavior_logp_BN"])
  before, after = mask & (versions == 0), mask & (versions == 1)
  assert after.sum() >= B  # tokens were generated after the switch
  np.testing.assert_allclose(logp[before], np.asarray(learner_logp(old, out))[before], rtol=0, atol=2e-5)
  np.testing.assert_allclose(logp[after], np.asarray(learner_logp(new, out))[after], rtol=0, atol=2e-5)
  # The old params would have scored the post-switch tokens differently: the check above can fail.
  assert np.max(np.abs(logp[after] - np.asarray(learner_logp(old, out))[after])) > 1e-2


def test_switch_keeping_kv_cache():
  # New params differ only in the lm-head, so the kept KV cache is also the new params' cache: the
  # behaviour logp after the switch must equal a learner forward with the new params on the prefix.
  new = {**OLD, "lm_head": random_params(1)["lm_head"]}
  poll, calls = switch_at_first_poll(1, new)
  out = partial.generate_partial(0, OLD, poll, PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=3)
  post_switch_check(out, OLD, new, switch_col=3)
  assert calls[0] == 0 and calls[1] == 1 and calls[-1] is None


def test_switch_keeping_kv_cache_mixes_policies():
  # With every weight changed, kept keys/values are the old policy's: the post-switch tokens are
  # scored by neither policy alone (PipelineRL's "mixed" behaviour); reprefill removes the mix.
  new = random_params(1)
  poll, _ = switch_at_first_poll(1, new)
  out = partial.generate_partial(0, OLD, poll, PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=3)
  after = (np.asarray(out["mask_BN"]) > 0) & (np.asarray(out["versions_BN"]) == 1)
  logp = np.asarray(out["behavior_logp_BN"])
  assert after.sum() >= B
  assert np.max(np.abs(logp[after] - np.asarray(learner_logp(new, out))[after])) > 1e-3


def test_switch_with_reprefill_is_the_new_policy():
  new = random_params(1)
  poll, _ = switch_at_first_poll(1, new)
  out = partial.generate_partial(0, OLD, poll, PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=3, reprefill=True)
  post_switch_check(out, OLD, new, switch_col=3)


def test_bad_chunk():
  with pytest.raises(ValueError, match="chunk_steps"):
    partial.generate_partial(0, OLD, lambda v: None, PROMPTS, PROMPT_LEN, KEY, CFG, SC, chunk_steps=0)


@pytest.mark.parametrize("over", [dict(kv_cache="int8"), dict(kv_cache="window", kv_sinks=1, kv_window=3),
                                  dict(behavior_topk=3, mc_samples=2)], ids=["int8", "window", "records"])
def test_without_publish_equals_generate_with_compressed_caches_and_records(over):
  """The chunked decode reads the cache format and writes μ's records as `generate` does (no switch: equal)."""
  import dataclasses
  sc = dataclasses.replace(SC, **over)
  ref = jax.device_get(generate(OLD, PROMPTS, PROMPT_LEN, KEY, CFG, sc))
  out = jax.device_get(partial.generate_partial(0, OLD, lambda v: None, PROMPTS, PROMPT_LEN, KEY, CFG, sc,
                                                chunk_steps=2))
  np.testing.assert_array_equal(out["tokens_BN"], ref["tokens_BN"])
  np.testing.assert_allclose(out["behavior_logp_BN"], ref["behavior_logp_BN"], atol=2e-5)
  for k in ("behavior_topk_ids_BNk", "mc_ids_BNJ", "kv_window_B2"):
    if k in ref:
      np.testing.assert_array_equal(out[k], ref[k], err_msg=k)
  assert ("mc_ids_BNJ" in out) == bool(sc.mc_samples) and ("kv_window_B2" in out) == (sc.kv_cache == "window")


def test_window_cache_is_generates_ring_buffer(monkeypatch):
  """A window cache of sinks + window < N decodes from `generate`'s ring buffer (P + sinks + window slots, traced;
  without a switch its tokens are generate's: the test above), and a switch keeps it: the chunks after it decode on
  through the same ring with the new version recorded."""
  import dataclasses
  from jaxrl_llm.sampling import sampler
  sc = dataclasses.replace(SC, kv_cache="window", kv_sinks=1, kv_window=3, stop_ids=())
  built = []
  spy = lambda *a, **kw: built.append(sampler_init_cache(*a, **kw)) or built[-1]
  sampler_init_cache = sampler.init_cache
  monkeypatch.setattr(sampler, "init_cache", spy)
  body = functools.partial(partial.prefill.__wrapped__, model_cfg=CFG, sampler_cfg=sc)  # traced, not cached
  jax.eval_shape(body, OLD, PROMPTS, PROMPT_LEN, KEY, 0)
  assert built and all(c["k"].shape[2] == P + 4 for c in built)
  monkeypatch.undo()
  new = random_params(1)
  poll, _ = switch_at_first_poll(1, new)
  out = jax.device_get(partial.generate_partial(0, OLD, poll, PROMPTS, PROMPT_LEN, KEY, CFG, sc, chunk_steps=3))
  assert (out["versions_BN"][:, :3] == 0).all() and (out["versions_BN"][:, 3:] == 1).all()
  assert out["mask_BN"].all() and np.isfinite(out["behavior_logp_BN"]).all()  # 8 columns: the ring wraps


SPEC = dict(spec_gamma=2, spec_draft_layers=1)


def spec_switch_check(out, old, new):
  """Every row's versions are 0s then 1s, switching at one call boundary (the "min" layout keeps rows in step) at
  or after the chunk's column; μ is the version's that sampled each token."""
  versions, mask = np.asarray(out["versions_BN"]), np.asarray(out["mask_BN"]) > 0
  switch = int(np.argmax(versions.max(axis=0) == 1))
  assert switch >= 3 and np.all(versions[:, :switch][mask[:, :switch]] == 0)
  assert np.all(versions[:, switch:][mask[:, switch:]] == 1)
  logp = np.asarray(out["behavior_logp_BN"])
  before, after = mask & (versions == 0), mask & (versions == 1)
  assert after.sum() >= B
  np.testing.assert_allclose(logp[before], np.asarray(learner_logp(old, out))[before], rtol=0, atol=2e-5)
  np.testing.assert_allclose(logp[after], np.asarray(learner_logp(new, out))[after], rtol=0, atol=2e-5)
  assert np.max(np.abs(logp[after] - np.asarray(learner_logp(old, out))[after])) > 1e-2


def test_speculating_chunks_without_publish_equal_generate_greedy():
  import dataclasses
  sc = dataclasses.replace(SC, temperature=0.0, **SPEC)
  ref = generate(OLD, PROMPTS, PROMPT_LEN, KEY, CFG, dataclasses.replace(sc, spec_gamma=0))
  out = partial.generate_partial(0, OLD, lambda v: None, PROMPTS, PROMPT_LEN, KEY, CFG, sc, chunk_steps=2,
                                 draft_params=random_params(5))
  np.testing.assert_array_equal(np.asarray(out["tokens_BN"]), np.asarray(ref["tokens_BN"]))
  np.testing.assert_allclose(np.asarray(out["behavior_logp_BN"]), np.asarray(ref["behavior_logp_BN"]), atol=2e-5)
  assert np.all(np.asarray(out["versions_BN"]) == 0) and 0 <= float(out["spec_accept_rate"]) < 1


@pytest.mark.parametrize("layout,reprefill", [("min", True), ("rows", False)])
def test_speculating_switch_samples_each_token_from_its_version(layout, reprefill):
  """A switch between draft-and-verify calls: with reprefill the tokens after it are the new policy's; keeping the
  cache ("rows" layout) with new params that differ only in the lm-head, too (the kept cache is theirs)."""
  import dataclasses
  new = random_params(1) if reprefill else {**OLD, "lm_head": random_params(1)["lm_head"]}
  poll, calls = switch_at_first_poll(1, new)
  sc = dataclasses.replace(SC, spec_layout=layout, **SPEC)
  out = partial.generate_partial(0, OLD, poll, PROMPTS, PROMPT_LEN, KEY, CFG, sc, chunk_steps=3, reprefill=reprefill,
                                 draft_params=random_params(5))
  if layout == "min":
    spec_switch_check(out, OLD, new)
  else:  # rows switch at their own columns: check μ against each token's version
    versions, mask = np.asarray(out["versions_BN"]), np.asarray(out["mask_BN"]) > 0
    logp = np.asarray(out["behavior_logp_BN"])
    for v, params in ((0, OLD), (1, new)):
      at = mask & (versions == v)
      assert at.sum() >= B
      np.testing.assert_allclose(logp[at], np.asarray(learner_logp(params, out))[at], atol=2e-5)
    assert np.all(np.diff(versions * mask, axis=1)[mask[:, 1:]] >= 0)  # a row's versions never go back
  assert calls[0] == 0 and calls[-1] is None and 0 < float(out["spec_tokens_per_call"])
