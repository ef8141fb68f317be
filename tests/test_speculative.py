"""Speculative decoding: the emitted tokens follow the policy's sampling distribution (exact counts vs the policy's
probabilities, with deliberately bad drafters), μ equals the learner's scoring, greedy equals `generate`, stop ids,
lengths and the acceptance metrics."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.learner import completion_logprobs
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.models.transformer import forward
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.sampling import head_drafter
from jaxrl_llm.sampling import speculative as spec
from jaxrl_llm.sampling.config import SPEC_LAYOUTS

CFG = ModelConfig(vocab_size=12, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, qk_norm=True)
P = 4


@functools.partial(jax.jit, static_argnums=(0, 2))
def scaled_params(cfg, seed, scale):
  """Init weights scaled up (norms kept) so next-token distributions are far from uniform."""
  f = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else scale * x
  return jax.tree_util.tree_map_with_path(f, init_params(cfg, jax.random.key(seed)))


PARAMS = scaled_params(CFG, 0, 8.0)
BAD_PARAMS = scaled_params(dataclasses.replace(CFG, n_layers=1), 7, 8.0)  # a random drafter, unrelated weights
PROMPT_P = jnp.array([5, 9, 2, 7], jnp.int32)
HEAD = head_drafter.init_head(CFG, jax.random.key(5))  # an untrained EAGLE-style head (`sampling.head_drafter`)


def ref_probs(logits_V: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
  """The sampling distribution, written independently of `sampling`: tempered softmax on the top_k logits."""
  z = np.asarray(logits_V, np.float64) / temperature
  if top_k:
    z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
  e = np.exp(z - z.max())
  return e / e.sum()


def exact_marginals(params, cfg, temperature, top_k):
  """Marginal distributions of completion columns 0, 1, 2 after PROMPT_P, by enumerating every (t0, t1)."""
  V = cfg.vocab_size
  pairs = np.array(list(itertools.product(range(V), range(V))), np.int32)
  seq = np.concatenate([np.tile(np.asarray(PROMPT_P), (len(pairs), 1)), pairs], axis=1)
  logits = np.asarray(jax.jit(forward, static_argnums=2)(params, jnp.asarray(seq), cfg))
  pr = lambda x: ref_probs(x, temperature, top_k)
  p0 = pr(logits[0, P - 1])
  p1_given = np.stack([pr(logits[t0 * V, P]) for t0 in range(V)])  # [t0, t1]
  p2_given = np.stack([pr(logits[i, P + 1]) for i in range(len(pairs))]).reshape(V, V, V)  # [t0, t1, t2]
  joint01 = p0[:, None] * p1_given
  return p0, joint01.sum(0), np.einsum("ab,abc->c", joint01, p2_given)


@functools.partial(jax.jit, static_argnames=("draft_cfg", "sampler_cfg", "gamma", "n_keys", "rows", "layout"))
def sample_many(params, draft_params, draft_cfg, sampler_cfg, gamma, n_keys, rows, layout):
  """Columns 0..2 of n_keys × rows speculative samples of PROMPT_P (rows of one batch share a call, so the
  common-minimum path runs), and the mean acceptance rate."""
  prompts = jnp.tile(PROMPT_P, (rows, 1))
  lens = jnp.full((rows,), P, jnp.int32)
  run = lambda k: spec.generate_speculative(params, draft_params, prompts, lens, k, CFG, draft_cfg, sampler_cfg, gamma,
                                            layout)
  out = jax.vmap(run)(jax.random.split(jax.random.key(11), n_keys))
  return out["tokens_BN"][..., :3].reshape(-1, 3), jnp.mean(out["spec_accept_rate"])


def tv(counts, probs):
  return 0.5 * np.abs(counts / counts.sum() - probs).sum()


@pytest.mark.parametrize("drafter,temperature,top_k,layout", [("random", 1.0, 0, "min"), ("layer1", 0.7, 4, "min"),
                                                              ("random", 0.7, 4, "rows"), ("layer1", 1.0, 0, "rows"),
                                                              ("head", 1.0, 0, "rows"), ("head_vocab", 0.7, 0, "min")])
def test_distribution_is_the_policys_with_a_bad_drafter(drafter, temperature, top_k, layout):
  """Counts of columns 0-2 over 2400 samples match the exact policy marginals (TV < 0.06; sampling noise here is
  ~0.03), while the drafter alone is far from them (so the check could fail; an untrained head: acceptance well
  below 1, so its drafts are often rejected)."""
  if drafter == "random":
    d_params, d_cfg = BAD_PARAMS, dataclasses.replace(CFG, n_layers=1)
  elif drafter.startswith("head"):  # head_vocab: drafting over 5 of the 12 tokens (q = 0 on the others)
    d_params, d_cfg = HEAD if drafter == "head" else head_drafter.with_vocab(HEAD, jnp.zeros(12), 5), CFG
  else:
    d_params, d_cfg = spec.draft_from_layers(PARAMS, CFG, 1)
  cfg = SamplerConfig(max_new_tokens=3, temperature=temperature, top_k=top_k)
  toks, accept = sample_many(PARAMS, d_params, d_cfg, cfg, 3, 600, 4, layout)
  toks = np.asarray(toks)
  policy = exact_marginals(PARAMS, CFG, temperature, top_k)
  for col in range(3):
    counts = np.bincount(toks[:, col], minlength=CFG.vocab_size).astype(float)
    assert tv(counts, policy[col]) < 0.06, (col, tv(counts, policy[col]))
  if not drafter.startswith("head"):
    draft = exact_marginals(d_params, d_cfg, temperature, top_k)
    for col in (1, 2):  # the drafter's own law is far off: emitting its drafts unchecked would fail the bound above
      assert 0.5 * np.abs(draft[col] - policy[col]).sum() > 0.2
  assert 0.0 < float(accept) < (0.7 if drafter.startswith("head") else 0.9)


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_mu_equals_the_learners_scoring(layout):
  """behavior_logp_BN = `learner.completion_logprobs` on the returned sequence (temperature 0.8), rows of different
  prompt lengths and stops; under top-k, μ is the renormalised truncated log-prob of the learner's logits."""
  prompts = jnp.array([[5, 9, 2, 7], [0, 0, 3, 8], [0, 4, 4, 1]], jnp.int32)
  lens = jnp.array([4, 2, 3], jnp.int32)
  d_params, d_cfg = spec.draft_from_layers(PARAMS, CFG, 1)
  for top_k in (0, 5):
    cfg = SamplerConfig(max_new_tokens=8, temperature=0.8, top_k=top_k, stop_ids=(3,))
    out = spec.generate_speculative(PARAMS, d_params, prompts, lens, jax.random.key(4), CFG, d_cfg, cfg, 3, layout)
    mask = np.asarray(out["mask_BN"])
    if top_k == 0:
      score = jax.jit(completion_logprobs, static_argnums=(4, 5, 6))
      ref = score(PARAMS, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], 8, CFG, 0.8)["logp_BT"]
    else:
      seq = out["sequence_BT"]
      logits = jax.jit(forward, static_argnums=2)(PARAMS, seq[:, :-1], CFG, positions_BT=out["positions_BT"][:, :-1],
                                                  segment_ids_BT=out["segment_ids_BT"][:, :-1])
      logits = np.asarray(logits)[:, P - 1:]
      toks = np.asarray(out["tokens_BN"])
      ref = np.array([[np.log(ref_probs(logits[b, n], 0.8, top_k)[toks[b, n]]) if mask[b, n] else 0.0
                       for n in range(8)] for b in range(3)])
    np.testing.assert_allclose(np.asarray(out["behavior_logp_BN"]), np.asarray(ref) * mask, atol=2e-5)
    assert np.all(np.asarray(out["behavior_logp_BN"])[mask == 0] == 0)


