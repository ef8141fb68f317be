"""Sampler: behaviour log-probs agree with the learner, truncation, EOS, keys, compilation, dtype."""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, init_cache, init_params, token_logprobs
from jaxrl_llm.models.transformer import decode_view, stack_cache
from jaxrl_llm.sampling import SamplerConfig, generate, sample_token
from jaxrl_llm.sampling import sampler as sampler_lib
from jaxrl_llm.sampling.sample import first_argmax, predraw_noise, step_noise

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                  qk_norm=True)
B, P, N = 3, 5, 6
EOS = 3


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(cfg):
  """Weights scaled up from init so the next-token distributions are far from uniform."""
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 10.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(cfg, jax.random.key(0)))


PARAMS = random_params(CFG)
PROMPTS = jax.random.randint(jax.random.key(1), (B, P), 4, 32)
PROMPT_LEN = jnp.array([5, 2, 3])


@functools.partial(jax.jit, static_argnames=("cfg", "temperature"))
def learner_logp(params, out, cfg, temperature):
  """Learner-side scores of the completion, following the `generate` docstring recipe."""
  seq = out["sequence_BT"]
  logp = token_logprobs(params, seq[:, :-1], seq[:, 1:], cfg, positions_BT=out["positions_BT"][:, :-1],
                        segment_ids_BT=out["segment_ids_BT"][:, :-1], temperature=temperature,
                        chunk_size=4)["logp_BT"]
  return logp[:, P - 1:]


def run(sampler_cfg, params=PARAMS, model_cfg=CFG, key=jax.random.key(2)):
  return generate(params, PROMPTS, PROMPT_LEN, key, model_cfg, sampler_cfg)


def check_eos_convention(out, eos_id, pad_id=0):
  """mask is 1 up to and including the first EOS and 0 after; pads after; lengths count the mask."""
  tokens, mask = np.asarray(out["tokens_BN"]), np.asarray(out["mask_BN"])
  for b in range(tokens.shape[0]):
    hits = np.flatnonzero(tokens[b] == eos_id)
    length = hits[0] + 1 if hits.size else tokens.shape[1]
    np.testing.assert_array_equal(mask[b], np.arange(tokens.shape[1]) < length)
    assert np.all(tokens[b, length:] == pad_id)
    assert np.all(np.asarray(out["behavior_logp_BN"])[b, length:] == 0.0)
    assert out["lengths_B"][b] == length and bool(out["finished_B"][b]) == bool(hits.size)


def test_behavior_logp_equals_learner_logp():
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.7)
  out = run(sc)
  assert out["tokens_BN"].shape == (B, N) and out["sequence_BT"].shape == (B, P + N)
  mask = np.asarray(out["mask_BN"]) > 0
  learner = learner_logp(PARAMS, out, CFG, 0.7)
  assert float(np.max(np.abs(np.asarray(learner - out["behavior_logp_BN"])[mask]))) < 1e-5
  # The learner frame: prompt pads carry segment 0; completion positions continue the prompt.
  np.testing.assert_array_equal(out["segment_ids_BT"][1, :P], [0, 0, 0, 1, 1])
  np.testing.assert_array_equal(out["positions_BT"][1, P:], 2 + np.arange(N))
  np.testing.assert_array_equal(out["completion_mask_BT"][:, P:], out["mask_BN"])
  check_eos_convention(out, EOS)


def test_left_padding_does_not_change_samples():
  """A short prompt padded to a wider bucket gives the same completion and logp."""
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.7)
  key = jax.random.key(5)
  narrow = generate(PARAMS, PROMPTS[1:2, 3:], PROMPT_LEN[1:2], key, CFG, sc)
  wide = generate(PARAMS, PROMPTS[1:2], PROMPT_LEN[1:2], key, CFG, sc)
  np.testing.assert_array_equal(narrow["tokens_BN"], wide["tokens_BN"])
  np.testing.assert_allclose(narrow["behavior_logp_BN"], wide["behavior_logp_BN"], atol=1e-5)


def test_same_key_same_samples_different_key_different_samples():
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(), temperature=1.0)
  a, b = run(sc), run(sc)
  np.testing.assert_array_equal(a["tokens_BN"], b["tokens_BN"])
  c = run(sc, key=jax.random.key(3))
  assert not np.array_equal(a["tokens_BN"], c["tokens_BN"])


