"""Shared-prompt rollouts: a GRPO group's prompt is prefilled / scored once, with the unshared results.

Every check compares against the row-by-row path (B rows of prompt work), which the sampler and
scorer tests elsewhere pin to golden values; here the two paths must agree: the same tokens, masks,
routes and layout, log-probs and gradients to fp32 rounding (different computations: allclose).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import learner
from jaxrl_llm.distill import teacher as teacher_lib
from jaxrl_llm.models import ModelConfig, init_params, token_logprobs
from jaxrl_llm.models.cache import groups_equal, repeat_rows
from jaxrl_llm.models.logprobs import query_hidden, token_logprobs_shared
from jaxrl_llm.models.transformer import hidden_shared_prefix, hidden_with_routing
from jaxrl_llm.sampling import SamplerConfig, generate, partial, prompt_layout
from jaxrl_llm.sampling import sampler as sampler_lib
from jaxrl_llm.sampling.quantize import int8_weight_only

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, qk_norm=True)
MOE = dataclasses.replace(CFG, num_experts=4, experts_per_token=2, layer_unroll=2)
G, P, N = 3, 6, 8
LENS = np.array([6, 2, 4])  # one group per prompt length: full width, short, middle
STOP = (5, 29)  # hit at several different steps in every case below (and missed by some rows)
SC = SamplerConfig(max_new_tokens=N, stop_ids=STOP, temperature=1.0)


@functools.partial(jax.jit, static_argnums=(0, 1))
def random_params(cfg, seed=0):
  """Weights scaled up from init so the next-token distributions are far from uniform."""
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 8.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(cfg, jax.random.key(seed)))


def grouped_prompts(seed=1, lens=LENS):
  """B = len(lens)·G rows: each prompt (left-padded to P) repeated G times, as the loop lays them out."""
  prompts = np.asarray(jax.random.randint(jax.random.key(seed), (len(lens), P), 4, 32))
  return jnp.asarray(np.repeat(prompts, G, 0)), jnp.asarray(np.repeat(lens, G))


def gen(params, tokens, lens, cfg=CFG, sc=SC, group_size=1, key=jax.random.key(2)):
  return generate(params, tokens, lens, key, cfg, dataclasses.replace(sc, group_size=group_size))


def assert_same_rollout(got, want, logp_atol=1e-5):
  for name, value in want.items():
    if name == "behavior_logp_BN":
      np.testing.assert_allclose(np.asarray(got[name]), np.asarray(value), rtol=0, atol=logp_atol, err_msg=name)
    else:
      np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)


def test_groups_equal_and_repeat_rows():
  x = np.arange(4)[:, None] * np.ones((1, 3), int)
  assert bool(groups_equal(jnp.asarray(np.repeat(x, 2, 0)), 2))
  assert not bool(groups_equal(jnp.asarray(np.repeat(x, 2, 0)), 4))  # groups of 4 span two prompts
  y = np.repeat(x, 2, 0)
  y[5, 2] = 99  # one token of one row differs
  assert not bool(groups_equal(jnp.asarray(y), 2))
  cache = {"k": jnp.arange(2 * 2 * 3).reshape(1, 2, 3, 1, 2), "v": jnp.zeros((1, 2, 3, 1, 2)),
           "positions_BS": jnp.array([[0, 1, 2], [5, 6, 7]]), "segment_ids_BS": jnp.ones((2, 3), jnp.int32),
           "index": jnp.array(3)}
  r = repeat_rows(cache, 3)
  np.testing.assert_array_equal(r["positions_BS"], [[0, 1, 2]] * 3 + [[5, 6, 7]] * 3)
  np.testing.assert_array_equal(r["k"][0, 4], cache["k"][0, 1])
  assert r["k"].shape == (1, 6, 3, 1, 2) and int(r["index"]) == 3


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_prefill_per_group_equals_every_row(cfg):
  """The shared branch on its own (no run-time check): the cache and first logits of every row."""
  params = random_params(cfg)
  tokens, lens = grouped_prompts()
  positions, segments = prompt_layout(lens, P)
  tokens = jnp.where(segments > 0, tokens, 0)
  want_cache, want_logits = sampler_lib.prefill_rows(params, tokens, positions, segments, cfg, P + N)
  got_cache, got_logits = jax.jit(sampler_lib.prefill_per_group, static_argnums=(4, 5, 6))(
      params, tokens, positions, segments, cfg, P + N, G)
  np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-5)
  for name in want_cache:
    if name in ("k", "v"):
      np.testing.assert_allclose(got_cache[name], want_cache[name], rtol=0, atol=1e-5, err_msg=name)
    else:
      np.testing.assert_array_equal(got_cache[name], want_cache[name], err_msg=name)


def check_stops_vary(out):
  """The batch has completions that stop at different steps and ones that never stop, within groups too."""
  lengths, finished = np.asarray(out["lengths_B"]), np.asarray(out["finished_B"])
  assert len(set(lengths[finished].tolist())) >= 2 and not finished.all()
  tokens = np.asarray(out["tokens_BN"]).reshape(-1, G, N)
  assert all(len({row.tobytes() for row in group}) > 1 for group in tokens)  # G different completions


@pytest.mark.parametrize("case", ["fp32", "bf16-int8-truncated", "moe"])
def test_generate_shared_equals_unshared(case):
  cfg, sc, params, atol = CFG, SC, random_params(CFG), 1e-5
  if case == "bf16-int8-truncated":  # the low-precision sampler of the loop (`sampler.dtype`, int8 weights)
    cfg, sc, params, atol = (dataclasses.replace(CFG, dtype="bfloat16"),
                             dataclasses.replace(SC, top_k=12, top_p=0.95), int8_weight_only(params), 2e-2)
  elif case == "moe":
    cfg, params = MOE, random_params(MOE)
  tokens, lens = grouped_prompts()
  want = gen(params, tokens, lens, cfg, sc)
  got = gen(params, tokens, lens, cfg, sc, group_size=G)
  assert_same_rollout(got, want, atol)
  check_stops_vary(want)
  if case == "moe":
    assert want["routes_BTLk"].shape == (len(LENS) * G, P + N, cfg.n_layers, 2)


def test_ungrouped_batch_falls_back_to_every_row():
  """A batch whose rows do not repeat per group is prefilled row by row: the result is the unshared one."""
  params = random_params(CFG)
  tokens = jax.random.randint(jax.random.key(5), (len(LENS) * G, P), 4, 32)
  lens = jnp.asarray(np.repeat(LENS, G))
  assert not bool(groups_equal(tokens, G))
  assert_same_rollout(gen(params, tokens, lens, group_size=G), gen(params, tokens, lens))


def test_one_compilation_for_new_prompt_content():
  params = random_params(CFG)
  sc = dataclasses.replace(SC, max_new_tokens=N - 1, group_size=G)  # a bucket no other test compiles
  before = generate._cache_size()
  for seed in (11, 12):
    tokens, lens = grouped_prompts(seed, lens=np.array([5, 3, 6]))
    generate(params, tokens, lens, jax.random.key(seed), CFG, sc)
  assert generate._cache_size() - before <= 1


def test_batch_must_hold_whole_groups():
  tokens, lens = grouped_prompts()
  with pytest.raises(ValueError, match="group_size=4"):
    gen(random_params(CFG), tokens, lens, group_size=4)
  with pytest.raises(ValueError, match="group_size"):
    SamplerConfig(max_new_tokens=4, group_size=0)


def test_partial_rollout_shared_equals_unshared():
  """Chunked decoding with a switch: the prefill and the AReaL re-prefill share the prompt per group."""
  old, new = random_params(CFG, 0), random_params(CFG, 1)
  tokens, lens = grouped_prompts()

  def run(group_size):
    polls = []
    poll = lambda v: (polls.append(v), (1, new) if len(polls) == 1 else None)[1]
    return partial.generate_partial(0, old, poll, tokens, lens, jax.random.key(3), CFG,
                                    dataclasses.replace(SC, group_size=group_size), chunk_steps=3, reprefill=True)

  want, got = run(1), run(G)
  assert_same_rollout(got, want)
  assert (np.asarray(want["versions_BN"]) == 1).any()  # the switch happened


def scored_batch(cfg=CFG):
  out = gen(random_params(cfg), *grouped_prompts())
  return out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], out["mask_BN"]


def test_reference_scorer_shared_equals_unshared():
  seq = scored_batch()
  ref_params = random_params(CFG, 4)
  unshared, shared = learner.make_score_fn(CFG, 0.7), learner.make_score_fn(CFG, 0.7, group_size=G)
  want = unshared(ref_params, *seq)
  np.testing.assert_allclose(shared(ref_params, *seq), want, rtol=0, atol=1e-5)
  assert np.abs(np.asarray(want)).max() > 0.5  # the scores are not trivially 0
  # Rows 2 and 3 swapped: the first two groups mix prompts, so it is scored row by row.
  swapped = tuple(jnp.asarray(np.asarray(x)[[0, 1, 3, 2, 4, 5, 6, 7, 8]]) for x in seq)
  assert not bool(groups_equal(swapped[0][:, :P], G))
  np.testing.assert_allclose(shared(ref_params, *swapped), np.asarray(want)[[0, 1, 3, 2, 4, 5, 6, 7, 8]],
                             rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", [True, False])
def test_teacher_scorer_shared_equals_unshared(head):
  seq = scored_batch()
  teacher = random_params(CFG, 5)
  want = teacher_lib.make_teacher_scorer(CFG, 1.0, 4, head=head)(teacher, *seq)
  got = teacher_lib.make_teacher_scorer(CFG, 1.0, 4, head=head, group_size=G)(teacher, *seq)
  assert set(got) == set(want)
  for name, value in want.items():
    if name == "teacher_head":  # the VocabHead: hidden states of the scored positions and the lm-head
      np.testing.assert_allclose(got[name].hidden_BND, value.hidden_BND, rtol=0, atol=1e-5)
      np.testing.assert_array_equal(got[name].w_DV, value.w_DV)
    elif name == "teacher_topk_ids_BNk":
      np.testing.assert_array_equal(got[name], value)
    else:
      np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-5, err_msg=name)


def test_shared_prefix_forward_values_and_gradients():
  """`hidden_shared_prefix` = the plain forward from the last prompt column on, and so are its
  gradients (the prompt's keys/values feed G rows: their cotangents sum)."""
  seq, pos, seg, mask = scored_batch()
  params = random_params(CFG, 6)
  w = jax.random.normal(jax.random.key(7), (seq.shape[0], N))

  def loss(params, shared):
    fn = token_logprobs_shared if shared else token_logprobs
    kw = dict(group_size=G) if shared else {}
    out = fn(params, seq[:, :-1], seq[:, 1:], CFG, positions_BT=pos[:, :-1], segment_ids_BT=seg[:, :-1],
             query_start=P - 1, with_entropy=True, **kw)
    return jnp.sum(w * mask * (out["logp_BT"] + 0.1 * out["entropy_BT"]))

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  (want_v, want_g), (got_v, got_g) = value_and_grad(params, False), value_and_grad(params, True)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got_g, want_g)
  assert float(jnp.abs(want_g["layers"]["wq"]).max()) > 0  # the prompt feeds the completion through attention


