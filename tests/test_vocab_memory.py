"""Memory at a real vocabulary: no [B, T, V] float32 logits in the learner, sampler or teacher scoring.

Memory checks compile (never run) at V = 65,536 with a 1-layer d = 32 model, where one [B, T, V]
float32 array is 512 MiB and everything else is small, and bound XLA's temp allocation
(`compiled.memory_analysis()`) well below it. The value checks run the chunked paths at a tiny
vocabulary with chunks of a few positions and compare them with the full-vocabulary computation.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import learner
from jaxrl_llm.distill import teacher as teacher_lib
from jaxrl_llm.distill.topk_cache import build_topk_cache
from jaxrl_llm.models import ModelConfig, forward, init_params, logprobs_from_logits, token_logprobs
from jaxrl_llm.models.cache import cache_bytes, init_cache
from jaxrl_llm.models.logprobs import chunk_positions
from jaxrl_llm.sampling import generate
from jaxrl_llm.sampling.config import SamplerConfig

BIG = ModelConfig(vocab_size=65536, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                  max_seq_len=512)
B, T, N, K = 8, 256, 128, 8
FULL_BTV_BYTES = B * T * BIG.vocab_size * 4  # 512 MiB


def _sampler_cfg(**kw):
  return SamplerConfig(stop_ids=(1,), **kw)


def _temp_bytes(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def big_params():
  return jax.eval_shape(lambda: init_params(BIG, jax.random.key(0)))


def _batch(n_new, extra=None, seq_len=T):
  z = lambda *s, dt=jnp.float32: jax.ShapeDtypeStruct(s, dt)
  return learner.Batch(sequence_BT=z(B, seq_len, dt=jnp.int32), positions_BT=z(B, seq_len, dt=jnp.int32),
                       segment_ids_BT=z(B, seq_len, dt=jnp.int32), mask_BN=z(B, n_new), adv_BN=z(B, n_new),
                       behavior_logp_BN=z(B, n_new), versions_BN=z(B, n_new, dt=jnp.int32),
                       lag_B=z(B, dt=jnp.int32), extra=extra)


def test_full_logits_would_be_large(big_params):
  """The bound below is meaningful: the unchunked log-prob gradient holds at least one [B, T, V] array."""
  tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
  unchunked = jax.grad(lambda p, t: logprobs_from_logits(forward(p, t, BIG), t).sum())
  assert _temp_bytes(unchunked, big_params, tok) >= FULL_BTV_BYTES


@pytest.mark.parametrize("loss", ["ppo_clip", "opd_topk_kl"])
def test_train_step_holds_no_btv_logits(big_params, loss):
  tx = learner.make_optimizer(1e-3)
  extra = None
  if loss == "opd_topk_kl":
    extra = {"teacher_topk_ids_BNk": jax.ShapeDtypeStruct((B, N, K), jnp.int32),
             "teacher_topk_logp_BNk": jax.ShapeDtypeStruct((B, N, K), jnp.float32)}
  state = jax.eval_shape(lambda p: learner.init_state(p, tx), big_params)
  step = learner.make_train_step(BIG, tx, loss)
  temp = step.lower(state, _batch(N, extra), jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes
  assert temp < FULL_BTV_BYTES // 4, temp


def test_generate_holds_no_bpv_logits(big_params):
  """Prefill needs the last prompt position's logits only; decode one position per step."""
  cfg = _sampler_cfg(max_new_tokens=4)
  temp = _temp_bytes(lambda p, t, n, k: generate(p, t, n, k, BIG, cfg), big_params,
                     jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32),
                     jax.random.key(0))
  assert temp < FULL_BTV_BYTES // 4, temp


KV = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=64,
                 max_seq_len=512)


