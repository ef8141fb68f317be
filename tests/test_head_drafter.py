"""The EAGLE-style head drafter (`sampling.head_drafter`, `sampler.spec_drafter="head"`): its loss against a numpy
computation from the policy's hidden states, gradients only into the head, distillation raising the acceptance rate,
the policy's distribution and greedy tokens kept whatever the head drafts (in tests/test_speculative.py), the slot
engine and kept episode turns drafting with it, and tiny runs (resume exact, partial rollouts)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import ConfigError, validate
from jaxrl_llm.distill import drafter as dr
from jaxrl_llm.losses.core import LOG_RATIO_BOUND
from jaxrl_llm.metrics import read_jsonl
from jaxrl_llm.models.transformer import hidden, lm_head_weights
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.sampling import head_drafter as hd
from jaxrl_llm.sampling import speculative as spec
from test_drafter import ACC_LENS, ACC_PROMPTS, drafter_config, rollout_batch
from test_loop import strip
from test_speculative import CFG, PARAMS


def random_head(seed: int, scale: float = 1.0) -> dict:
  """A head with every weight random (W_down too: `init_head` zeroes it), so each of its parts matters."""
  head = hd.init_head(CFG, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 8))
  return {"eagle": {k: (w if k == "norm_D" else w + scale * 0.3 * jax.random.normal(next(keys), w.shape))
                    for k, w in head["eagle"].items()}}


def np_head_loss(head, seq, pos, seg, mask, weight, temperature, reg_weight):
  """(loss, KL) written out in float64 numpy from the policy's final-normed hidden states (`transformer.hidden`):
  column j >= 1 drafted from (feature before column j - 1, or zeros for j = 1; embedding of token j - 1)."""
  N = mask.shape[1]
  f = np.asarray(jax.jit(hidden, static_argnums=2)(PARAMS, seq, CFG, positions_BT=pos, segment_ids_BT=seg),
                 np.float64)[:, -N - 1:-1]  # f[:, j]: the feature whose head gives column j
  w = {k: np.asarray(v, np.float64) for k, v in head["eagle"].items()}
  emb = np.asarray(PARAMS["embed"], np.float64)[np.asarray(seq)[:, -N:-1]]
  feat_in = np.concatenate([np.zeros_like(f[:, :1]), f[:, 1:N - 1]], axis=1)
  x = np.concatenate([feat_in, emb], -1) @ w["fc_2DD"]
  n = x / np.sqrt((x * x).mean(-1, keepdims=True) + CFG.rms_eps) * w["norm_D"]
  gate = n @ w["gate_DF"]
  pred = x + ((gate / (1 + np.exp(-gate))) * (n @ w["up_DF"])) @ w["down_FD"]
  head_DV = np.asarray(lm_head_weights(PARAMS, CFG), np.float64)
  logsm = lambda z: z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
  lq, lp = logsm(pred @ head_DV / temperature), logsm(f[:, 1:] @ head_DV / temperature)
  kl = (np.exp(lp) * np.clip(lp - lq, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)).sum(-1)  # `dense.kl_dense`'s bound
  d = np.abs(pred - f[:, 1:])
  reg = np.where(d < 1, 0.5 * d * d, d - 0.5).mean(-1)
  wm = np.asarray(weight, np.float64)[:, None] * np.asarray(mask, np.float64)[:, 1:]
  kl_m, reg_m = (wm * kl).sum() / wm.sum(), (wm * reg).sum() / wm.sum()
  return kl_m + reg_weight * reg_m, kl_m


def test_head_loss_equals_numpy_and_only_the_head_gets_gradient():
  """`head_loss` = the numpy loss and KL (temperature 0.8, a shorter row, row weights, reg_weight 2); its gradient
  w.r.t. the policy is zero, w.r.t. every part of the head finite and non-zero; a masked column's token changes
  neither the loss nor the gradient."""
  seq, pos, seg, mask = rollout_batch(PARAMS, 4, 0, N=6)
  mask = mask.at[1, 3:].set(0.0)
  head, weight = random_head(3), jnp.array([1.0, 0.5, 2.0, 0.0])
  loss = lambda h, pp, s: dr.head_loss(h, pp, s, pos, seg, mask, weight, CFG, 0.8, 2.0)
  got, got_kl = jax.jit(loss)(head, PARAMS, seq)
  want, want_kl = np_head_loss(head, seq, pos, seg, mask, weight, 0.8, 2.0)
  assert want_kl > 0.05 and want > want_kl
  assert float(got) == pytest.approx(want, rel=1e-4)
  assert float(got_kl) == pytest.approx(want_kl, rel=1e-4)
  grad = jax.jit(jax.grad(lambda h, pp, s: loss(h, pp, s)[0], argnums=(0, 1)))
  g_head, g_policy = grad(head, PARAMS, seq)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(g_policy))
  for name, g in g_head["eagle"].items():
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.sum(g * g)) > 0, name
  # row 1's column 3 (masked) feeds only masked terms: the draft of column 4 and the features of columns 4, 5
  seq2 = seq.at[1, -3].set((seq[1, -3] + 1) % CFG.vocab_size)
  assert float(loss(head, PARAMS, seq2)[0]) == pytest.approx(float(got), rel=1e-6)
  for a, b in zip(jax.tree.leaves(g_head), jax.tree.leaves(grad(head, PARAMS, seq2)[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def head_acceptance(head, N: int = 6) -> float:
  """Mean spec_accept_rate of `head` for the policy PARAMS on the fixed prompts, two fixed keys."""
  run = lambda s: spec.generate(PARAMS, head, ACC_PROMPTS, ACC_LENS, jax.random.key(900 + s), CFG,
                                SamplerConfig(max_new_tokens=N), 3)
  return float(np.mean([float(run(s)["spec_accept_rate"]) for s in range(2)]))


def test_head_distillation_raises_the_acceptance_rate():
  """A fresh head distilled on the policy's samples of a fixed prompt set (8 batches of 4 samples per prompt, 4 Adam
  steps each, `distill_step` as a run calls it) lowers the KL and raises the acceptance rate on those prompts,
  measured with keys the training never saw, by a clear margin (measured: KL 0.375 -> 0.210, acceptance
  0.50 -> 0.625)."""
  lr = 3e-3
  state = dr.init_state(PARAMS, CFG, 1, lr, "head")
  assert hd.is_head(state.params) and hd.head_size(state.params) == 2 * 32 * 32 + 3 * 32 * 64 + 32
  before, kls = head_acceptance(state.params), []
  for i in range(8):
    out = generate(PARAMS, jnp.repeat(ACC_PROMPTS, 4, 0), jnp.repeat(ACC_LENS, 4), jax.random.key(500 + i), CFG,
                   SamplerConfig(max_new_tokens=6))
    state, m = dr.distill_step(state, PARAMS, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"],
                               out["mask_BN"], jnp.zeros((64,)), model_cfg=CFG, temperature=1.0, lr=lr, steps=4)
    kls.append(float(m["spec_drafter_kl"]))
  after = head_acceptance(state.params)
  assert kls[-1] < 0.65 * kls[0], kls
  assert after > before + 0.08, (before, after)


def test_slot_engine_with_a_head_is_greedy_generate_and_mu_is_the_learners():
  """9 requests through 4 slots drafting with a head (one feature per slot, zeroed at admission): greedy speculation
  emits `generate`'s tokens; sampled, μ equals the learner's scoring; the head both hit and missed."""
  from jaxrl_llm.learner import completion_logprobs
  from jaxrl_llm.sampling import continuous
  from test_speculative import SLOT_LENS, SLOT_PROMPTS
  head, keys = random_head(4, 0.3), jax.random.split(jax.random.key(0), 9)
  greedy = SamplerConfig(max_new_tokens=10, temperature=0.0, spec_gamma=3, spec_draft_layers=1)
  out = continuous.generate_slots(PARAMS, SLOT_PROMPTS, SLOT_LENS, keys, CFG, greedy, slots=4, chunk=3,
                                  draft_params=head)
  ref = generate(PARAMS, SLOT_PROMPTS, SLOT_LENS, jax.random.key(1), CFG, SamplerConfig(max_new_tokens=10,
                                                                                      temperature=0.0))
  np.testing.assert_array_equal(out["tokens_BN"], np.asarray(ref["tokens_BN"]))
  cfg = SamplerConfig(max_new_tokens=8, temperature=0.8, stop_ids=(3,), spec_gamma=3, spec_draft_layers=1)
  out = continuous.generate_slots(PARAMS, SLOT_PROMPTS, SLOT_LENS, keys, CFG, cfg, slots=4, chunk=3,
                                  draft_params=head)
  score = jax.jit(completion_logprobs, static_argnums=(4, 5, 6))
  lp = score(PARAMS, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], 8, CFG, 0.8)["logp_BT"]
  np.testing.assert_allclose(out["behavior_logp_BN"], np.asarray(lp) * out["mask_BN"], atol=2e-5)
  assert 0.0 < out["spec_accept_rate"] < 1.0


def test_kept_turns_with_a_head_equal_reprefilled_turns():
  """Episode turns from kept caches with a head drafter draw what speculative re-prefilled turns draw (each turn's
  first call drafts from no feature either way: `extend_drafter` resets it), over 4 turns with a row leaving."""
  from jaxrl_llm.rollout.generation import DrafterSlot
  from jaxrl_llm.rollout.turn_sampler import CachedTurns, Reprefill
  from test_episodes import make_gen
  from test_turn_sampler import SPEC, W, assert_same, play

  def with_head(cls):
    gen = make_gen(0.8)
    return cls(dataclasses.replace(gen, drafter=DrafterSlot(hd.init_head(gen.model_cfg, jax.random.key(2)))), W)
  cached = with_head(CachedTurns)
  cached.slots = 4 * W
  got = play(cached, turns=4, leave_after=1, **SPEC)
  assert_same(got, play(with_head(Reprefill), turns=4, leave_after=1, **SPEC))
  assert cached.prefills == 1 and len(cached.spec) == 4
  assert 0 < np.mean([s["spec_accept_rate"] for s in cached.spec]) < 1


def head_config(n: int):
  c = drafter_config(n)
  c.sampler.update({"spec_drafter": "head", "spec_distill_lr": 3e-3, "spec_head_reg_weight": 1.0})
  return c


@pytest.mark.slow
def test_run_with_a_head_drafter_resumes_exactly(tmp_path):
  """A tiny sync run with `spec_drafter="head"` distils the head every step (the KL falls within a step's Adam steps)
  and speculates with it, and a run stopped after 2 steps and resumed writes the same metrics as an uninterrupted
  3-step one (the head's parameters and Adam state are in the checkpoint)."""
  a = loop.run(head_config(3), str(tmp_path / "a"))
  assert all(np.isfinite(r["spec_drafter_kl"]) and r["spec_drafter_kl_last"] < r["spec_drafter_kl"] for r in a)
  assert all(0 <= r["spec_accept_rate"] <= 1 and r["mismatch_abs_max"] < 1e-4 for r in a)
  loop.run(head_config(2), str(tmp_path / "b"))
  loop.run(head_config(3), str(tmp_path / "b"))
  assert strip(a) == strip(read_jsonl(str(tmp_path / "b" / "metrics.jsonl")))


@pytest.mark.slow
def test_async_partial_rollouts_with_a_head_drafter(tmp_path):
  """Async partial rollouts (versions switch at chunk boundaries, the head's feature carried across them) speculate
  with the head and keep μ the policy's."""
  c = head_config(2)
  c.checkpoint.every = 0
  c.rollout.mode, c.rollout.lag, c.rollout.partial_chunk = "async", 1, 4
  rows = loop.run(c, str(tmp_path))
  assert len(rows) == 2 and all(np.isfinite(r["spec_drafter_kl"]) for r in rows)
  assert any("spec_accept_rate" in r for r in rows)
  assert all(r["mismatch_abs_max"] < 1e-4 for r in rows)


def test_config_validation_names_the_field():
  validate(head_config(1))
  for over, needle in [({"sampler.spec_head_reg_weight": -1.0}, "config.sampler.spec_head_reg_weight=-1.0"),
                       ({"sampler.spec_gamma": 0}, "config.sampler.spec_drafter='head'")]:
    c = head_config(1)
    for k, v in over.items():
      sec, key = k.split(".")
      c[sec][key] = v
    with pytest.raises(ConfigError) as e:
      validate(c)
    assert needle in str(e.value), (over, str(e.value))