@pytest.mark.parametrize("gamma,draft_layers,layout", [(1, 1, "min"), (3, 2, "min"), (4, 3, "min"), (3, 1, "rows"),
                                                       (3, "head", "min"), (2, "head", "rows"),
                                                       (2, "head_vocab", "min")])
def test_greedy_equals_plain_generate(gamma, draft_layers, layout):
  prompts = jnp.array([[5, 9, 2, 7], [0, 0, 3, 8]], jnp.int32)
  lens = jnp.array([4, 2], jnp.int32)
  cfg = SamplerConfig(max_new_tokens=10, temperature=0.0)
  drafter = {"head": HEAD, "head_vocab": head_drafter.with_vocab(HEAD, jnp.arange(12.0), 4)}.get(draft_layers) or \
      spec.layers_drafter(PARAMS, CFG, draft_layers)
  out = spec.generate(PARAMS, drafter, prompts, lens, jax.random.key(0), CFG, cfg, gamma, layout)
  ref = generate(PARAMS, prompts, lens, jax.random.key(1), CFG, cfg)
  np.testing.assert_array_equal(np.asarray(out["tokens_BN"]), np.asarray(ref["tokens_BN"]))
  np.testing.assert_allclose(np.asarray(out["behavior_logp_BN"]), np.asarray(ref["behavior_logp_BN"]), atol=2e-5)
  for name in ("sequence_BT", "positions_BT", "segment_ids_BT", "lengths_B", "mask_BN"):
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(ref[name]), err_msg=name)


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_stop_ids_end_rows_and_lengths_count_them(layout):
  """A row ends at its first stop id (included in the mask, pads after); lengths and finished_B follow; the
  caller-visible layout is `generate`'s."""
  prompts = jnp.tile(PROMPT_P, (6, 1))
  lens = jnp.full((6,), P, jnp.int32)
  p0 = exact_marginals(PARAMS, CFG, 1.0, 0)[1]
  stops = tuple(int(i) for i in np.argsort(p0)[-2:])  # likely tokens, so most rows stop early
  cfg = SamplerConfig(max_new_tokens=12, stop_ids=stops, pad_id=11)
  drafter = spec.layers_drafter(PARAMS, CFG, 1)
  out = spec.generate(PARAMS, drafter, prompts, lens, jax.random.key(5), CFG, cfg, 3, layout)
  toks, mask = np.asarray(out["tokens_BN"]), np.asarray(out["mask_BN"])
  ended = 0
  for b in range(6):
    hits = np.flatnonzero(np.isin(toks[b], stops))
    length = hits[0] + 1 if hits.size else 12
    ended += bool(hits.size)
    np.testing.assert_array_equal(mask[b], np.arange(12) < length)
    assert np.all(toks[b, length:] == 11) and int(out["lengths_B"][b]) == length
    assert bool(out["finished_B"][b]) == bool(hits.size)
  assert ended >= 3
  np.testing.assert_array_equal(np.asarray(out["segment_ids_BT"])[:, P:], mask.astype(np.int32))


