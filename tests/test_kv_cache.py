"""Compressed sampler KV caches (`sampler.kv_cache`): int8 keys/values and attention sinks + sliding window.

Golden values are computed independently of the cached path: the window cache's behaviour log-probs must
equal a full-context forward whose mask is built here with explicit loops over positions; the int8 cache's
logits must stay within the quantisation error of the full cache's, and differ from them (a real mismatch).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, forward_with_cache, init_cache, init_params
from jaxrl_llm.models import cache as cache_lib
from jaxrl_llm.models.transformer import decode_view, hidden_with_routing, logits_from_hidden, stack_cache
from jaxrl_llm.sampling import SamplerConfig, generate

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
B, P, N = 3, 6, 7
SINKS, WINDOW = 2, 3


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(cfg):
  """Weights scaled up from init so the next-token distributions are far from uniform."""
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 10.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(cfg, jax.random.key(0)))


PARAMS = random_params(CFG)
PROMPTS = jax.random.randint(jax.random.key(1), (B, P), 4, 32)
PROMPT_LEN = jnp.array([6, 2, 4])


def loop_mask(positions_BT, segment_ids_BT, sinks, window):
  """[B, T, T] mask by explicit loops: causal, same segment, and the key a sink or inside the window."""
  pos, seg = np.asarray(positions_BT), np.asarray(segment_ids_BT)
  Bn, T = pos.shape
  m = np.zeros((Bn, T, T), bool)
  for b in range(Bn):
    for t in range(T):
      for s in range(t + 1):
        if seg[b, t] == seg[b, s] and (pos[b, s] < sinks or pos[b, t] - pos[b, s] < window):
          m[b, t, s] = True
  return m


def scored(out, mask_BTT=None):
  """log π of each sampled completion token from one full-context forward (optionally masked)."""
  seq, pos, seg = out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"]
  h = hidden_with_routing(PARAMS, seq[:, :-1], CFG, positions_BT=pos[:, :-1], segment_ids_BT=seg[:, :-1],
                          mask_BTT=None if mask_BTT is None else jnp.asarray(mask_BTT))[0]
  logp = jax.nn.log_softmax(logits_from_hidden(PARAMS, h, CFG), -1)
  logp = jnp.take_along_axis(logp, seq[:, 1:, None], -1)[..., 0]
  return np.asarray(logp[:, P - 1:])


def test_window_cache_equals_masked_full_forward():
  sc = SamplerConfig(max_new_tokens=N, kv_cache="window", kv_sinks=SINKS, kv_window=WINDOW)
  out = generate(PARAMS, PROMPTS, PROMPT_LEN, jax.random.key(2), CFG, sc)
  mask = np.asarray(out["mask_BN"])
  np.testing.assert_array_equal(out["kv_window_B2"], np.tile([SINKS, WINDOW], (B, 1)))
  m = loop_mask(out["positions_BT"][:, :-1], out["segment_ids_BT"][:, :-1], SINKS, WINDOW)
  shadow = scored(out, m)
  mu = np.asarray(out["behavior_logp_BN"])
  np.testing.assert_allclose(shadow * mask, mu * mask, atol=2e-4)
  # The learner-side helper builds the same mask from the recorded (sinks, window).
  got = cache_lib.window_attention_mask(out["positions_BT"][:, :-1], out["segment_ids_BT"][:, :-1],
                                        out["kv_window_B2"][:, 0], out["kv_window_B2"][:, 1])
  np.testing.assert_array_equal(np.asarray(got), m)
  # The dense learner scores something else: the window is a real mismatch on long rows.
  dense = scored(out)
  assert np.max(np.abs(dense - mu) * mask) > 1e-2


def test_window_cache_grouped_prefill_matches():
  """GRPO groups prefill once and copy the (window) cache: same behaviour log-probs as row-by-row prefill."""
  G = 2
  prompts, lens = jnp.repeat(PROMPTS, G, 0), jnp.repeat(PROMPT_LEN, G)
  kw = dict(max_new_tokens=N, kv_cache="window", kv_sinks=SINKS, kv_window=WINDOW)
  a = generate(PARAMS, prompts, lens, jax.random.key(3), CFG, SamplerConfig(**kw, group_size=G))
  b = generate(PARAMS, prompts, lens, jax.random.key(3), CFG, SamplerConfig(**kw))
  np.testing.assert_array_equal(a["tokens_BN"], b["tokens_BN"])
  np.testing.assert_allclose(a["behavior_logp_BN"], b["behavior_logp_BN"], atol=1e-5)


def test_window_wider_than_context_is_the_full_cache():
  full = generate(PARAMS, PROMPTS, PROMPT_LEN, jax.random.key(2), CFG, SamplerConfig(max_new_tokens=N))
  wide = generate(PARAMS, PROMPTS, PROMPT_LEN, jax.random.key(2), CFG,
                  SamplerConfig(max_new_tokens=N, kv_cache="window", kv_sinks=0, kv_window=P + N))
  np.testing.assert_array_equal(full["tokens_BN"], wide["tokens_BN"])
  np.testing.assert_allclose(full["behavior_logp_BN"], wide["behavior_logp_BN"], atol=1e-5)
  assert "kv_window_B2" not in full


def test_quantize_kv_error_bound():
  x = jax.random.normal(jax.random.key(4), (2, 5, 3, 8)) * jnp.arange(1, 4)[None, None, :, None]
  q, s = cache_lib.quantize_kv(x)
  assert q.dtype == jnp.int8 and s.shape == (2, 5, 3)
  np.testing.assert_allclose(np.asarray(s), np.max(np.abs(np.asarray(x)), -1) / 127, rtol=1e-6)
  err = np.abs(np.asarray(cache_lib.dequantize_kv(q, s, jnp.float32)) - np.asarray(x))
  assert np.all(err <= np.asarray(s)[..., None] / 2 + 1e-7)  # rounding: at most half a step


def _decode_logits(kv_dtype):
  """Prefill the prompt, then decode 4 fixed tokens one at a time; logits of every decode step."""
  Bn, T0 = 2, 5
  toks = jax.random.randint(jax.random.key(5), (Bn, T0 + 4), 4, 32)
  cache = init_cache(CFG, Bn, T0 + 4, kv_dtype)
  pos = jnp.broadcast_to(jnp.arange(T0 + 4), (Bn, T0 + 4))
  _, cache = forward_with_cache(PARAMS, toks[:, :T0], cache, CFG, positions_BT=pos[:, :T0])
  outs = []
  for t in range(T0, T0 + 4):
    logits, cache = forward_with_cache(PARAMS, toks[:, t:t + 1], cache, CFG, positions_BT=pos[:, t:t + 1])
    outs.append(logits[:, 0])
  return np.stack(outs, 1), cache


def test_int8_cache_close_to_full_cache():
  full, c_full = _decode_logits("compute")
  q, c_q = _decode_logits("int8")
  assert c_q["k"].dtype == jnp.int8 and c_q["k_scale"].shape == c_q["k"].shape[:-1]
  diff = np.abs(full - q)
  # Each key/value element is off by at most half a quantisation step (max|x|/254 per token and head):
  # well under 1% of the logit scale, yet not zero.
  scale = np.max(np.abs(full))
  assert diff.max() < 0.02 * scale, (diff.max(), scale)
  assert diff.max() > 1e-5
  L, S, K, hd = CFG.n_layers, 9, CFG.n_kv_heads, CFG.head_dim
  assert cache_lib.cache_bytes(c_full) == 2 * L * 2 * S * K * hd * 4
  assert cache_lib.cache_bytes(c_q) == 2 * L * 2 * S * K * hd * 1 + 2 * L * 2 * S * K * 4
  # bits per cached element: one int8 per element plus each (token, head)'s fp32 scale shared by hd of them
  assert cache_lib.kv_bits(c_full) == 32.0 and cache_lib.kv_bits(c_q) == 8.0 + 32.0 / hd == 12.0


@pytest.mark.parametrize("kv_cache, bits", [("full", 32.0), ("int8", 12.0), ("window", 32.0)])
def test_every_decode_path_reports_the_cache_it_decoded_from(kv_cache, bits):
  """`gen_kv_bits` of the static sampler, speculative decoding, the slot engine and partial rollouts: the format
  each one built."""
  from jaxrl_llm import sampling
  from jaxrl_llm.sampling import continuous
  from jaxrl_llm.sampling.partial import generate_partial
  sc = SamplerConfig(max_new_tokens=N, kv_cache=kv_cache, kv_sinks=SINKS, kv_window=WINDOW)
  key = jax.random.key(2)
  spec = dataclasses.replace(sc, spec_gamma=2, spec_draft_layers=1)
  outs = {"static": generate(PARAMS, PROMPTS, PROMPT_LEN, key, CFG, sc),
          "speculative": sampling.generate(PARAMS, PROMPTS, PROMPT_LEN, key, CFG, spec),
          "slots": continuous.generate_slots(PARAMS, PROMPTS, PROMPT_LEN, jax.random.split(key, B), CFG, sc,
                                             slots=2, chunk=2),
          "partial": generate_partial(0, PARAMS, lambda v: None, PROMPTS, PROMPT_LEN, key, CFG, sc, chunk_steps=3)}
  assert {k: float(o["gen_kv_bits"]) for k, o in outs.items()} == dict.fromkeys(outs, bits)
  assert outs["partial"]["gen_partial_polls"] == 2  # boundaries after columns 3 and 6 of 7


def test_int8_sampler_behaviour_close_to_learner():
  sc = SamplerConfig(max_new_tokens=N, kv_cache="int8")
  out = generate(PARAMS, PROMPTS, PROMPT_LEN, jax.random.key(2), CFG, sc)
  mask = np.asarray(out["mask_BN"])
  d = np.abs(scored(out) - np.asarray(out["behavior_logp_BN"])) * mask
  assert 0 < d.max() < 0.5


def test_write_slot_golden():
  """start 6, sinks 2, window 3: the prompt and the first two generated tokens in order, then slots 8, 9, 10 in turn."""
  got = [int(cache_lib.write_slot(jnp.int32(i), (6, 2, 3))) for i in range(15)]
  assert got == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 8, 9, 10, 8]
  assert cache_lib.ring_layout(6, 7, (2, 3)) == (6, 2, 3) and cache_lib.ring_layout(6, 5, (2, 3)) is None
  assert cache_lib.cache_slots(6, 7, (6, 2, 3)) == 11 and cache_lib.cache_slots(6, 7, None) == 13


@pytest.mark.parametrize("unroll", [True, False])
def test_ring_buffer_saves_slots_and_decodes_as_the_window_mask(unroll, monkeypatch):
  """A long generation (N = 20 through a ring of 1 sink + 3 window slots: it wraps 5 times) allocates P + 4 slots,
  not P + N (the caches `generate` builds, traced), and its μ equals the full-context forward under the window mask
  built by explicit loops, through the in-place layer view and the layer scan alike."""
  import dataclasses
  from jaxrl_llm.sampling import sampler
  cfg, n = dataclasses.replace(CFG, decode_unroll=unroll), 20
  sc = SamplerConfig(max_new_tokens=n, kv_cache="window", kv_sinks=1, kv_window=3, stop_ids=())
  built, viewed = [], []
  spy = lambda *a, **kw: built.append(init_cache(*a, **kw)) or built[-1]
  monkeypatch.setattr(sampler, "init_cache", spy)

  def view(*a):
    out = decode_view(*a)
    viewed.append(stack_cache(out[1])["k"].shape[2])
    return out

  monkeypatch.setattr(sampler, "decode_view", view)
  body = functools.partial(sampler.generate.__wrapped__, model_cfg=cfg, sampler_cfg=sc)  # traced, not cached
  jax.eval_shape(body, PARAMS, PROMPTS, PROMPT_LEN, jax.random.key(5))
  # the prefill fills the prompt's slots; the decode loop's view adds the ring's 4
  assert built and all(c["k"].shape[2] == P for c in built)
  assert viewed and all(slots == P + 4 for slots in viewed)
  monkeypatch.undo()
  out = generate(PARAMS, PROMPTS, PROMPT_LEN, jax.random.key(5), cfg, sc)
  mask = np.asarray(out["mask_BN"])
  assert mask.all()  # no stop ids: every row decodes all 20 columns
  m = loop_mask(out["positions_BT"][:, :-1], out["segment_ids_BT"][:, :-1], 1, 3)
  np.testing.assert_allclose(scored(out, m), np.asarray(out["behavior_logp_BN"]), atol=2e-4)


def test_ring_buffer_bytes():
  assert cache_lib.ring_buffer_bytes(CFG, 2, 3, 100) == 2 * 2 * 5 * 2 * 8 * 4
  assert cache_lib.ring_buffer_bytes(CFG, 2, 300, 10) == 2 * 2 * 10 * 2 * 8 * 4  # never more than the slots


@pytest.mark.parametrize("kw, field", [({"kv_cache": "fp4"}, "sampler.kv_cache"),
                                       ({"kv_window": 0}, "sampler.kv_window"), ({"kv_sinks": -1}, "sampler.kv_sinks")])
def test_sampler_config_errors(kw, field):
  with pytest.raises(ValueError, match=field):
    SamplerConfig(max_new_tokens=2, **kw)
