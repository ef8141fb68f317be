"""The sampler's records of μ (`sampling.behavior`): its top-k and Monte-Carlo candidates, checked against an
independent computation from the model's full logits at the same positions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, forward, init_params
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.sampling import behavior
from jaxrl_llm.sampling.partial import generate_partial

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, qk_norm=True)
B, P, N, V = 4, 5, 6, 32
EOS = 3
RECORDS = behavior.TOPK_FIELDS + behavior.MC_FIELDS


@jax.jit
def _params():
  """Weights scaled up from init so the next-token distributions are far from uniform (as tests/test_sampler.py)."""
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 3.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(CFG, jax.random.key(0)))


PARAMS = _params()
PROMPTS = jax.random.randint(jax.random.key(1), (B, P), 4, 32)
PROMPT_LEN = jnp.array([5, 2, 3, 4])


def run(sc, key=jax.random.key(2)):
  return jax.tree.map(np.asarray, generate(PARAMS, PROMPTS, PROMPT_LEN, key, CFG, sc))


def full_logits(out):
  """[B, N, V] float64 logits predicting each completion column, from one full forward over the sequence."""
  seq = out["sequence_BT"]
  logits = forward(PARAMS, jnp.asarray(seq[:, :-1]), CFG, positions_BT=jnp.asarray(out["positions_BT"][:, :-1]),
                   segment_ids_BT=jnp.asarray(out["segment_ids_BT"][:, :-1]))
  return np.asarray(logits[:, P - 1:], np.float64)


def log_mu(logits_V, sc):
  """Independent log μ of one position (numpy): tempered softmax, top-k then top-p renormalised; greedy: T = 1."""
  if sc.temperature == 0:
    z = logits_V
  else:
    z = logits_V / sc.temperature
  keep = np.ones(V, bool)
  order = np.argsort(-z, kind="stable")
  if sc.top_k:
    keep[order[sc.top_k:]] = False
  if sc.top_p < 1:
    p = np.exp(z[order] - z.max()) * keep[order]
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[order[before >= sc.top_p]] = False
  zz = np.where(keep, z, -np.inf)
  return zz - (np.log(np.exp(zz - zz.max()).sum()) + zz.max())


CONFIGS = {
    "plain": SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.7, behavior_topk=6, mc_samples=5),
    "top_k": SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=1.0, top_k=4, behavior_topk=7, mc_samples=5),
    "top_p": SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.9, top_p=0.25, behavior_topk=6,
                           mc_samples=4),
    "greedy": SamplerConfig(max_new_tokens=N, stop_ids=(EOS,), temperature=0.0, behavior_topk=5),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_records_leave_the_samples_unchanged_and_are_off_by_default(name):
  sc = CONFIGS[name]
  off = run(dataclasses.replace(sc, behavior_topk=0, mc_samples=0))
  on = run(sc)
  assert not set(off) & set(RECORDS)
  # Same key: the same tokens; the same log-probs up to rounding (the program with the records is another
  # computation, whose fusions XLA may round differently: 1 float32 ulp seen at --xla_cpu_use_fusion_emitters=false).
  for k, v in off.items():
    if np.issubdtype(np.asarray(v).dtype, np.floating):
      np.testing.assert_allclose(on[k], v, rtol=1e-6, atol=1e-6, err_msg=k)
    else:
      np.testing.assert_array_equal(on[k], v, err_msg=k)
  assert on["behavior_topk_ids_BNk"].shape == (B, N, sc.behavior_topk)
  if sc.mc_samples:
    assert on["mc_ids_BNJ"].shape == on["mc_behavior_logp_BNJ"].shape == (B, N, sc.mc_samples)
  else:
    assert "mc_ids_BNJ" not in on


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_topk_record_is_mu_from_the_full_logits(name):
  sc = CONFIGS[name]
  out = run(sc)
  mask = out["mask_BN"] > 0
  assert mask.sum() > B  # several columns per row to check
  logits = full_logits(out)
  ids, lp = out["behavior_topk_ids_BNk"], out["behavior_topk_logp_BNk"]
  in_topk = 0
  for b, n in zip(*np.nonzero(mask)):
    want = log_mu(logits[b, n], sc)
    np.testing.assert_allclose(lp[b, n], want[ids[b, n]], atol=2e-5, rtol=0)
    # Sorted by probability, descending; the k ids are the k most likely (logit order beyond μ's support).
    z = logits[b, n]
    assert np.all(np.diff(z[ids[b, n]]) <= 1e-5)
    assert len(set(ids[b, n])) == sc.behavior_topk
    assert z[ids[b, n]].min() >= np.sort(z)[-sc.behavior_topk] - 1e-5
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(lp[b, n]), finite[ids[b, n]])
    # The sampled token's behaviour log-prob is its entry (two computations of one value: `sample_token`'s and
    # the full log-softmax's, so up to float rounding, not bitwise).
    tok = out["tokens_BN"][b, n]
    hit = np.flatnonzero(ids[b, n] == tok)
    if hit.size:
      in_topk += 1
      np.testing.assert_allclose(lp[b, n, hit[0]], out["behavior_logp_BN"][b, n], rtol=0, atol=1e-6)
  assert in_topk > 0
  if sc.top_k:  # beyond μ's support: -inf
    assert np.all(np.isneginf(lp[mask][:, sc.top_k:]))
  if sc.truncated:  # the recorded k reach past μ's support somewhere: those entries are log 0
    assert np.isneginf(lp[mask]).any() and np.isfinite(lp[mask][:, 0]).all()
  # Finished columns hold pad ids and 0.
  assert np.all(ids[~mask] == 0) and np.all(lp[~mask] == 0)


@pytest.mark.parametrize("name", ["plain", "top_k", "top_p"])
def test_mc_candidates_are_the_token_then_draws_from_mu(name):
  sc = CONFIGS[name]
  out = run(sc)
  mask = out["mask_BN"] > 0
  ids, lp = out["mc_ids_BNJ"], out["mc_behavior_logp_BNJ"]
  np.testing.assert_array_equal(ids[..., 0][mask], out["tokens_BN"][mask])
  np.testing.assert_array_equal(lp[..., 0], out["behavior_logp_BN"])  # column 0 is μ's own score, bitwise
  logits = full_logits(out)
  for b, n in zip(*np.nonzero(mask)):
    want = log_mu(logits[b, n], sc)
    np.testing.assert_allclose(lp[b, n], want[ids[b, n]], atol=2e-5, rtol=0)
  assert np.all(np.isfinite(lp[mask]))  # never a token outside μ's support
  assert np.all(ids[~mask] == 0) and np.all(lp[~mask] == 0)
  # Deterministic for a key; another key draws other candidates (the tokens too).
  np.testing.assert_array_equal(run(sc)["mc_ids_BNJ"], ids)
  assert not np.array_equal(run(sc, jax.random.key(9))["mc_ids_BNJ"][..., 1:], ids[..., 1:])
  assert len(np.unique(ids[mask][:, 1:])) > 1


def test_mc_draws_follow_mu():
  """Frequencies of many i.i.d. draws match μ (a truncated μ: the dropped tokens are never drawn)."""
  logits = jax.random.normal(jax.random.key(3), (1, 12)) * 2.0
  sc = SamplerConfig(max_new_tokens=1, temperature=0.8, top_k=6)
  logmu = behavior.behavior_logprobs(logits, sc)
  draws = np.asarray(behavior.draw_candidates(jax.random.key(4), jnp.repeat(logmu, 4000, 0), 5)).ravel()
  freq = np.bincount(draws, minlength=12) / draws.size
  p = np.exp(np.asarray(logmu[0], np.float64))
  assert np.all(freq[p == 0] == 0) and np.sum(p > 0) == 6
  se = np.sqrt(p * (1 - p) / draws.size)
  assert np.all(np.abs(freq - p) <= 5 * se + 1e-9), (freq, p)
  np.testing.assert_allclose(p.sum(), 1.0, atol=1e-6)


def test_record_options_are_validated():
  with pytest.raises(ValueError, match="sampler.behavior_topk"):
    SamplerConfig(max_new_tokens=2, behavior_topk=-1)
  with pytest.raises(ValueError, match="sampler.mc_samples"):
    SamplerConfig(max_new_tokens=2, mc_samples=1.5)
  with pytest.raises(ValueError, match="sampler.mc_samples=2 needs temperature > 0"):
    SamplerConfig(max_new_tokens=2, temperature=0.0, mc_samples=2)
  with pytest.raises(ValueError, match="sampler.behavior_topk=33"):
    run(SamplerConfig(max_new_tokens=2, behavior_topk=V + 1))
  out = generate_partial(0, PARAMS, lambda v: None, PROMPTS, PROMPT_LEN, jax.random.key(0), CFG,
                         SamplerConfig(max_new_tokens=2, mc_samples=2), chunk_steps=1)  # partial records too
  assert out["mc_ids_BNJ"].shape[-1] == 2


def test_sampler_metrics_of_a_record_golden():
  """`record.sampler_metrics`: μ's top-k mass and the Monte-Carlo hit rate over the trained tokens only, the window
  a token could see, routes replayed; nothing for a field the record does not carry."""
  from jaxrl_llm.record import Rollout, sampler_metrics
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  zeros = np.zeros((2, 3), np.float32)
  base = dict(sequence_BT=np.zeros((2, 5), np.int32), positions_BT=np.zeros((2, 5), np.int32),
              segment_ids_BT=np.ones((2, 5), np.int32), mask_BN=mask, behavior_logp_BN=zeros,
              versions_BN=np.zeros((2, 3), np.int32))
  assert sampler_metrics(Rollout(**base)) == {}
  topk = np.log(np.array([[[0.5, 0.2], [0.3, 0.3], [0.9, 0.1]], [[0.25, 0.25], [1.0, 1e-9], [1.0, 1e-9]]]))
  mc = np.array([[[7, 7, 1], [4, 2, 3], [5, 5, 5]], [[9, 9, 9], [1, 1, 1], [0, 0, 0]]], np.int32)
  got = sampler_metrics(Rollout(**base, behavior_topk_logp_BNk=topk, mc_ids_BNJ=mc,
                                kv_window_B2=np.array([[2, 3], [2, 3]], np.int32),
                                routes_BTLk=np.zeros((2, 5, 1, 1), np.int32)))
  # trained tokens: (0,0) mass 0.7, hit 1/2; (0,1) 0.6, 0; (1,0) 0.5, 1
  assert got.keys() == {"mu_topk_mass", "mu_mc_hit", "kv_window", "routes_replayed"}
  np.testing.assert_allclose(got["mu_topk_mass"], (0.7 + 0.6 + 0.5) / 3, rtol=1e-12)
  np.testing.assert_allclose(got["mu_mc_hit"], (0.5 + 0 + 1) / 3, rtol=1e-12)
  assert got["kv_window"] == 5.0 and got["routes_replayed"] == 1