@pytest.mark.parametrize("kv_cache", ["full", "int8"])
@pytest.mark.parametrize("decode_unroll", [True, False], ids=["view", "scan"])
def test_generate_holds_one_full_width_kv_cache(kv_cache, decode_unroll):
  """The prefill fills the prompt's slots only and the decode view adds the room for N tokens, so the full-width
  cache (32 MiB here, everything else small) never exists beside its copy in the decode loop's layout: XLA's temp
  is the cache plus at most one layer's keys and values in float32 (8 MiB each, what a layer's attention reads; it
  was the cache plus 27.5 MiB). The layer scan (`decode_unroll=False`) carries the stacked cache and writes each
  layer's new slots in place: when the scan output the layers' caches, they were a second whole cache beside its
  input at every step (94 MiB, int8 included)."""
  cfg = dataclasses.replace(KV, decode_unroll=decode_unroll)
  rows, P, new = 32, 8, 248
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  kv_dtype = "int8" if kv_cache == "int8" else "compute"
  full = cache_bytes(jax.eval_shape(lambda: init_cache(cfg, rows, P + new, kv_dtype)))
  sc = _sampler_cfg(max_new_tokens=new, kv_cache=kv_cache)
  temp = _temp_bytes(lambda p, t, n, k: generate(p, t, n, k, cfg, sc), params,
                     jax.ShapeDtypeStruct((rows, P), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
                     jax.random.key(0))
  layer_f32 = rows * (P + new) * cfg.n_kv_heads * cfg.head_dim * 4
  assert 0 <= temp - full < 2.5 * layer_f32, (temp, full, layer_f32)  # view 1.0, scan 2.3 (its keys and values)


@pytest.mark.parametrize("grad", [False, True])
def test_scoring_from_query_start_copies_no_layer_weights(grad):
  """Scoring only the completion (`query_start`, the reference and π_old scorers and the learner) runs the last layer
  apart from the layer scan. The scan indexes the stacked weights: as its inputs, their `[:-1]` slices were a copy of
  all but one layer at every call. XLA's temps were 1.25x the 4 layers' weights (15.7 MB) in the forward and 1.30x
  in the gradient; now 0.50x and 0.80x (the last layer's weights and the layer a scan step reads)."""
  from jaxrl_llm.models import transformer
  cfg = ModelConfig(vocab_size=64, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=1024,
                    layer_unroll=1, remat="full")
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  layer_bytes = sum(x.size * 4 for x in jax.tree.leaves(params["layers"]))
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  score = lambda p, t: jnp.sum(transformer.hidden_with_routing(p, t, cfg, query_start=4)[0].astype(jnp.float32))
  temp = _temp_bytes(jax.grad(score) if grad else score, params, tokens)
  assert temp < (1.0 if grad else 0.6) * layer_bytes, (temp, layer_bytes)


def test_learner_step_updates_the_moments_in_place():
  """XLA's temps of the train step against the parameters (AdamW, clipped). They were 3.5x: the update's skip on a
  non-finite gradient, as a select of the new state against the old, made XLA copy both moments before overwriting
  them; optax's clip materialised a quotient per leaf; `isfinite` read the unscaled gradients after the scaled ones
  were due. Now 1.5x: the gradients and the activations (SmolLM2-135M: 0.71 GiB against 0.50 GiB of parameters)."""
  cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=1024,
                    layer_unroll=1, remat="full")
  tx = learner.make_optimizer(1e-5)
  state = jax.eval_shape(lambda: learner.init_state(init_params(cfg, jax.random.key(0)), tx))
  param_bytes = sum(x.size * 4 for x in jax.tree.leaves(state.params))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  batch = learner.Batch(sequence_BT=i32(1, 8), positions_BT=i32(1, 8), segment_ids_BT=i32(1, 8), mask_BN=f32(1, 4),
                        adv_BN=f32(1, 4), behavior_logp_BN=f32(1, 4), versions_BN=i32(1, 4), lag_B=i32(1), extra=None)
  step = learner.make_train_step(cfg, tx, "ppo_clip")
  temp = step.lower(state, batch, jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes
  assert temp < 1.8 * param_bytes, temp / param_bytes


@pytest.mark.parametrize("head", [False, True])
def test_teacher_scoring_holds_no_bnv(big_params, head):
  """Log-probs, top-k cache and (for full-distribution losses) the teacher's VocabHead, all chunked."""
  args = (big_params,) + tuple(jax.ShapeDtypeStruct((B, T), jnp.int32) for _ in range(3)) + (
      jax.ShapeDtypeStruct((B, N), jnp.float32),)
  score = lambda p, s, q, g, m: teacher_lib.score_completions(p, BIG, s, q, g, m, temperature=1.0, topk=K, head=head)
  chunked = _temp_bytes(score, *args)
  assert chunked < B * N * BIG.vocab_size * 4 // 4, chunked
  dense = _temp_bytes(lambda p, s, q, g, m: teacher_lib.teacher_logits(p, BIG, s, q, g, N), *args)
  assert dense >= B * N * BIG.vocab_size * 4  # the bound is meaningful: dense teacher logits are that large


# ----------------------------------------------------------------------------- values

SMALL = ModelConfig(vocab_size=48, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                    max_seq_len=32, tie_embeddings=False)
Bs, Ts, Ns = 3, 12, 6


def _small_batch(seed=0):
  rng = np.random.default_rng(seed)
  seq = jnp.asarray(rng.integers(0, SMALL.vocab_size, (Bs, Ts)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(Ts, dtype=jnp.int32), (Bs, Ts))
  seg = jnp.ones((Bs, Ts), jnp.int32)
  mask = jnp.asarray(rng.random((Bs, Ns)) > 0.2, jnp.float32)
  ids = jnp.asarray(rng.integers(0, SMALL.vocab_size, (Bs, Ns, 4)), jnp.int32)
  return seq, pos, seg, mask, ids


def test_chunk_positions_caps_b_c_v():
  assert chunk_positions(32, 256, 49152, 256) == 2  # 2^22 // (32 * 49152)
  assert chunk_positions(32, 256, 64, 256) == 256  # toy vocabularies keep whole-sequence chunks
  assert chunk_positions(1 << 10, 8, 1 << 20, 256) == 1  # never below one position
  assert chunk_positions(2, 5, 10, 256, max_chunk_elements=40) == 2


def test_capped_chunks_equal_the_full_vocabulary_numpy_reference():
  """logp, top-k, residual and gathered log-probs from 1-position chunks vs float64 numpy on full logits."""
  params = init_params(SMALL, jax.random.key(1))
  seq, pos, seg, _, _ = _small_batch()
  temp = 0.7
  ids = jnp.asarray(np.random.default_rng(2).integers(-1, SMALL.vocab_size, (Bs, Ts - 1, 5)), jnp.int32)
  out = token_logprobs(params, seq[:, :-1], seq[:, 1:], SMALL, positions_BT=pos[:, :-1], temperature=temp, topk=4,
                       gather_ids_BTk=ids, max_chunk_elements=Bs * SMALL.vocab_size)  # C = 1
  z = np.asarray(forward(params, seq[:, :-1], SMALL, positions_BT=pos[:, :-1]), np.float64) / temp
  lp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
  np.testing.assert_allclose(out["logp_BT"], np.take_along_axis(lp, np.asarray(seq[:, 1:])[..., None], -1)[..., 0],
                             atol=1e-5)
  order = np.argsort(-lp, axis=-1)[..., :4]
  np.testing.assert_array_equal(out["topk_ids_BTk"], order)
  top = np.take_along_axis(lp, order, -1)
  np.testing.assert_allclose(out["topk_logp_BTk"], top, atol=1e-5)
  np.testing.assert_allclose(out["topk_residual_logp_BT"], np.log1p(-np.exp(top).sum(-1)), atol=1e-5)
  want = np.where(np.asarray(ids) >= 0, np.take_along_axis(lp, np.maximum(np.asarray(ids), 0), -1), -np.inf)
  np.testing.assert_allclose(out["gathered_logp_BTk"], want, atol=1e-5)


def test_gathered_student_topk_equals_the_dense_path_in_value_and_gradient():
  params = init_params(SMALL, jax.random.key(3))
  seq, pos, seg, mask, ids = _small_batch(4)

  def chunked(p):
    return learner.completion_logprobs(p, seq, pos, seg, Ns, SMALL, 0.8, gather_ids_BNk=ids)["gathered_logp_BTk"]

  def dense(p):  # the full-vocabulary reference: log_softmax of the tempered logits at the ids
    logits = forward(p, seq[:, :-1], SMALL, positions_BT=pos[:, :-1], segment_ids_BT=seg[:, :-1])[:, Ts - Ns - 1:]
    return jnp.take_along_axis(jax.nn.log_softmax(logits / 0.8, -1), ids, axis=-1)

  np.testing.assert_allclose(chunked(params), dense(params), atol=1e-5)
  w = jnp.asarray(np.random.default_rng(5).standard_normal((Bs, Ns, 4)), jnp.float32)
  g_c = jax.grad(lambda p: jnp.sum(w * chunked(p)))(params)
  g_d = jax.grad(lambda p: jnp.sum(w * dense(p)))(params)
  for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_d)):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("topk", [5, SMALL.vocab_size])
