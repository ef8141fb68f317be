"""Chunked log-prob head: golden numbers, equality with the plain path (values and gradients)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, forward, init_params, logprobs_from_logits, token_logprobs

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                  qk_norm=True)
T = 7


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(cfg):
  """Weights scaled up from init so the log-probs are far from uniform."""
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 15.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(cfg, jax.random.key(0)))


PARAMS = random_params(CFG)
TOKENS = jax.random.randint(jax.random.key(1), (2, T), 0, 32)
TARGETS = jax.random.randint(jax.random.key(2), (2, T), 0, 32)
POS = jnp.array([[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3]])
SEG = jnp.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 2, 2, 2, 2]])  # left padding / packing


def plain(params, temperature=1.0, cfg=CFG):
  logits = forward(params, TOKENS, cfg, positions_BT=POS, segment_ids_BT=SEG)
  return logprobs_from_logits(logits, TARGETS, temperature)


def chunked(params, chunk_size, temperature=1.0, cfg=CFG, **kw):
  return token_logprobs(params, TOKENS, TARGETS, cfg, positions_BT=POS, segment_ids_BT=SEG,
                        temperature=temperature, chunk_size=chunk_size, **kw)


def test_logprobs_from_logits_golden():
  logits = jnp.array([[[0.0, 0.0], [1.0, 0.0]]])
  targets = jnp.array([[1, 0]])
  np.testing.assert_allclose(logprobs_from_logits(logits, targets), [[np.log(0.5), 1 - np.log(np.e + 1)]],
                             rtol=1e-6)
  # Temperature 0.5 doubles the logits: log(e^2 / (e^2 + 1)).
  np.testing.assert_allclose(logprobs_from_logits(logits, targets, 0.5)[0, 1], 2 - np.log(np.e ** 2 + 1),
                             rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 64])  # 3 and 4 do not divide T = 7
def test_chunked_equals_plain(chunk_size):
  got = jax.jit(lambda p: chunked(p, chunk_size, 0.7)["logp_BT"])(PARAMS)
  want = jax.jit(lambda p: plain(p, 0.7))(PARAMS)
  assert got.shape == (2, T) and got.dtype == jnp.float32
  assert float(jnp.min(want)) < -4.0  # far from uniform (log 1/32 = -3.47): the test has teeth
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [3, 7])
def test_chunked_gradients_equal_plain(chunk_size):
  w_BT = jax.random.normal(jax.random.key(3), (2, T))
  g_chunk = jax.jit(jax.grad(lambda p: jnp.sum(w_BT * chunked(p, chunk_size, 0.7)["logp_BT"])))(PARAMS)
  g_plain = jax.jit(jax.grad(lambda p: jnp.sum(w_BT * plain(p, 0.7))))(PARAMS)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), g_chunk, g_plain)
  assert float(jnp.abs(g_plain["lm_head"]).max()) > 0


def test_entropy_and_topk_match_numpy():
  out = jax.jit(lambda p: chunked(p, 3, 0.7, with_entropy=True, topk=3))(PARAMS)
  logits = np.asarray(forward(PARAMS, TOKENS, CFG, positions_BT=POS, segment_ids_BT=SEG), np.float64) / 0.7
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  entropy = -(np.exp(logp) * logp).sum(-1)
  np.testing.assert_allclose(out["entropy_BT"], entropy, atol=1e-5)
  order = np.argsort(-logp, axis=-1)[..., :3]
  np.testing.assert_array_equal(out["topk_ids_BTk"], order)
  np.testing.assert_allclose(out["topk_logp_BTk"], np.take_along_axis(logp, order, -1), atol=1e-5)
  assert out["topk_ids_BTk"].shape == (2, T, 3)


def test_entropy_gradient_equals_plain():
  def plain_entropy(p):
    logp = jax.nn.log_softmax(forward(p, TOKENS, CFG, positions_BT=POS, segment_ids_BT=SEG) / 0.7)
    return jnp.sum(-jnp.exp(logp) * logp)

  g_chunk = jax.jit(jax.grad(lambda p: jnp.sum(chunked(p, 4, 0.7, with_entropy=True)["entropy_BT"])))(PARAMS)
  g_plain = jax.jit(jax.grad(plain_entropy))(PARAMS)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), g_chunk, g_plain)


def test_perturb_and_tied_embeddings_pass_through():
  tied = dataclasses.replace(CFG, tie_embeddings=True)
  params = {k: v for k, v in PARAMS.items() if k != "lm_head"}
  perturb = (jnp.array([-1.0, -2.0]), jax.random.key(4))
  got = token_logprobs(params, TOKENS, TARGETS, tied, chunk_size=4, perturb=perturb)["logp_BT"]
  want = logprobs_from_logits(forward(params, TOKENS, tied, perturb=perturb), TARGETS)
  np.testing.assert_allclose(got, want, atol=1e-5)
  unperturbed = token_logprobs(params, TOKENS, TARGETS, tied, chunk_size=4)["logp_BT"]
  assert not np.allclose(got, unperturbed, atol=1e-3)


def test_nonpositive_temperature_raises():
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs(PARAMS, TOKENS, TARGETS, CFG, temperature=0.0)


MOE = dataclasses.replace(CFG, d_ff=32, num_experts=4, experts_per_token=2)


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, n_layers=1), dataclasses.replace(CFG, layer_unroll=2),
                                 dataclasses.replace(CFG, remat="full"), MOE],
                         ids=["scan", "one_layer", "unrolled", "remat", "moe"])
@pytest.mark.parametrize("q0", [1, 4])
def test_query_start_equals_slicing_values_and_gradients(cfg, q0):
  """Scoring only positions >= query_start (the last layer skips the others' outputs) equals slicing
  the full result: log-probs, entropy and the gradient of every parameter; ALP noise included."""
  params = random_params(cfg)
  perturb = (jnp.full((cfg.n_layers,), -1.0), jax.random.key(3))
  weight_T = jnp.linspace(0.5, 1.5, T)

  def loss(params, query_start):
    out = chunked(params, 3, cfg=cfg, with_entropy=True, perturb=perturb, query_start=query_start)
    if not query_start:
      out = {k: v if k in ("router_aux_loss", "routes_BTLk") else v[:, q0:] for k, v in out.items()}
    return jnp.sum(out["logp_BT"] * weight_T[None, q0:]) + 0.1 * jnp.sum(out["entropy_BT"]), out

  # jitted: eagerly, the scanned layers' value-and-grad dispatched op by op (33 s of a 1-layer test on 2 cores)
  grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (l_full, full), g_full = grad(params, 0)
  (l_q0, sliced), g_q0 = grad(params, q0)
  assert sliced["logp_BT"].shape == (2, T - q0)
  for name in ("logp_BT", "entropy_BT"):
    np.testing.assert_allclose(sliced[name], full[name], rtol=1e-5, atol=1e-5, err_msg=name)
  if cfg.is_moe:
    np.testing.assert_array_equal(sliced["routes_BTLk"], full["routes_BTLk"])  # all T positions
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_q0), jax.tree.leaves(g_full)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=jax.tree_util.keystr(path))
  assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g_q0["layers"]))