def test_step_keys_are_fold_in_of_step():
  """With a zero lm-head the logits are 0, so token n is exactly categorical(fold_in(key, n), 0)."""
  params = {**PARAMS, "lm_head": jnp.zeros_like(PARAMS["lm_head"])}
  key = jax.random.key(7)
  out = run(SamplerConfig(max_new_tokens=N, stop_ids=(), temperature=1.0), params=params, key=key)
  expected = jnp.stack([jax.random.categorical(jax.random.fold_in(key, n), jnp.zeros((B, 32)))
                        for n in range(N)], axis=1)
  np.testing.assert_array_equal(out["tokens_BN"], expected)
  assert len(np.unique(np.asarray(out["tokens_BN"]))) > 3  # a shared key would repeat one column
  np.testing.assert_allclose(out["behavior_logp_BN"], np.log(1 / 32), rtol=1e-6)


def test_top_k_one_equals_greedy():
  greedy = run(SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.0))
  top1 = run(SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.9, top_k=1))
  np.testing.assert_array_equal(greedy["tokens_BN"], top1["tokens_BN"])
  # Renormalised over one candidate: log 1 = 0. Greedy reports the temperature-1 log-softmax.
  np.testing.assert_array_equal(top1["behavior_logp_BN"], 0.0)
  mask = np.asarray(greedy["mask_BN"]) > 0
  learner = learner_logp(PARAMS, greedy, CFG, 1.0)
  np.testing.assert_allclose(np.asarray(learner)[mask], np.asarray(greedy["behavior_logp_BN"])[mask], atol=1e-5)
  assert np.all(np.asarray(greedy["behavior_logp_BN"])[mask] < 0)


def test_top_p_logp_is_renormalised():
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=1.0, top_p=0.6)
  out = run(sc)
  mask = np.asarray(out["mask_BN"]) > 0
  untruncated = np.asarray(learner_logp(PARAMS, out, CFG, 1.0))[mask]
  truncated = np.asarray(out["behavior_logp_BN"])[mask]
  assert np.all(truncated >= untruncated - 1e-6)
  assert np.any(truncated > untruncated + 1e-3)
  assert np.all(truncated <= 0.0)


def test_sample_token_truncated_distribution_golden():
  """Empirical frequencies and reported logp match the renormalised truncated distribution."""
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  logits_BV = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (20000, 4))
  # top_k=3 keeps {0,1,2}; then top_p=0.7 keeps tokens whose preceding mass < 0.7: {0,1} -> (5/8, 3/8).
  sc = SamplerConfig(max_new_tokens=1, stop_ids=(), top_k=3, top_p=0.7)
  token_B, logp_B = jax.jit(sample_token, static_argnums=2)(logits_BV, jax.random.key(8), sc)
  freq = np.bincount(np.asarray(token_B), minlength=4) / 20000
  np.testing.assert_allclose(freq, [5 / 8, 3 / 8, 0, 0], atol=0.015)
  expected = np.log(np.array([5 / 8, 3 / 8, 1.0, 1.0]))[np.asarray(token_B)]
  np.testing.assert_allclose(logp_B, expected, rtol=1e-5)
  # Untruncated at temperature 2: logp = log softmax(log p / 2).
  sc2 = SamplerConfig(max_new_tokens=1, stop_ids=(), temperature=2.0)
  token_B, logp_B = sample_token(logits_BV[:4], jax.random.key(9), sc2)
  tempered = np.sqrt(probs) / np.sqrt(probs).sum()
  np.testing.assert_allclose(logp_B, np.log(tempered)[np.asarray(token_B)], rtol=1e-5)


def test_eos_stops_each_row_and_masks_the_rest():
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.0)
  greedy = run(sc)
  # Make each row's greedy first token the EOS: every row stops after one token.
  first = int(greedy["tokens_BN"][0, 0])
  out = run(dataclasses.replace(sc, stop_ids=(first,), pad_id=31))
  assert out["mask_BN"][0].tolist() == [1.0] + [0.0] * (N - 1)
  check_eos_convention(out, first, pad_id=31)
  # Stochastic rows end at different steps; the convention holds row by row.
  params = {**PARAMS, "lm_head": PARAMS["lm_head"] * 0.05}  # near-uniform: EOS comes early in some rows
  many = generate(params, jnp.tile(PROMPTS, (4, 1)), jnp.tile(PROMPT_LEN, 4), jax.random.key(10), CFG,
                  SamplerConfig(max_new_tokens=24, stop_ids=(EOS,), temperature=1.0))
  check_eos_convention(many, EOS)
  assert 0 < int(np.sum(many["finished_B"])) < 12