@jax.jit
def _hidden_three_ways(params, seq, pos, seg):
  kw = dict(positions_BT=pos[:, :-1], segment_ids_BT=seg[:, :-1])
  return (hidden_shared_prefix(params, seq[:, :-1], CFG, prefix_len=P, group_size=G, **kw),
          query_hidden(params, seq[:, :-1], CFG, query_start=P - 1, group_size=G, **kw),
          hidden_with_routing(params, seq[:, :-1], CFG, query_start=P - 1, **kw)[0])


def test_shared_prefix_hidden_and_fallback():
  seq, pos, seg, _ = scored_batch()
  params = random_params(CFG, 6)
  shared, checked, want = _hidden_three_ways(params, seq, pos, seg)
  np.testing.assert_allclose(shared, want, rtol=0, atol=1e-5)
  np.testing.assert_allclose(checked, want, rtol=0, atol=1e-5)
  # One prompt token of row 1 changed: its group no longer shares the prompt; `query_hidden` (checked
  # on device) computes every row, the unchecked shared forward gives row 1 its group's prompt.
  seq2 = seq.at[1, P - 2].set((seq[1, P - 2] + 1) % CFG.vocab_size)
  shared, checked, want = _hidden_three_ways(params, seq2, pos, seg)
  np.testing.assert_allclose(checked, want, rtol=0, atol=1e-5)
  assert np.abs(np.asarray(shared[1]) - np.asarray(want[1])).max() > 1e-3