def test_acceptance_metrics():
  """The acceptance rate is in [0, 1]; it is 1 (up to T=1 vs T=γ+1 rounding) and every call emits γ + 1 tokens when
  the drafter is the policy itself; a random drafter accepts less and emits fewer per call."""
  prompts = jnp.tile(PROMPT_P, (2, 1))
  lens = jnp.full((2,), P, jnp.int32)
  cfg = SamplerConfig(max_new_tokens=13)
  same = spec.generate(PARAMS, spec.layers_drafter(PARAMS, CFG, CFG.n_layers), prompts, lens, jax.random.key(6), CFG,
                       cfg, 3)
  assert float(same["spec_accept_rate"]) >= 0.99
  assert float(same["spec_tokens_per_call"]) == pytest.approx(4.0, abs=0.35)
  assert int(same["spec_calls"]) <= 4
  bad = spec.generate_speculative(PARAMS, BAD_PARAMS, prompts, lens, jax.random.key(6), CFG,
                                  dataclasses.replace(CFG, n_layers=1), cfg, 3)
  assert 0.0 <= float(bad["spec_accept_rate"]) < float(same["spec_accept_rate"])
  assert 1.0 <= float(bad["spec_tokens_per_call"]) < 4.0
  assert int(bad["spec_calls"]) * float(bad["spec_tokens_per_call"]) == pytest.approx(12.0)  # common minimum
  rows = spec.generate_speculative(PARAMS, BAD_PARAMS, prompts, lens, jax.random.key(6), CFG,
                                   dataclasses.replace(CFG, n_layers=1), cfg, 3, "rows")
  assert 1.0 <= float(rows["spec_tokens_per_call"]) < 4.0  # per row: each keeps what it accepted
  assert int(rows["spec_calls"]) <= 12


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_mu_records_are_the_policys_at_every_emitted_column(layout):
  """With behavior_topk / mc_samples, each live column's records are μ's, computed here from the learner's logits on
  the returned sequence (temperature 0.8, top-5): the top-3 ids by logit with log μ, and 3 Monte-Carlo candidates
  (the sampled token first, all in μ's support, log μ at each); finished columns hold pad / 0."""
  prompts = jnp.array([[5, 9, 2, 7], [0, 0, 3, 8], [0, 4, 4, 1]], jnp.int32)
  lens = jnp.array([4, 2, 3], jnp.int32)
  d_params, d_cfg = spec.draft_from_layers(PARAMS, CFG, 1)
  cfg = SamplerConfig(max_new_tokens=8, temperature=0.8, top_k=5, stop_ids=(3,), pad_id=11, behavior_topk=3,
                      mc_samples=3)
  out = jax.device_get(spec.generate_speculative(PARAMS, d_params, prompts, lens, jax.random.key(4), CFG, d_cfg, cfg,
                                                 3, layout))
  seq = out["sequence_BT"]
  logits = np.asarray(jax.jit(forward, static_argnums=2)(PARAMS, seq[:, :-1], CFG, positions_BT=out["positions_BT"][:, :-1],
                                                         segment_ids_BT=out["segment_ids_BT"][:, :-1]))[:, P - 1:]
  mask, toks = out["mask_BN"], out["tokens_BN"]
  assert mask.sum() >= 8
  differ = 0
  for b, n in itertools.product(range(3), range(8)):
    ids_k, lp_k = out["behavior_topk_ids_BNk"][b, n], out["behavior_topk_logp_BNk"][b, n]
    ids_j, lp_j = out["mc_ids_BNJ"][b, n], out["mc_behavior_logp_BNJ"][b, n]
    if not mask[b, n]:
      assert np.all(ids_k == 11) and np.all(lp_k == 0) and np.all(ids_j == 11) and np.all(lp_j == 0)
      continue
    mu = ref_probs(logits[b, n], 0.8, 5)
    np.testing.assert_array_equal(ids_k, np.argsort(-logits[b, n], kind="stable")[:3])
    np.testing.assert_allclose(lp_k, np.log(mu[ids_k]), atol=2e-5)
    assert ids_j[0] == toks[b, n] and lp_j[0] == pytest.approx(out["behavior_logp_BN"][b, n], abs=1e-6)
    assert np.all(mu[ids_j] > 0)
    np.testing.assert_allclose(lp_j, np.log(mu[ids_j]), atol=2e-5)
    differ += int(np.any(ids_j[1:] != ids_j[0]))
  assert differ > 0  # the candidates are draws of their own, not copies of the token


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_compressed_kv_caches_are_the_policys_cache(layout):
  """"window": μ equals the learner's shadow scoring (the window mask from kv_window_B2) and not its dense one;
  "int8": greedy speculative decoding emits plain `generate`'s tokens and μ with the same int8 cache."""
  prompts = jnp.array([[5, 9, 2, 7], [0, 0, 3, 8]], jnp.int32)
  lens = jnp.array([4, 2], jnp.int32)
  drafter = spec.layers_drafter(PARAMS, CFG, 1)
  cfg = SamplerConfig(max_new_tokens=8, temperature=0.8, kv_cache="window", kv_sinks=1, kv_window=3)
  out = spec.generate(PARAMS, drafter, prompts, lens, jax.random.key(2), CFG, cfg, 3, layout)
  np.testing.assert_array_equal(np.asarray(out["kv_window_B2"]), [[1, 3], [1, 3]])
  score = jax.jit(completion_logprobs, static_argnums=(4, 5, 6))
  args = (PARAMS, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], 8, CFG, 0.8)
  mask = np.asarray(out["mask_BN"])
  shadow = np.asarray(score(*args, kv_window_B2=out["kv_window_B2"])["logp_BT"]) * mask
  dense = np.asarray(score(*args)["logp_BT"]) * mask
  np.testing.assert_allclose(np.asarray(out["behavior_logp_BN"]), shadow, atol=2e-5)
  assert np.max(np.abs(dense - shadow)) > 1e-3  # the window was in force
  greedy = SamplerConfig(max_new_tokens=8, temperature=0.0, kv_cache="int8")
  out = spec.generate(PARAMS, drafter, prompts, lens, jax.random.key(0), CFG, greedy, 3, layout)
  ref = generate(PARAMS, prompts, lens, jax.random.key(1), CFG, greedy)
  full = generate(PARAMS, prompts, lens, jax.random.key(1), CFG, dataclasses.replace(greedy, kv_cache="full"))
  np.testing.assert_array_equal(np.asarray(out["tokens_BN"]), np.asarray(ref["tokens_BN"]))
  np.testing.assert_allclose(np.asarray(out["behavior_logp_BN"]), np.asarray(ref["behavior_logp_BN"]), atol=2e-5)
  assert np.max(np.abs(np.asarray(full["behavior_logp_BN"]) - np.asarray(ref["behavior_logp_BN"]))) > 1e-5