def test_generate_compiles_once_per_shape(caplog):
  # Count compilations of `generate` from JAX's compile log (the jit cache size is not a counter:
  # entries of garbage-collected static arguments can leave it while a test runs).
  sc = SamplerConfig(max_new_tokens=3, stop_ids=(EOS,), temperature=0.83, top_k=7)  # a config no other test uses
  count = lambda: sum("Compiling" in r.getMessage() and "generate" in r.getMessage() for r in caplog.records)
  with caplog.at_level(logging.WARNING), jax.log_compiles():
    run(sc, key=jax.random.key(11))
    assert count() == 1
    run(sc, params=jax.tree.map(lambda x: x * 1.01, PARAMS), key=jax.random.key(12))
    assert count() == 1  # new values and key, same shapes: no recompilation


def test_bf16_sampler_vs_fp32_learner_mismatch_is_small_but_nonzero():
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.7)
  out = run(sc, model_cfg=dataclasses.replace(CFG, dtype="bfloat16"))
  mask = np.asarray(out["mask_BN"]) > 0
  diff = np.abs(np.asarray(learner_logp(PARAMS, out, CFG, 0.7) - out["behavior_logp_BN"]))[mask]
  assert np.all(np.isfinite(diff))
  assert 0.0 < diff.max() < 0.5


@pytest.mark.parametrize("bad, field", [
    (dict(max_new_tokens=0), "sampler.max_new_tokens"),
    (dict(temperature=-1.0), "sampler.temperature"),
    (dict(top_k=-2), "sampler.top_k"),
    (dict(top_p=0.0), "sampler.top_p"),
])
def test_sampler_config_validation(bad, field):
  with pytest.raises(ValueError, match=field):
    SamplerConfig(**{"max_new_tokens": 4, "stop_ids": (1,), **bad})


def test_first_argmax_equals_argmax_with_ties_and_minus_inf():
  x_BV = jax.random.randint(jax.random.key(20), (64, 17), 0, 4).astype(jnp.float32)  # many ties per row
  x_BV = jnp.where(jax.random.bernoulli(jax.random.key(21), 0.3, x_BV.shape), -jnp.inf, x_BV)
  x_BV = x_BV.at[0].set(-jnp.inf)  # an all -inf row: index 0, as jnp.argmax
  np.testing.assert_array_equal(first_argmax(x_BV), jnp.argmax(x_BV, axis=-1))


def test_predrawn_noise_rows_are_the_per_step_draws():
  key, shape = jax.random.key(5), (3, 7)
  noise_NBK = predraw_noise(key, 4, shape)
  for n in range(4):
    np.testing.assert_array_equal(noise_NBK[n], step_noise(key, n, shape))


@pytest.mark.parametrize("sc", [SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.8),
                                SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=1.0, top_k=5),
                                SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=1.0, top_p=0.7)],
                         ids=["plain", "top_k", "top_p"])
def test_noise_drawn_before_or_inside_the_decode_loop_gives_the_same_samples(sc, monkeypatch):
  before = run(sc)
  monkeypatch.setattr(sampler_lib, "PREDRAW_MAX_ELEMENTS", 0)  # every step draws its own noise
  fresh = jax.jit(lambda *args: generate.__wrapped__(*args, CFG, sc))  # a new function: a new trace
  inside = fresh(PARAMS, PROMPTS, PROMPT_LEN, jax.random.key(2))
  for name in ("tokens_BN", "behavior_logp_BN", "mask_BN"):
    np.testing.assert_array_equal(before[name], inside[name], err_msg=name)


MOE = ModelConfig(vocab_size=32, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32,
                  num_experts=4, experts_per_token=2)


