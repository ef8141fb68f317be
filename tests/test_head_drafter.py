"""The EAGLE-style head drafter (`sampling.head_drafter`, `sampler.spec_drafter="head"`): its loss against a numpy
computation from the policy's hidden states, gradients only into the head (distillation raising the acceptance rate
is in tests/test_drafter.py), the policy's distribution and greedy tokens kept whatever the head drafts, in static
batches and the slot engine (in tests/test_speculative.py), kept episode turns drafting with it, and tiny runs
(resume exact, partial rollouts)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import validate
from jaxrl_llm.distill import drafter as dr
from jaxrl_llm.losses.core import LOG_RATIO_BOUND
from jaxrl_llm.metrics import read_jsonl
from jaxrl_llm.models.transformer import hidden, lm_head_weights
from jaxrl_llm.sampling import head_drafter as hd
from jaxrl_llm.sampling import speculative as spec
from jaxrl_llm.sampling.sample import SamplerConfig
from test_drafter import drafter_config, rollout_batch
from test_loop import strip
from test_speculative import CFG, PARAMS


def random_head(seed: int, scale: float = 1.0) -> dict:
  """A head with every weight random (W_down too: `init_head` zeroes it), so each of its parts matters."""
  head = hd.init_head(CFG, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 8))
  return {"eagle": {k: (w if k == "norm_D" else w + scale * 0.3 * jax.random.normal(next(keys), w.shape))
                    for k, w in head["eagle"].items()}}


def np_head_loss(head, seq, pos, seg, mask, weight, temperature, reg_weight, vocab=None, ttt=1):
  """(loss, KL) written out in float64 numpy from the policy's final-normed hidden states (`transformer.hidden`):
  column j >= 1 drafted from (feature before column j - 1, or zeros for j = 1; embedding of token j - 1); with a
  draft vocabulary, both distributions over its tokens only. With `ttt` = U drafts per chain, written as a run
  drafts them, one chain per starting column: a chain starting at column c drafts c from the policy's feature (zeros
  at c = 1), then c + 1, c + 2, ... from its own previous prediction; its d-th draft (d = 1..U) adds 0.8^(d-1) times
  that column's KL and regression, each depth's terms averaged over its columns (weights w · m)."""
  N = mask.shape[1]
  f = np.asarray(jax.jit(hidden, static_argnums=2)(PARAMS, seq, CFG, positions_BT=pos, segment_ids_BT=seg),
                 np.float64)[:, -N - 1:-1]  # f[:, j]: the feature whose head gives column j
  w = {k: np.asarray(v, np.float64) for k, v in head["eagle"].items()}
  emb = np.asarray(PARAMS["embed"], np.float64)[np.asarray(seq)[:, -N:]]  # emb[:, j]: token j's

  def predict(feat, e):
    x = np.concatenate([feat, e], -1) @ w["fc_2DD"]
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + CFG.rms_eps) * w["norm_D"]
    gate = n @ w["gate_DF"]
    return x + ((gate / (1 + np.exp(-gate))) * (n @ w["up_DF"])) @ w["down_FD"]

  head_DV = np.asarray(lm_head_weights(PARAMS, CFG), np.float64)
  if vocab is not None:
    head_DV = head_DV[:, vocab]
  logsm = lambda z: z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
  wm = np.asarray(weight, np.float64)[:, None] * np.asarray(mask, np.float64)
  B = f.shape[0]
  sums = np.zeros((ttt, 3))  # per depth: Σ wm·kl, Σ wm·reg, Σ wm
  for b in range(B):
    for c in range(1, N):
      feat = np.zeros(f.shape[-1]) if c == 1 else f[b, c - 1]
      for d in range(min(ttt, N - c)):
        j = c + d
        pred = predict(feat, emb[b, j - 1])
        lq, lp = logsm(pred @ head_DV / temperature), logsm(f[b, j] @ head_DV / temperature)
        kl = (np.exp(lp) * np.clip(lp - lq, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)).sum()  # `dense.kl_dense`'s bound
        a = np.abs(pred - f[b, j])
        reg = np.where(a < 1, 0.5 * a * a, a - 0.5).mean()
        sums[d] += wm[b, j] * np.array([kl, reg, 1.0])
        feat = pred
  kl_d, reg_d = sums[:, 0] / sums[:, 2], sums[:, 1] / sums[:, 2]
  return float(np.sum(0.8 ** np.arange(ttt) * (kl_d + reg_weight * reg_d))), float(kl_d[0])


@pytest.mark.parametrize("vocab,ttt", [(None, 1), ((0, 2, 3, 7, 10), 1), ((0, 2, 3, 7, 10), 3)])
def test_head_loss_equals_numpy_and_only_the_head_gets_gradient(vocab, ttt):
  """`head_loss` = the numpy loss and KL (temperature 0.8, a shorter row, row weights, reg_weight 2; over the whole
  vocabulary or a draft vocabulary of 5 of the 12 tokens; one draft per chain, or EAGLE-3's training-time test over
  3, the numpy loss written chain by chain as a run drafts); its gradient w.r.t. the policy is zero, w.r.t. every
  part of the head finite and non-zero; a masked column's token changes neither the loss nor the gradient."""
  seq, pos, seg, mask = rollout_batch(PARAMS, 4, 0, N=6)
  mask = mask.at[1, 3:].set(0.0)
  head, weight = random_head(3), jnp.array([1.0, 0.5, 2.0, 0.0])
  vocab_K = None if vocab is None else jnp.array(vocab, jnp.int32)
  loss = lambda h, pp, s: dr.head_loss(h, pp, s, pos, seg, mask, weight, CFG, 0.8, 2.0, vocab_K=vocab_K, ttt=ttt)
  got, got_kl = jax.jit(loss)(head, PARAMS, seq)
  want, want_kl = np_head_loss(head, seq, pos, seg, mask, weight, 0.8, 2.0, vocab, ttt)
  assert want_kl > 0.05 and want > want_kl
  assert float(got) == pytest.approx(want, rel=1e-4)
  assert float(got_kl) == pytest.approx(want_kl, rel=1e-4)
  grad = jax.jit(jax.grad(lambda h, pp, s: loss(h, pp, s)[0], argnums=(0, 1)))
  g_head, g_policy = grad(head, PARAMS, seq)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(g_policy))
  for name, g in g_head["eagle"].items():
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.sum(g * g)) > 0, name
  # the gradient is the numpy loss's (a central difference along a random direction): with U > 1 it flows through
  # the chain of predicted features, as a run's later drafts read them
  v = jax.tree.map(lambda x, k: jax.random.normal(k, x.shape), head,
                   jax.tree.unflatten(jax.tree.structure(head), list(jax.random.split(jax.random.key(9), 5))))
  eps = 1e-4
  step = lambda s: jax.tree.map(lambda h, d: np.asarray(h, np.float64) + s * eps * np.asarray(d, np.float64), head, v)
  fd = (np_head_loss(step(1), seq, pos, seg, mask, weight, 0.8, 2.0, vocab, ttt)[0]
        - np_head_loss(step(-1), seq, pos, seg, mask, weight, 0.8, 2.0, vocab, ttt)[0]) / (2 * eps)
  dot = sum(float(jnp.sum(g * d)) for g, d in zip(jax.tree.leaves(g_head), jax.tree.leaves(v)))
  assert dot == pytest.approx(fd, rel=2e-3)
  # row 1's column 3 (masked) feeds only masked terms: the draft of column 4 and the features of columns 4, 5
  seq2 = seq.at[1, -3].set((seq[1, -3] + 1) % CFG.vocab_size)
  assert float(loss(head, PARAMS, seq2)[0]) == pytest.approx(float(got), rel=1e-6)
  for a, b in zip(jax.tree.leaves(g_head), jax.tree.leaves(grad(head, PARAMS, seq2)[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_draft_vocabulary_counts_drafts_and_q():
  """A head's draft vocabulary (`sampler.spec_head_vocab`): `distill_step` counts the batch's unmasked completion
  tokens (numpy bincount, accumulating over steps), the sampler's head drafts over the K most counted (ties: lower
  id; no counts: ids 0 .. K-1), `spec_head_vocab_hit` is the share of a batch's tokens inside those before it, and
  `draft_head` draws only those tokens, with q the numpy softmax over their K head columns and zero elsewhere."""
  K = 5
  distill = dr.DrafterDistill(model_cfg=CFG, layers=1, temperature=1.0, lr=1e-3, kind="head", vocab=K)
  state = distill.init(PARAMS)
  np.testing.assert_array_equal(np.asarray(distill.sampler_params(state)["vocab_K"]), np.arange(K))
  want, top = np.zeros(CFG.vocab_size), np.arange(K)
  for seed in (0, 1):
    seq, pos, seg, mask = rollout_batch(PARAMS, 4, seed, N=6)
    mask = mask.at[seed, 2:].set(0.0)
    toks, m = np.asarray(seq)[:, -6:], np.asarray(mask)
    np.add.at(want, toks, m)
    state, metrics = dr.distill_step(state, PARAMS, seq, pos, seg, mask, jnp.zeros(4), model_cfg=CFG,
                                     temperature=1.0, lr=1e-3, vocab=K)
    # the hit: against the vocabulary before this batch (the one its tokens were drafted with)
    assert metrics["spec_head_vocab_hit"] == pytest.approx((m * np.isin(toks, top)).sum() / m.sum(), rel=1e-6)
    np.testing.assert_allclose(np.asarray(state.counts_V), want)
    top = np.sort(np.argsort(-want, kind="stable")[:K])
    np.testing.assert_array_equal(np.asarray(distill.sampler_params(state)["vocab_K"]), top)
  head = distill.sampler_params(state)
  feat = jax.random.normal(jax.random.key(4), (3, CFG.d_model))
  drafts, q = jax.jit(spec.draft_head, static_argnums=(5, 6, 7))(
      head, PARAMS, {"feat_BD": feat}, jnp.array([1, 4, 9]), jax.random.key(6), CFG,
      SamplerConfig(max_new_tokens=4, temperature=0.7), 2)
  assert np.all(np.isin(np.asarray(drafts), top)) and np.all(np.isneginf(np.asarray(q)[..., np.setdiff1d(
      np.arange(CFG.vocab_size), top)]))
  f_hat = hd.predict(head, feat, hd.embed(PARAMS, jnp.array([1, 4, 9]), CFG), CFG)  # column 0's feature
  z = np.asarray(f_hat, np.float64) @ np.asarray(lm_head_weights(PARAMS, CFG), np.float64)[:, top] / 0.7
  want_q = np.exp(z - z.max(-1, keepdims=True))
  np.testing.assert_allclose(np.exp(np.asarray(q)[:, 0][:, top]), want_q / want_q.sum(-1, keepdims=True), rtol=1e-4)


def test_head_size():
  """`init_head`: 2D² + 3·D·F + D parameters, W_down zero (f̂ = W_fc·[f; e] at init)."""
  head = hd.init_head(CFG, jax.random.key(0))
  assert hd.is_head(head) and not hd.is_head(PARAMS)
  assert hd.head_size(head) == 2 * 32 * 32 + 3 * 32 * 64 + 32
  assert float(jnp.max(jnp.abs(head["eagle"]["down_FD"]))) == 0.0


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


def head_config(n: int, vocab: int = 0, ttt: int = 1):
  c = drafter_config(n)
  c.sampler.update({"spec_drafter": "head", "spec_distill_lr": 3e-3, "spec_head_reg_weight": 1.0,
                    "spec_head_vocab": vocab, "spec_head_ttt": ttt})
  validate(c)
  return c


@pytest.mark.slow
def test_run_with_a_head_drafter_resumes_exactly(tmp_path):
  """A tiny sync run with `spec_drafter="head"` distils the head every step (the KL falls within a step's Adam steps)
  and speculates with it, and a run stopped after 2 steps and resumed writes the same metrics as an uninterrupted
  3-step one (the head's parameters, Adam state and token counts are in the checkpoint: a draft vocabulary of 6
  tokens, so lost counts would draft other tokens after the resume and draw other samples; the head trained on 2
  drafts per chain, EAGLE-3's training-time test)."""
  a = loop.run(head_config(3, 6, 2), str(tmp_path / "a"))
  assert all(np.isfinite(r["spec_drafter_kl"]) and r["spec_drafter_kl_last"] < r["spec_drafter_kl"] for r in a)
  assert all(0 <= r["spec_accept_rate"] <= 1 and r["mismatch_abs_max"] < 1e-4 for r in a)
  assert all(0 < r["spec_head_vocab_hit"] <= 1 for r in a)
  loop.run(head_config(2, 6, 2), str(tmp_path / "b"))
  loop.run(head_config(3, 6, 2), str(tmp_path / "b"))
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