MOE = dataclasses.replace(CFG, num_experts=4, experts_per_token=2)
MOE_PARAMS = scaled_params(MOE, 3, 4.0)


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_moe_routes_are_where_each_token_was_fed(layout):
  """MoE: routes_BTLk has `generate`'s layout and holds, at every real input token, the experts the policy routes
  it to natively (the learner's own routing, sorted per token), and the learner replaying them scores μ."""
  prompts = jnp.array([[5, 9, 2, 7], [0, 0, 3, 8]], jnp.int32)
  lens = jnp.array([4, 2], jnp.int32)
  cfg = SamplerConfig(max_new_tokens=8, temperature=1.0)
  d_cfg = dataclasses.replace(MOE, n_layers=1)  # a random drafter: rows accept different numbers of drafts
  out = spec.generate_speculative(MOE_PARAMS, scaled_params(d_cfg, 7, 8.0), prompts, lens, jax.random.key(3), MOE,
                                  d_cfg, cfg, 3, layout)
  assert out["routes_BTLk"].shape == (2, P + 8, MOE.n_layers, 2)
  assert 1.0 < float(out["spec_tokens_per_call"]) < 3.0  # under "rows": holes, so a column's slot is not P + column
  from jaxrl_llm.models.transformer import hidden_with_routing
  seq, pos, seg = out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"]
  _, routing = jax.jit(hidden_with_routing, static_argnums=2)(MOE_PARAMS, seq[:, :-1], MOE, positions_BT=pos[:, :-1],
                                                              segment_ids_BT=seg[:, :-1])
  real = np.asarray(seg[:, :-1]) > 0
  got = np.sort(np.asarray(out["routes_BTLk"])[:, :-1], axis=-1)[real]
  np.testing.assert_array_equal(got, np.sort(np.asarray(routing["routes_BTLk"]), axis=-1)[real])
  score = jax.jit(completion_logprobs, static_argnums=(4, 5, 6))
  lp = score(MOE_PARAMS, seq, pos, seg, 8, MOE, 1.0, routes_BTLk=out["routes_BTLk"])["logp_BT"]
  np.testing.assert_allclose(np.asarray(out["behavior_logp_BN"]), np.asarray(lp) * np.asarray(out["mask_BN"]),
                             atol=2e-5)