@pytest.mark.parametrize("cfg,kv_cache", [(CFG, "full"), (MOE, "full"), (CFG, "int8")], ids=["dense", "moe", "int8"])
def test_unrolled_decode_view_matches_the_layer_scan(cfg, kv_cache):
  """Decode from per-layer weights and caches (`decode_view`, `decode_unroll`, the default) gives the same samples,
  log-probs and routes as decode through the rolled layer scan (`decode_unroll=False`), rounding aside; an int8
  cache too (μ is then that cache's policy: the learner's scores differ)."""
  sc = SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.7, kv_cache=kv_cache)
  params = random_params(cfg)
  assert cfg.layer_unroll == 1 and cfg.decode_unroll
  scan = run(sc, params=params, model_cfg=dataclasses.replace(cfg, decode_unroll=False))
  unrolled = run(sc, params=params, model_cfg=cfg)
  for name in ("tokens_BN", "mask_BN") + (("routes_BTLk",) if cfg.is_moe else ()):
    np.testing.assert_array_equal(scan[name], unrolled[name], err_msg=name)
  np.testing.assert_allclose(scan["behavior_logp_BN"], unrolled["behavior_logp_BN"], rtol=0, atol=1e-5)
  assert float(scan["gen_kv_bits"]) == float(unrolled["gen_kv_bits"]) == (8 + 32 / 8 if kv_cache == "int8" else 32)
  if kv_cache == "int8":
    return
  mask = np.asarray(unrolled["mask_BN"]) > 0
  learner = np.asarray(learner_logp(params, unrolled, cfg, 0.7))
  np.testing.assert_allclose(learner[mask], np.asarray(unrolled["behavior_logp_BN"])[mask], rtol=0, atol=1e-5)


def test_decode_view_cache_round_trips():
  cfg = CFG  # layer_unroll=1: decode unstacks all the same (`decode_unroll`)
  cache = init_cache(cfg, 2, 5)
  cache = {**cache, "k": jax.random.normal(jax.random.key(0), cache["k"].shape),
           "v": jax.random.normal(jax.random.key(1), cache["v"].shape)}
  _, view = decode_view(PARAMS, cache, cfg)
  assert isinstance(view["k"], tuple) and view["k"][0].shape == (2, 2, 8, 5)  # [B, K, hd, S]
  np.testing.assert_array_equal(view["v"][1], jnp.transpose(cache["v"][1], (0, 2, 1, 3)))  # [B, K, S, hd]
  back = stack_cache(view)
  for name in ("k", "v"):
    np.testing.assert_array_equal(back[name], cache[name])
  rolled_params, rolled = decode_view(PARAMS, cache, dataclasses.replace(CFG, decode_unroll=False))  # the scan
  assert rolled is cache and rolled_params is PARAMS


@pytest.mark.parametrize("how", ["unstacked", "scan", "int8", "int8 scan"])
def test_decode_view_widens_a_prompt_cache_with_empty_slots(how):
  """`generate` prefills into the prompt's slots and the decode view adds the loop's room: the widened cache is
  the prompt cache in its first slots and `init_cache`'s empty slots after, in every decode layout."""
  cfg = dataclasses.replace(CFG, decode_unroll="scan" not in how)
  kv_dtype = "int8" if "int8" in how else "compute"
  narrow, wide = init_cache(cfg, 2, 5, kv_dtype), init_cache(cfg, 2, 9, kv_dtype)
  filled = lambda c, k: c.at[:, :, :5].set(jax.random.randint(k, c[:, :, :5].shape, 1, 100).astype(c.dtype))
  narrow = {**narrow, "index": jnp.int32(5), "positions_BS": jnp.arange(10, dtype=jnp.int32).reshape(2, 5),
            "segment_ids_BS": jnp.ones((2, 5), jnp.int32)}
  for i, name in enumerate(n for n in ("k", "v", "k_scale", "v_scale") if n in narrow):
    narrow[name] = filled(narrow[name], jax.random.key(i))
  _, view = decode_view(PARAMS, narrow, cfg, slots=9)
  back = stack_cache(view)
  assert ("scan" not in how) == isinstance(view["k"], tuple)
  assert back.keys() == wide.keys()
  for name, x in back.items():
    if name == "index":
      want = narrow[name]
    elif name.endswith("_BS"):
      want = wide[name].at[:, :5].set(narrow[name])
    else:  # [L, B, S, ...]
      want = wide[name].at[:, :, :5].set(narrow[name])
    np.testing.assert_array_equal(x, want, err_msg=name)
  assert stack_cache(decode_view(PARAMS, back, cfg, slots=9)[1])["k"].shape[2] == 9  # already wide: as it is
  with pytest.raises(ValueError, match="fewer"):
    decode_view(PARAMS, back, cfg, slots=7)
