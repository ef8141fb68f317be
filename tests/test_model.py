"""Transformer: numbers against an independent numpy reference, masks, cache, params, ALP hook."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from jaxrl_llm.models import (ModelConfig, forward, forward_with_cache, hidden, init_cache, init_params,
                              param_axes, param_shapes)
from jaxrl_llm.models import layers
from jaxrl_llm.models.layers import rms_norm, rope

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
FULL_CFG = dataclasses.replace(CFG, qk_norm=True, attn_bias=True)  # Qwen2 biases + Qwen3 qk-norm

fwd = jax.jit(forward, static_argnames="cfg")
fwd_cache = jax.jit(forward_with_cache, static_argnames="cfg")
hid = jax.jit(hidden, static_argnames="cfg")


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def random_params(cfg, seed=0, scale=0.3):
  """Params with every leaf random (norms around 1, non-zero biases) so no term is trivially 1 or 0."""
  flat, unravel = ravel_pytree(init_params(cfg, jax.random.key(seed)))
  noise = unravel(jax.random.normal(jax.random.key(seed + 1), flat.shape))  # one draw: cheap to compile
  return jax.tree_util.tree_map_with_path(
      lambda path, z: 1.0 + 0.2 * z if "norm" in jax.tree_util.keystr(path) else scale * z, noise)


# ---------------------------------------------------------------- numpy reference (float64)

def np_rms(x, w, eps):
  return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_rope(x, pos, theta):
  """Rotation of the pairs (i, i + hd/2) by angle pos * theta^(-2i/hd), written per pair."""
  hd = x.shape[-1]
  out = np.empty_like(x)
  for i in range(hd // 2):
    ang = pos[:, :, None] * theta ** (-2.0 * i / hd)
    a, b = x[..., i], x[..., i + hd // 2]
    out[..., i] = a * np.cos(ang) - b * np.sin(ang)
    out[..., i + hd // 2] = b * np.cos(ang) + a * np.sin(ang)
  return out


def np_forward(params, tokens, cfg, positions=None, segments=None):
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  B, T = tokens.shape
  positions = np.broadcast_to(np.arange(T), (B, T)) if positions is None else np.asarray(positions)
  segments = np.ones((B, T), int) if segments is None else np.asarray(segments)
  G, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
  h = p["embed"][np.asarray(tokens)]
  for l in range(cfg.n_layers):
    lp = {k: v[l] for k, v in p["layers"].items()}
    x = np_rms(h, lp["attn_norm"], cfg.rms_eps)
    q = np.einsum("btd,dhk->bthk", x, lp["wq"])
    k = np.einsum("btd,dhk->bthk", x, lp["wk"])
    v = np.einsum("btd,dhk->bthk", x, lp["wv"])
    if cfg.attn_bias:
      q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if cfg.qk_norm:
      q, k = np_rms(q, lp["q_norm"], cfg.rms_eps), np_rms(k, lp["k_norm"], cfg.rms_eps)
    q, k = np_rope(q, positions, cfg.rope_theta), np_rope(k, positions, cfg.rope_theta)
    attn = np.zeros_like(q)
    for b in range(B):
      for head in range(cfg.n_heads):
        kv = head // G
        scores = q[b, :, head] @ k[b, :, kv].T / np.sqrt(hd)
        allowed = np.tril(np.ones((T, T), bool)) & (segments[b][:, None] == segments[b][None, :])
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        attn[b, :, head] = (probs / probs.sum(-1, keepdims=True)) @ v[b, :, kv]
    h = h + np.einsum("bthk,hkd->btd", attn, lp["wo"])
    x = np_rms(h, lp["mlp_norm"], cfg.rms_eps)
    gate = x @ lp["w_gate"]
    h = h + ((gate / (1 + np.exp(-gate))) * (x @ lp["w_up"])) @ lp["w_down"]
  h = np_rms(h, p["final_norm"], cfg.rms_eps)
  return h @ (p["embed"].T if cfg.tie_embeddings else p["lm_head"])


# ---------------------------------------------------------------- config and params

@pytest.mark.parametrize("change, field", [
    (dict(n_kv_heads=3), "model.n_kv_heads"),
    (dict(head_dim=7), "model.head_dim"),
    (dict(d_model=0), "model.d_model"),
    (dict(dtype="int8"), "model.dtype"),
    (dict(rms_eps=0.0), "model.rms_eps"),
    (dict(layer_unroll=0), "model.layer_unroll"),
])
def test_config_validation_names_the_field(change, field):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(CFG, **change)


@pytest.mark.parametrize("cfg", [CFG, FULL_CFG, dataclasses.replace(CFG, tie_embeddings=True, param_dtype="bfloat16")])
def test_params_match_shapes_and_axes(cfg):
  params = init_params(cfg, jax.random.key(0))
  shapes = param_shapes(cfg)
  axes = param_axes(cfg)
  assert jax.tree.structure(params) == jax.tree.structure(shapes)
  flat_p = jax.tree.leaves_with_path(params)
  flat_axes = dict(jax.tree.leaves_with_path(axes, is_leaf=lambda x: isinstance(x, tuple)))
  for (path, x), s in zip(flat_p, jax.tree.leaves(shapes)):
    assert x.shape == s.shape and x.dtype == s.dtype == jnp.dtype(cfg.param_dtype)
    assert len(flat_axes[path]) == x.ndim, path
  layers = params["layers"]
  assert ("bq" in layers) == cfg.attn_bias and ("q_norm" in layers) == cfg.qk_norm
  assert ("lm_head" in params) == (not cfg.tie_embeddings)
  assert layers["wq"].shape == (2, 32, 4, 8) and layers["wk"].shape == (2, 32, 2, 8)
  assert layers["wo"].shape == (2, 4, 8, 32) and layers["w_down"].shape == (2, 64, 32)
  np.testing.assert_array_equal(np.asarray(layers["attn_norm"], np.float32), 1.0)
  std = float(jnp.std(params["embed"].astype(jnp.float32)))
  assert 0.015 < std < 0.025


def test_init_is_deterministic_and_leaves_are_independent():
  a = init_params(FULL_CFG, jax.random.key(0))
  np.testing.assert_array_equal(a["layers"]["wq"], init_params(FULL_CFG, jax.random.key(0))["layers"]["wq"])
  assert not np.allclose(a["embed"], a["lm_head"].T, atol=1e-3)
  assert not np.allclose(a["layers"]["wk"], a["layers"]["wv"], atol=1e-3)
  np.testing.assert_array_equal(a["layers"]["bq"], 0.0)
  np.testing.assert_array_equal(a["layers"]["q_norm"], 1.0)
  assert not np.allclose(a["embed"], init_params(FULL_CFG, jax.random.key(1))["embed"], atol=1e-3)


# ---------------------------------------------------------------- building blocks

def test_rms_norm_golden():
  x = jnp.array([[3.0, 4.0]])
  w = jnp.array([1.0, 2.0])
  # rms = sqrt((9 + 16) / 2) = sqrt(12.5)
  expected = np.array([[3.0, 8.0]]) / np.sqrt(12.5 + 1e-6)
  np.testing.assert_allclose(rms_norm(x, w, 1e-6), expected, rtol=1e-6)


def test_rope_matches_pairwise_rotation_and_is_relative():
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
  pos = jnp.array([[0, 1, 2, 3, 4], [7, 3, 0, 100, 2]])
  np.testing.assert_allclose(rope(x, pos, 10000.0), np_rope(np.asarray(x, np.float64), np.asarray(pos), 10000.0),
                             atol=1e-5)
  # <rope(q, m), rope(k, n)> depends only on m - n.
  q, k = x[:1, :1], x[1:, :1]
  rope_j = jax.jit(rope, static_argnums=2)
  dot = lambda m, n: float(jnp.sum(rope_j(q, jnp.array([[m]]), 1e4) * rope_j(k, jnp.array([[n]]), 1e4)))
  assert dot(5, 2) == pytest.approx(dot(13, 10), abs=1e-5)
  assert dot(5, 2) != pytest.approx(dot(5, 3), abs=1e-3)


# ---------------------------------------------------------------- forward against numpy

@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(FULL_CFG, tie_embeddings=True)])
def test_forward_matches_numpy_reference(cfg):
  params = random_params(cfg)
  tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, cfg.vocab_size)
  logits = fwd(params, tokens, cfg)
  assert logits.dtype == jnp.float32 and logits.shape == (2, 6, 32)
  np.testing.assert_allclose(logits, np_forward(params, tokens, cfg), atol=1e-4, rtol=1e-4)


def test_forward_with_packing_and_positions_matches_numpy():
  params = random_params(FULL_CFG)
  tokens = jax.random.randint(jax.random.key(3), (1, 7), 0, 32)
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 0]])
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 0]])
  got = fwd(params, tokens, FULL_CFG, positions_BT=pos, segment_ids_BT=seg)
  np.testing.assert_allclose(got, np_forward(params, tokens, FULL_CFG, pos, seg), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- masking invariants

def test_causality_future_tokens_do_not_change_past_logits():
  params = random_params(FULL_CFG)
  a = jax.random.randint(jax.random.key(4), (2, 8), 0, 32)
  b = a.at[:, 5:].set((a[:, 5:] + 7) % 32)
  la, lb = fwd(params, a, FULL_CFG), fwd(params, b, FULL_CFG)
  np.testing.assert_array_equal(la[:, :5], lb[:, :5])
  assert not np.allclose(la[:, 5:], lb[:, 5:])


def test_causality_gradient_wrt_input_embedding_is_zero_for_future():
  """d logits[t] / d embed-row(token at t') == 0 for t' > t (distinct tokens so rows are per position)."""
  params = random_params(CFG)
  tokens = jnp.arange(6)[None] + 3
  t = 2

  def logit_sum(embed):
    return fwd({**params, "embed": embed}, tokens, CFG)[0, t].sum()

  g = jax.grad(logit_sum)(params["embed"])
  row_norm = np.abs(np.asarray(g)).sum(-1)
  assert np.all(row_norm[tokens[0, t + 1:]] == 0.0)
  assert np.all(row_norm[tokens[0, :t + 1]] > 0.0)


def test_left_padding_invariance():
  params = random_params(FULL_CFG)
  real = jax.random.randint(jax.random.key(5), (1, 4), 1, 32)
  padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), real], axis=1)
  pos = jnp.array([[0, 0, 0, 0, 1, 2, 3]])
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1]])
  got = fwd(params, padded, FULL_CFG, positions_BT=pos, segment_ids_BT=seg)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got[:, 3:], fwd(params, real, FULL_CFG), atol=1e-5)


def test_packing_invariance():
  params = random_params(FULL_CFG)
  a = jax.random.randint(jax.random.key(6), (1, 3), 0, 32)
  b = jax.random.randint(jax.random.key(7), (1, 4), 0, 32)
  packed = jnp.concatenate([a, b], axis=1)
  got = fwd(params, packed, FULL_CFG, positions_BT=jnp.array([[0, 1, 2, 0, 1, 2, 3]]),
            segment_ids_BT=jnp.array([[1, 1, 1, 2, 2, 2, 2]]))
  np.testing.assert_allclose(got[:, :3], fwd(params, a, FULL_CFG), atol=1e-5)
  np.testing.assert_allclose(got[:, 3:], fwd(params, b, FULL_CFG), atol=1e-5)


def test_all_padding_row_is_finite():
  params = random_params(CFG)
  tokens = jnp.zeros((1, 5), jnp.int32)
  got = fwd(params, tokens, CFG, segment_ids_BT=jnp.zeros((1, 5), jnp.int32))
  assert np.all(np.isfinite(got))


# ---------------------------------------------------------------- KV cache

@pytest.mark.parametrize("cfg", [FULL_CFG])
def test_prefill_then_decode_equals_full_forward_with_left_padding(cfg):
  params = random_params(cfg)
  B, P, N = 2, 5, 4
  lens = jnp.array([5, 2])
  tokens = jax.random.randint(jax.random.key(8), (B, P + N), 1, 32)
  col = jnp.arange(P + N)[None]
  first = (P - lens)[:, None]
  seg = (col >= first).astype(jnp.int32)
  pos = jnp.where(seg > 0, col - first, 0)
  full = fwd(params, tokens, cfg, positions_BT=pos, segment_ids_BT=seg)

  cache = init_cache(cfg, B, P + N)
  # Prefill in two chunks (3 then 2 tokens), then decode one token at a time.
  pieces = []
  for lo, hi in [(0, 3), (3, 5)] + [(t, t + 1) for t in range(P, P + N)]:
    logits, cache = fwd_cache(params, tokens[:, lo:hi], cache, cfg, positions_BT=pos[:, lo:hi],
                              segment_ids_BT=seg[:, lo:hi])
    pieces.append(logits)
  assert int(cache["index"]) == P + N
  np.testing.assert_array_equal(cache["segment_ids_BS"], seg)
  np.testing.assert_array_equal(cache["positions_BS"], pos)
  got = jnp.concatenate(pieces, axis=1)
  real = np.asarray(seg) > 0
  assert float(jnp.max(jnp.abs(got - full)[real])) < 1e-5


def test_cache_dtype_follows_compute_dtype():
  cache = init_cache(dataclasses.replace(CFG, dtype="bfloat16"), 3, 7)
  assert cache["k"].shape == (2, 3, 7, 2, 8) and cache["k"].dtype == jnp.bfloat16
  assert cache["segment_ids_BS"].shape == (3, 7) and int(cache["index"]) == 0


# ---------------------------------------------------------------- dtype, remat, ALP perturbation

def test_bf16_compute_is_close_but_not_identical():
  params = random_params(CFG)
  tokens = jax.random.randint(jax.random.key(9), (2, 6), 0, 32)
  bf16 = dataclasses.replace(CFG, dtype="bfloat16")
  l32, l16 = fwd(params, tokens, CFG), fwd(params, tokens, bf16)
  assert l16.dtype == jnp.float32
  err = float(jnp.max(jnp.abs(l32 - l16)))
  assert 0.0 < err < 0.1 * float(jnp.max(jnp.abs(l32)))


def test_remat_gives_same_values_and_gradients():
  params = random_params(CFG)
  tokens = jax.random.randint(jax.random.key(10), (2, 6), 0, 32)
  remat = dataclasses.replace(CFG, remat=True)
  loss = lambda p, cfg: jnp.mean(jax.nn.log_softmax(forward(p, tokens, cfg))[..., 0])
  v0, g0 = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=CFG)))(params)
  v1, g1 = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=remat)))(params)
  np.testing.assert_allclose(v0, v1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g0, g1)


@pytest.mark.parametrize("cfg", [CFG, FULL_CFG])
def test_unrolled_layers_give_same_values_gradients_and_cache(cfg):
  """`layer_unroll` changes the schedule only: training forward/backward and cached decode agree."""
  params = random_params(cfg)
  tokens = jax.random.randint(jax.random.key(11), (2, 6), 0, 32)
  unrolled = dataclasses.replace(cfg, layer_unroll=cfg.n_layers)
  loss = lambda p, c: jnp.mean(jax.nn.log_softmax(forward(p, tokens, c))[..., 0])
  v0, g0 = jax.jit(jax.value_and_grad(functools.partial(loss, c=cfg)))(params)
  v1, g1 = jax.jit(jax.value_and_grad(functools.partial(loss, c=unrolled)))(params)
  np.testing.assert_allclose(v0, v1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g0, g1)
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  outs = [fwd_cache(params, tokens, init_cache(c, 2, 8), c, positions_BT=pos)[0] for c in (cfg, unrolled)]
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_perturb_adds_scaled_gaussian_before_layer_norm():
  """Noise at layer 0 only equals shifting the embedding rows of (distinct) input tokens."""
  params = random_params(CFG)
  tokens = jnp.arange(8).reshape(2, 4) + 10
  key = jax.random.key(11)
  sigma = 0.5
  log_sigma_L = jnp.array([np.log(sigma), -jnp.inf])
  got = hid(params, tokens, CFG, perturb=(log_sigma_L, key))
  noise_BTD = jax.random.normal(jax.random.fold_in(key, 0), (2, 4, 32), jnp.float32)
  embed = params["embed"].at[tokens.reshape(-1)].add(sigma * noise_BTD.reshape(8, 32))
  expected = hid({**params, "embed": embed}, tokens, CFG)
  np.testing.assert_allclose(got, expected, atol=1e-5)
  # Deterministic given the key; a different key changes the output.
  np.testing.assert_array_equal(got, hid(params, tokens, CFG, perturb=(log_sigma_L, key)))
  other = hid(params, tokens, CFG, perturb=(log_sigma_L, jax.random.key(12)))
  assert not np.allclose(got, other)


def test_perturb_gradient_flows_to_log_sigma():
  params = random_params(CFG)
  tokens = jax.random.randint(jax.random.key(13), (2, 5), 0, 32)

  def loss(log_sigma_L):
    logits = forward(params, tokens, CFG, perturb=(log_sigma_L, jax.random.key(14)))
    return jnp.mean(jax.nn.log_softmax(logits)[..., 1])

  g = jax.jit(jax.grad(loss))(jnp.full((2,), -1.0))
  assert g.shape == (2,) and np.all(np.isfinite(g)) and np.all(g != 0.0)
  # Zero noise (sigma -> 0) reproduces the unperturbed forward.
  quiet = fwd(params, tokens, CFG, perturb=(jnp.full((2,), -jnp.inf), jax.random.key(14)))
  np.testing.assert_allclose(quiet, fwd(params, tokens, CFG), atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_equals_attention_in_the_model_layout(dtype):
  """`layers.decode_attention` (the decode-loop cache: keys [B, K, hd, S], values [B, K, S, hd], summed products)
  computes `attention` of the [B, S, K, hd] layout: grouped heads, a masked slot ignored, T = 1 and T = 3 (a
  speculative verify); against a numpy reference of softmax(q·k / sqrt(hd)) v per query head."""
  B, S, K, Q, hd = 2, 7, 2, 3, 8
  keys = jax.random.split(jax.random.key(0), 3)
  k_BSKd = jax.random.normal(keys[1], (B, S, K, hd)).astype(dtype)
  v_BSKd = jax.random.normal(keys[2], (B, S, K, hd)).astype(dtype)
  for T in (1, 3):
    q_BTHd = jax.random.normal(keys[0], (B, T, K * Q, hd)).astype(dtype)
    mask_BTS = jnp.ones((B, T, S), bool).at[0, :, 2].set(False).at[1, :, 5:].set(False)
    got = layers.decode_attention(q_BTHd, jnp.transpose(k_BSKd, (0, 2, 3, 1)), jnp.transpose(v_BSKd, (0, 2, 1, 3)),
                                  mask_BTS)
    assert got.dtype == dtype
    want = layers.attention(q_BTHd, k_BSKd, v_BSKd, mask_BTS)
    q, k, v, m = (np.asarray(x, np.float64) for x in (q_BTHd, k_BSKd, v_BSKd, mask_BTS))
    ref = np.zeros((B, T, K * Q, hd))
    for b, t, h in np.ndindex(B, T, K * Q):
      s = k[b, :, h // Q] @ q[b, t, h] / np.sqrt(hd)
      s = np.where(m[b, t] > 0, s, -np.inf)
      p = np.exp(s - s.max())
      ref[b, t, h] = (p / p.sum()) @ v[b, :, h // Q]
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), atol=tol, rtol=tol)


def test_decode_attention_of_an_int8_cache_equals_attention_to_its_dequantised_slots():
  """With an int8 cache's scales, `decode_attention` factors each key's scale out of its score and each value's into
  its probability: the attention to the dequantised slots (q·s, a numpy reference in float64), in the compute
  dtype."""
  from jaxrl_llm.models.cache import quantize_kv
  B, S, K, Q, hd, T = 2, 7, 2, 3, 8, 3
  keys = jax.random.split(jax.random.key(1), 3)
  (kq_BSKd, ks_BSK), (vq_BSKd, vs_BSK) = (quantize_kv(3.0 * jax.random.normal(k, (B, S, K, hd))) for k in keys[1:])
  q_BTHd = jax.random.normal(keys[0], (B, T, K * Q, hd))
  mask_BTS = jnp.ones((B, T, S), bool).at[0, :, 2].set(False).at[1, :, 5:].set(False)
  got = layers.decode_attention(q_BTHd, jnp.transpose(kq_BSKd, (0, 2, 3, 1)), jnp.transpose(vq_BSKd, (0, 2, 1, 3)),
                                mask_BTS, jnp.transpose(ks_BSK, (0, 2, 1)), jnp.transpose(vs_BSK, (0, 2, 1)),
                                jnp.float32)
  assert got.dtype == jnp.float32
  q, m = np.asarray(q_BTHd, np.float64), np.asarray(mask_BTS)
  k = np.asarray(kq_BSKd, np.float64) * np.asarray(ks_BSK, np.float64)[..., None]
  v = np.asarray(vq_BSKd, np.float64) * np.asarray(vs_BSK, np.float64)[..., None]
  ref = np.zeros((B, T, K * Q, hd))
  for b, t, h in np.ndindex(B, T, K * Q):
    s = np.where(m[b, t], k[b, :, h // Q] @ q[b, t, h] / np.sqrt(hd), -np.inf)
    p = np.exp(s - s.max())
    ref[b, t, h] = (p / p.sum()) @ v[b, :, h // Q]
  np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=1e-5, rtol=1e-5)


def test_output_major_weights_project_as_the_stored_ones():
  """`layers.OutIn` (the decode view's output-major copy of a weight) gives `project`'s product: a [D, H, hd]
  query weight and an [H, hd, D] output weight (two input axes), against numpy; the decode view holds every dense
  projection so (an MoE layer's experts excepted)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 8)).astype(np.float32)
  wq = rng.normal(size=(8, 2, 4)).astype(np.float32)
  got = layers.project(jnp.asarray(x), layers.OutIn.of(jnp.asarray(wq)))
  np.testing.assert_allclose(np.asarray(got), np.einsum("btd,dhk->bthk", x, wq), rtol=1e-5, atol=1e-5)
  wo = rng.normal(size=(2, 4, 8)).astype(np.float32)
  got = layers.project(jnp.asarray(x).reshape(2, 3, 8), layers.OutIn.of(jnp.asarray(wo), in_axes=2))
  np.testing.assert_allclose(np.asarray(got), x @ wo.reshape(8, 8), rtol=1e-5, atol=1e-5)
  from jaxrl_llm.models.transformer import unstack_layers
  view = unstack_layers(init_params(CFG, jax.random.key(0)), CFG)
  assert all(isinstance(view["layers"][0][k], layers.OutIn) for k in ("wq", "wk", "wv", "wo", "w_gate", "w_down"))


@pytest.mark.parametrize("tie", [True, False])
def test_decode_views_head_gives_the_models_logits(tie):
  """The decode view's output-major vocabulary head (`unstack_layers`' "head_out_major") gives the stored head's
  logits, against numpy, for a tied and an untied head, both within `HEAD_OUT_MAJOR_ROWS` (the output-major
  product) and outside them (the stored one)."""
  from jaxrl_llm.models import transformer
  cfg = dataclasses.replace(CFG, tie_embeddings=tie)
  params = init_params(cfg, jax.random.key(1))
  view = transformer.unstack_layers(params, cfg)
  assert isinstance(view["head_out_major"], layers.OutIn)
  w_DV = np.asarray(params["embed"]).T if tie else np.asarray(params["lm_head"])
  for rows in (1, 3, transformer.HEAD_OUT_MAJOR_ROWS[1] + 2):
    h = np.random.default_rng(rows).normal(size=(1, rows, cfg.d_model)).astype(np.float32)
    got = transformer.logits_from_hidden(view, jnp.asarray(h), cfg)
    np.testing.assert_allclose(np.asarray(got), h @ w_DV, rtol=1e-5, atol=1e-5)
  # and the few-row product reads that head: a zeroed copy zeroes 3 rows' logits, not 1 row's or 50's
  zeroed = {**view, "head_out_major": layers.OutIn(jnp.zeros_like(view["head_out_major"].w_RD), (cfg.vocab_size,))}
  logits = lambda rows: np.asarray(transformer.logits_from_hidden(zeroed, jnp.ones((1, rows, cfg.d_model)), cfg))
  assert not np.any(logits(3)) and np.any(logits(1)) and np.any(logits(50))