def test_rejections():
  prompts, lens = PROMPT_P[None], jnp.array([P], jnp.int32)
  with pytest.raises(ValueError, match="spec_draft_layers"):
    spec.draft_from_layers(PARAMS, CFG, 4)
  other = dataclasses.replace(CFG, vocab_size=16, n_layers=1)
  with pytest.raises(ValueError, match="vocabulary"):
    spec.generate_speculative(PARAMS, init_params(other, jax.random.key(0)), prompts, lens, jax.random.key(0), CFG,
                              other, SamplerConfig(max_new_tokens=2), 2)


def test_auto_gamma_shrinks_with_the_batch():
  gammas = [spec.auto_gamma(b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
  assert gammas == sorted(gammas, reverse=True) and gammas[0] >= 2 and gammas[-1] == 0


def test_sampler_config_fields_and_generate_dispatch():
  """`SamplerConfig.spec_gamma` routes `sampling.generate` through speculative decoding ("auto": γ by batch size),
  with the same greedy tokens and the spec_* metrics; bad values name the field."""
  prompts = jnp.array([[5, 9, 2, 7], [0, 0, 3, 8]], jnp.int32)
  lens = jnp.array([4, 2], jnp.int32)
  plain = generate(PARAMS, prompts, lens, jax.random.key(0), CFG, SamplerConfig(max_new_tokens=7, temperature=0.0))
  for gamma, layout in ((2, "min"), ("auto", "rows")):
    cfg = SamplerConfig(max_new_tokens=7, temperature=0.0, spec_gamma=gamma, spec_draft_layers=1, spec_layout=layout)
    out = generate(PARAMS, prompts, lens, jax.random.key(0), CFG, cfg)
    np.testing.assert_array_equal(np.asarray(out["tokens_BN"]), np.asarray(plain["tokens_BN"]))
    assert 0.0 <= float(out["spec_accept_rate"]) <= 1.0 and float(out["spec_tokens_per_call"]) >= 1.0
  assert "spec_calls" not in plain
  assert SPEC_LAYOUTS == spec.LAYOUTS
  for bad, needle in [(dict(spec_gamma=-1), "spec_gamma"), (dict(spec_gamma="big"), "spec_gamma"),
                      (dict(spec_gamma=2), "spec_draft_layers"), (dict(spec_layout="holes"), "spec_layout")]:
    with pytest.raises(ValueError, match=needle):
      SamplerConfig(max_new_tokens=4, **bad)


def test_run_config_validation_names_the_field():
  import os
  from jaxrl_llm import config as config_lib, wiring
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for over, needle in [({"spec_gamma": 2}, "config.sampler.spec_draft_layers=0"),
                       ({"spec_gamma": -2, "spec_draft_layers": 1}, "config.sampler.spec_gamma=-2"),
                       ({"spec_layout": "holes"}, "config.sampler.spec_layout='holes'")]:
    c = config_lib.load_file(os.path.join(root, "configs", "tiny.py"))
    c.sampler.update(over)
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.validate(c)
    assert needle in str(e.value)
  # the slot engine speculates in the "min" layout only (its slots share one write index); MoE, μ records and
  # compressed caches all run
  c = config_lib.load_file(os.path.join(root, "configs", "tiny.py"))
  c.sampler.update({"spec_gamma": 2, "spec_draft_layers": 1, "spec_layout": "rows"})
  c.rollout.slots = 4
  with pytest.raises(config_lib.ConfigError, match="config.sampler.spec_layout='rows': continuous batching"):
    config_lib.validate(c)
  c.sampler.spec_layout = "min"
  config_lib.validate(c)
  c = config_lib.load_file(os.path.join(root, "configs", "moe_tiny.py"))
  c.sampler.update({"spec_gamma": 2, "spec_draft_layers": 1, "kv_cache": "int8", "behavior_topk": 2, "mc_samples": 2})
  config_lib.validate(c)
  c = config_lib.load_file(os.path.join(root, "configs", "tiny.py"))
  c.sampler.update({"spec_gamma": -1, "spec_draft_layers": 1})  # -1: "auto"
  config_lib.validate(c)
  assert wiring.sampler_config(c).spec_gamma == "auto" and wiring.sampler_config(c, greedy=True).spec_gamma == 0


def test_gamma_tuner_explores_from_the_prior_skips_compiles_and_keeps_the_cheapest():
  """ReSpec's adaptive γ (`GammaTuner`), with measured costs injected: the table's γ first, then every candidate by
  distance from it, each call's first (compiling) measure ignored; then the cheapest, with one re-measure of the
  least recently measured other candidate every `retry_every` calls; batch sizes are tuned apart."""
  from jaxrl_llm.sampling.speculative import GammaTuner, auto_gamma
  cost = {0: 1.0, 1: 0.8, 2: 0.9, 4: 0.5}
  t = GammaTuner(retry_every=6)
  picks = []
  for _ in range(14):
    g = t.choose(8)
    picks.append(g)
    t.observe(8, g, seconds=cost[g] * 10 + (100.0 if picks.count(g) == 1 else 0.0), tokens=10)  # compiles: slow
  assert auto_gamma(8) == 2
  assert picks[:8] == [2, 2, 1, 1, 0, 0, 4, 4]  # explore: each twice (the first is the compile)
  assert picks[8:] == [4, 4, 4, 2, 4, 4]  # the cheapest; call 12 (n % 6 == 5) re-measures γ = 2, the stalest
  assert t.state() == {"8x0": 1.0, "8x1": 0.8, "8x2": 0.9, "8x4": 0.5}
  assert t.choose(64) == auto_gamma(64) == 1  # another batch size starts from its own prior
  t.observe(4, 2, seconds=1.0, tokens=0)  # nothing emitted: no measure
  assert "4x2" not in t.state()


def test_auto_gamma_in_a_run_follows_the_tuner(tmp_path):
  """`sampler.spec_gamma=-1` in one process: each sampler call's γ is the tuner's (rows report `spec_gamma`); its
  exploration order does not depend on timings, so the first steps' γ are known."""
  import os
  from jaxrl_llm import config as config_lib, loop
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = config_lib.load_file(os.path.join(root, "configs", "tiny.py"))
  c.sampler.update({"spec_gamma": -1, "spec_draft_layers": 1})
  c.model.n_layers, c.num_steps, c.eval.every, c.checkpoint.every = 2, 3, 0, 0
  c.log.tensorboard = c.log.progress = False
  from jaxrl_llm.sampling.speculative import auto_gamma
  B = c.rollout.prompts_per_step * c.rollout.group_size
  rows = loop.run(c, str(tmp_path / "run"))
  prior = auto_gamma(B)
  second = sorted((g for g in (0, 1, 2, 4) if g != prior), key=lambda g: (abs(g - prior), g))[0]
  assert [r["spec_gamma"] for r in rows] == [prior, prior, second]


# The slot engine's draft-and-verify step (`continuous.speculate_chunk`): continuous batching speculates.
SLOT_PROMPTS = jnp.array([[5, 9, 2, 7], [0, 0, 3, 8], [0, 4, 4, 1]] * 3, jnp.int32)
SLOT_LENS = jnp.array([4, 2, 3] * 3, jnp.int32)


@pytest.mark.parametrize("drafter", ["layers", "head"])
def test_slot_engine_speculates_greedy_as_generate_and_mu_is_the_learners(drafter):
  """9 requests through 4 slots: greedy speculation emits `generate`'s tokens; sampled (a random drafter, stop ids)
  μ equals the learner's scoring; the spec_* metrics and slot counters come out together. "head": an untrained
  head drafts both (one feature per slot, zeroed at admission)."""
  from jaxrl_llm.sampling import continuous
  from jaxrl_llm.sampling.sampler import generate as plain
  keys = jax.random.split(jax.random.key(0), 9)
  greedy = SamplerConfig(max_new_tokens=10, temperature=0.0, spec_gamma=3, spec_draft_layers=1)
  out = continuous.generate_slots(PARAMS, SLOT_PROMPTS, SLOT_LENS, keys, CFG, greedy, slots=4, chunk=3,
                                  draft_params=HEAD if drafter == "head" else None)
  ref = plain(PARAMS, SLOT_PROMPTS, SLOT_LENS, jax.random.key(1), CFG, dataclasses.replace(greedy, spec_gamma=0))
  np.testing.assert_array_equal(out["tokens_BN"], np.asarray(ref["tokens_BN"]))
  np.testing.assert_allclose(out["behavior_logp_BN"], np.asarray(ref["behavior_logp_BN"]), atol=2e-5)
  cfg = SamplerConfig(max_new_tokens=8, temperature=0.8, stop_ids=(3,), spec_gamma=3, spec_draft_layers=1)
  out = continuous.generate_slots(PARAMS, SLOT_PROMPTS, SLOT_LENS, keys, CFG, cfg, slots=4, chunk=3,
                                  draft_params=HEAD if drafter == "head" else BAD_PARAMS)
  score = jax.jit(completion_logprobs, static_argnums=(4, 5, 6))
  ref = score(PARAMS, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], 8, CFG, 0.8)["logp_BT"]
  np.testing.assert_allclose(out["behavior_logp_BN"], np.asarray(ref) * out["mask_BN"], atol=2e-5)
  assert 0.0 < out["spec_accept_rate"] < 0.9 and 1.0 <= out["spec_tokens_per_call"] < 4.0
  assert 0 < out["live_steps"] <= out["slot_steps"] == 4 * out["spec_calls"]
  for b in range(9):  # a row ends at its first stop id or after N columns
    hits = np.flatnonzero(out["tokens_BN"][b] == 3)
    assert out["lengths_B"][b] == (hits[0] + 1 if hits.size else 8)


def test_slot_engine_speculation_keeps_the_policys_distribution():
  """1200 requests of one prompt through 32 slots with a random drafter: columns 0-2 match the exact policy
  marginals (TV < 0.08; sampling noise ~0.04 here) though the drafter's own law is > 0.2 away."""
  from jaxrl_llm.sampling import continuous
  R = 1200
  cfg = SamplerConfig(max_new_tokens=3, temperature=1.0, spec_gamma=3, spec_draft_layers=1)
  out = continuous.generate_slots(PARAMS, jnp.tile(PROMPT_P, (R, 1)), jnp.full((R,), P, jnp.int32),
                                  jax.random.split(jax.random.key(5), R), CFG, cfg, slots=32, chunk=4,
                                  draft_params=BAD_PARAMS)
  policy = exact_marginals(PARAMS, CFG, 1.0, 0)
  for col in range(3):
    counts = np.bincount(out["tokens_BN"][:, col], minlength=CFG.vocab_size).astype(float)
    assert tv(counts, policy[col]) < 0.08, (col, tv(counts, policy[col]))
  assert 0.0 < out["spec_accept_rate"] < 0.9


def test_slot_engine_speculation_with_moe_routes_records_and_a_window_cache():
  """MoE + μ records + a sinks/window cache in the slot engine's speculation: the routes are where each token was
  fed (the learner's own routing under the window mask), the learner replaying them under the shadow mask scores
  μ, and the top-k records are its top logits."""
  from jaxrl_llm.models.cache import window_attention_mask
  from jaxrl_llm.models.transformer import hidden_with_routing
  from jaxrl_llm.sampling import continuous
  d_cfg = dataclasses.replace(MOE, n_layers=1)
  cfg = SamplerConfig(max_new_tokens=8, temperature=1.0, stop_ids=(3,), spec_gamma=3, spec_draft_layers=1,
                      behavior_topk=3, mc_samples=2, kv_cache="window", kv_sinks=1, kv_window=4)
  out = continuous.generate_slots(MOE_PARAMS, SLOT_PROMPTS[:6], SLOT_LENS[:6], jax.random.split(jax.random.key(2), 6),
                                  MOE, cfg, slots=4, chunk=2, draft_params=scaled_params(d_cfg, 7, 8.0))
  assert 1.0 < out["spec_tokens_per_call"] < 3.0
  seq, pos, seg, mask = out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], out["mask_BN"]
  win = out["kv_window_B2"]
  attn = window_attention_mask(jnp.asarray(pos[:, :-1]), jnp.asarray(seg[:, :-1]), jnp.asarray(win[:, 0]),
                               jnp.asarray(win[:, 1]))
  _, routing = jax.jit(hidden_with_routing, static_argnums=2)(MOE_PARAMS, seq[:, :-1], MOE, positions_BT=pos[:, :-1],
                                                              segment_ids_BT=seg[:, :-1], mask_BTT=attn)
  real = seg[:, :-1] > 0
  np.testing.assert_array_equal(np.sort(out["routes_BTLk"][:, :-1], axis=-1)[real],
                                np.sort(np.asarray(routing["routes_BTLk"]), axis=-1)[real])
  score = jax.jit(completion_logprobs, static_argnums=(4, 5, 6))
  lp = score(MOE_PARAMS, seq, pos, seg, 8, MOE, 1.0, routes_BTLk=out["routes_BTLk"], kv_window_B2=win)["logp_BT"]
  np.testing.assert_allclose(out["behavior_logp_BN"], np.asarray(lp) * mask, atol=2e-5)
  every = jnp.broadcast_to(jnp.arange(MOE.vocab_size), mask.shape + (MOE.vocab_size,))
  all_V = np.asarray(score(MOE_PARAMS, seq, pos, seg, 8, MOE, 1.0, routes_BTLk=out["routes_BTLk"], kv_window_B2=win,
                           gather_ids_BNk=every)["gathered_logp_BTk"])
  live = mask > 0
  np.testing.assert_array_equal(out["behavior_topk_ids_BNk"][live], np.argsort(-all_V, axis=-1, kind="stable")[live][:, :3])
  np.testing.assert_allclose(out["behavior_topk_logp_BNk"][live], np.sort(all_V, axis=-1)[live][:, ::-1][:, :3],
                             atol=2e-5)
  assert np.all(out["mc_ids_BNJ"][..., 0][live] == out["tokens_BN"][live])