def test_train_step_shared_equals_unshared():
  """The learner's own forward and backward with each prompt run once, and the reference fused into
  the step: the same update, loss, gradient norm, entropy and KL as the plain step."""
  seq, pos, seg, mask = scored_batch()
  params, ref_params = random_params(CFG, 8), random_params(CFG, 9)
  behavior = learner.make_score_fn(CFG, 1.0)(params, seq, pos, seg, mask)
  adv = jnp.array([1.0, -0.5, 2.0, 0.3, -1.0, 0.7, -2.0, 0.1, 1.5])[:, None] * mask
  batch = learner.Batch(sequence_BT=seq, positions_BT=pos, segment_ids_BT=seg, mask_BN=mask, adv_BN=adv,
                        behavior_logp_BN=behavior - 0.05 * mask, versions_BN=jnp.zeros(mask.shape, jnp.int32),
                        lag_B=jnp.zeros((mask.shape[0],), jnp.int32))
  tx = learner.make_optimizer(1e-2, grad_clip=0.0)
  outs = []
  for g in (1, G):
    step = learner.make_train_step(CFG, tx, "ppo_clip", kl_coef=0.3, group_size=g)
    step = learner.fuse_reference(step, learner.make_score_fn(CFG, 1.0, group_size=g))
    outs.append(step(learner.init_state(jax.tree.map(jnp.copy, params), tx), batch, jax.random.key(0), ref_params))
  (want, want_m), (got, got_m) = outs
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got.params, want.params)
  for k in ("loss", "grad_norm", "kl_ref", "entropy"):
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, err_msg=k)
  assert float(want_m["grad_norm"]) > 1e-3 and float(want_m["kl_ref"]) > 1e-3