def test_chunked_teacher_scores_equal_the_dense_path(topk):
  """The scorer (chunked lm-head) against the top-k cache built from the full teacher logits."""
  params = init_params(SMALL, jax.random.key(6))
  seq, pos, seg, mask, _ = _small_batch(7)
  chunked = teacher_lib.make_teacher_scorer(SMALL, 0.9, topk)(params, seq, pos, seg, mask)
  logits = teacher_lib.teacher_logits(params, SMALL, seq, pos, seg, Ns)
  cache = build_topk_cache(logits, topk, temperature=0.9)
  live = np.asarray(mask) > 0
  dense = {"teacher_logp_BN": logprobs_from_logits(logits, seq[:, -Ns:], 0.9),
           "teacher_topk_ids_BNk": cache.ids_BTk, "teacher_topk_logp_BNk": cache.logp_BTk,
           "teacher_topk_residual_logp_BN": cache.residual_logp_BT}
  assert sorted(chunked) == sorted(dense)
  for k, v in chunked.items():
    want = np.where(live[..., None] if v.ndim == 3 else live, np.asarray(dense[k]), 0)
    if k.endswith("ids_BNk"):
      np.testing.assert_array_equal(v, want, err_msg=k)
    else:
      np.testing.assert_allclose(v, want, atol=1e-5, err_msg=k)
