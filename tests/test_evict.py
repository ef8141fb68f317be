"""Context compression in episodes (`rollout.evict`): the eviction plan, the recorded layout (a hand-built golden
case with a scripted sampler), exactness of the packed row against separate per-context forwards (value and
gradient), zero gradient on copied context, no eviction = today's rows, and SDCC's teacher rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import envs, losses, packing
from jaxrl_llm.learner import completion_logprobs
from jaxrl_llm.models import ModelConfig, forward, init_params
from jaxrl_llm.rollout import evict, turn_sampler
from jaxrl_llm.rollout.episodes import EnvSettings, render_env_message, run_episodes
from jaxrl_llm.rollout.generation import Generation
from jaxrl_llm.sampling import SamplerConfig
from jaxrl_llm.tasks import tokenizer as char_tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER
from jaxrl_llm.types import LossInputs

CFG = ModelConfig(vocab_size=char_tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_seq_len=160, dtype="float32")
P = 4


def _params():
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 4.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(CFG, jax.random.key(0)))


PARAMS = _params()


@envs.register("test_evict_ok")
class Ok:
  """Never done; answers every action with "ok" (2 tokens), reward 0.5 per step."""

  def reset(self, seed):
    return "g"

  def step(self, action):
    return "ok", 0.5, False


def make_gen(temperature=1.0):
  samp = SamplerConfig(max_new_tokens=4, stop_ids=(char_tok.eos_id,), temperature=temperature, pad_id=char_tok.pad_id)
  return Generation(task=None, train_examples=None, width=P, model_cfg=CFG, sampler_cfg=samp,
                    key_root=jax.random.key(1), seed=0, encoder=CHAR_ENCODER)


def test_drop_oldest_plan():
  turn_L = [-1, -1, 0, 0, 0, 1, 1, 2, 2, 2]
  keep = evict.drop_oldest(turn_L, budget=6, keep_last=1)  # 10 > 6: drop turn 0 (7 left), then turn 1 (5)
  np.testing.assert_array_equal(keep, [1, 1, 0, 0, 0, 0, 0, 1, 1, 1])
  keep = evict.drop_oldest(turn_L, budget=6, keep_last=2)  # turn 1 must stay: 7 > 6 is the best it can do
  np.testing.assert_array_equal(keep, [1, 1, 0, 0, 0, 1, 1, 1, 1, 1])
  keep = evict.drop_oldest(turn_L, budget=8, keep_last=1)  # dropping turn 0 is enough
  np.testing.assert_array_equal(keep, [1, 1, 0, 0, 0, 1, 1, 1, 1, 1])
  assert evict.drop_oldest(turn_L, budget=10, keep_last=1) is None  # fits
  assert evict.drop_oldest(turn_L, budget=2, keep_last=3) is None  # every turn must stay
  assert evict.drop_oldest([-1, -1, -1], budget=1, keep_last=1) is None  # the first message is never dropped


class Scripted:
  """A turn sampler that answers turn t with two copies of the id of letter t ("a", "b", ...), no stop id; it
  records every context it is given (the live contexts the policy saw)."""
  seen: list = []

  def __init__(self, gen, width, mesh=None):
    self.prefills = 0

  def turn(self, params, version, rows_b, contexts, key, cfg):
    turn = max([k for k, _, _ in Scripted.seen], default=-1) + 1
    Scripted.seen.extend((turn, b, list(c)) for b, c in zip(rows_b, contexts))
    ids = CHAR_ENCODER.tokenizer.encode("abcdefgh"[turn])[0]
    n = len(rows_b)
    return {"tokens_BN": np.full((n, 2), ids, np.int32), "lengths_B": np.full((n,), 2, np.int32),
            "behavior_logp_BN": np.full((n, 2), -0.5, np.float32)}

  def forget(self, row):
    pass


def test_scripted_episode_records_the_golden_layout(monkeypatch):
  """prompt p = [BOS, g]; each turn: xx (policy) then "ok" (env). Budget p + 5, keep 1 turn: before turn 2 the
  live context p·x0x0ok·x1x1ok (p + 8) drops turn 0; before turn 3 (p + 8 again) it drops turn 1."""
  Scripted.seen = []
  monkeypatch.setattr(turn_sampler, "CachedTurns", Scripted)
  p = CHAR_ENCODER.episode_prompt_ids("g")
  ok = render_env_message(CHAR_ENCODER, "ok", turn_ended=False)
  x = [CHAR_ENCODER.tokenizer.encode(ch)[0] for ch in "abcd"]
  assert len(p) == 2 and len(ok) == 2
  s = EnvSettings(name="test_evict_ok", max_turns=4, turn_tokens=2, max_episode_tokens=32, evict="drop_oldest",
                  context_budget=len(p) + 5, keep_last_turns=1)
  r = run_episodes(make_gen(), PARAMS, [0], 1, s, jax.random.key(0), version=3, width=P)
  t0, t1, t2, t3 = ([xi, xi] for xi in x)
  seg1 = t0 + ok + t1 + ok
  seg2 = p + t1 + ok + t2 + ok
  seg3 = p + t2 + ok + t3
  row = seg1 + seg2 + seg3
  n = len(row)
  assert n == 8 + 10 + 8
  np.testing.assert_array_equal(r.sequence_BT[0, P:P + n], row)
  assert (r.sequence_BT[0, P + n:] == char_tok.pad_id).all()
  np.testing.assert_array_equal(r.sequence_BT[0, :P], [char_tok.pad_id] * 2 + p)
  want_mask = [1, 1, 0, 0] * 2 + [0, 0] + [0, 0, 0, 0] + [1, 1, 0, 0] + [0, 0] + [0, 0, 0, 0] + [1, 1]
  np.testing.assert_array_equal(r.mask_BN[0, :n], want_mask)
  assert r.mask_BN[0, n:].sum() == 0 and r.env_mask_BN[0, n:].sum() == 0
  want_env = [0, 0, 1, 1] * 2 + [0] * 6 + [0, 0, 1, 1] + [0] * 8
  np.testing.assert_array_equal(r.env_mask_BN[0, :n], want_env)
  want_turn = [0] * 4 + [1] * 4 + [-1, -1] + [1] * 4 + [2] * 4 + [-1, -1] + [2] * 4 + [3] * 2
  np.testing.assert_array_equal(r.turn_BN[0, :n], want_turn)
  np.testing.assert_array_equal(r.segment_ids_BT[0], [0, 0] + [1] * 10 + [2] * 10 + [3] * 8 + [0] * (32 - n))
  np.testing.assert_array_equal(r.positions_BT[0, 2:P + n], list(range(10)) + list(range(10)) + list(range(8)))
  assert r.stats["env_evictions"] == 2 and r.stats["env_copied_tokens"] == 12
  assert r.stats["evict_segment_starts"] == ((8, 18),)
  np.testing.assert_array_equal(r.behavior_logp_BN[0, :n][np.asarray(want_mask) > 0], -0.5)
  # What the sampler saw, turn by turn: the live contexts.
  assert [c for _, _, c in Scripted.seen] == [p, p + t0 + ok, p + t1 + ok, p + t2 + ok]
  # SDCC: the first turn after each eviction is distilled from the uncompressed context before it.
  e = r.extra
  np.testing.assert_array_equal(np.flatnonzero(e["eviction_mask_BN"][0]), [14, 15, 24, 25])
  u2, u3 = p + t0 + ok + t1 + ok, p + t1 + ok + t2 + ok
  teacher = u2 + t2 + u3 + t3
  np.testing.assert_array_equal(e["sdcc_teacher_seq_BU"][0, :len(teacher)], teacher)
  np.testing.assert_array_equal(e["sdcc_teacher_seg_BU"][0, :len(teacher)], [1] * 12 + [2] * 12)
  np.testing.assert_array_equal(e["sdcc_teacher_pos_BU"][0, :len(teacher)], list(range(12)) * 2)
  src = e["sdcc_teacher_src_BN"][0]
  np.testing.assert_array_equal(src[[14, 15, 24, 25]], [9, 10, 21, 22])
  assert (np.delete(src, [14, 15, 24, 25]) == -1).all()
  assert r.stats["env_sdcc_skipped"] == 0


def test_an_eviction_without_room_truncates(monkeypatch):
  """Budget N = 12: before turn 2 the compressed copy (6 ids) does not fit after the 8 used columns, so the episode
  ends "truncated" with segment 1 only (and a batch whose every episode ends so stops playing)."""
  Scripted.seen = []
  monkeypatch.setattr(turn_sampler, "CachedTurns", Scripted)
  s = EnvSettings(name="test_evict_ok", max_turns=4, turn_tokens=2, max_episode_tokens=12, evict="drop_oldest",
                  context_budget=7)
  r = run_episodes(make_gen(), PARAMS, [0], 1, s, jax.random.key(0), version=0, width=P)
  assert r.stats["episode_statuses"] == ("truncated",) and r.stats["env_evictions"] == 0
  assert len(Scripted.seen) == 2 and r.segment_ids_BT.max() == 1 and r.mask_BN.sum() == 4
  assert not r.extra["eviction_mask_BN"].any()


@envs.register("test_evict_log")
class Logged(Ok):
  """`Ok` that records every action it is given (class-level, for the test)."""
  actions: list = []

  def step(self, action):
    Logged.actions.append(action)
    return super().step(action)


def test_scripted_summary_eviction_golden_layout(monkeypatch):
  """"summary", budget 7: after turn 1 the context p·aa·ok·bb (8) plus "ok" is too long, so the observation comes
  with the instruction and turn 2 ("cc") is the summary (no environment step); the context becomes p·cc·ok and
  turn 3 acts. At turn 3's observation only the last turn is left, so nothing more is summarized."""
  Scripted.seen, Logged.actions = [], []
  monkeypatch.setattr(turn_sampler, "CachedTurns", Scripted)
  p = CHAR_ENCODER.episode_prompt_ids("g")
  enc = lambda text: CHAR_ENCODER.tokenizer.encode(text)
  ok, ask = enc("ok"), enc("ok") + enc("summarize:")
  aa, bb, cc, dd, ee = (enc(ch * 2) for ch in "abcde")
  s = EnvSettings(name="test_evict_log", max_turns=5, turn_tokens=2, max_episode_tokens=40, evict="summary",
                  context_budget=7)
  r = run_episodes(make_gen(), PARAMS, [0], 1, s, jax.random.key(0), version=0, width=P)
  seg1 = aa + ok + bb + ask + cc
  seg2 = p + cc + ok + dd + ok + ee
  row = seg1 + seg2
  n = len(row)
  assert n == 20 + 12
  np.testing.assert_array_equal(r.sequence_BT[0, P:P + n], row)
  want_mask = [1, 1, 0, 0, 1, 1] + [0] * 12 + [1, 1] + [0] * 6 + [1, 1, 0, 0, 1, 1]
  np.testing.assert_array_equal(r.mask_BN[0, :n], want_mask)
  want_env = [0, 0, 1, 1, 0, 0] + [1] * 12 + [0, 0] + [0] * 6 + [0, 0, 1, 1, 0, 0]
  np.testing.assert_array_equal(r.env_mask_BN[0, :n], want_env)
  want_turn = [0] * 4 + [1] * 14 + [2] * 2 + [-1, -1, 2, 2, 2, 2] + [3] * 4 + [4] * 2
  np.testing.assert_array_equal(r.turn_BN[0, :n], want_turn)
  np.testing.assert_array_equal(r.segment_ids_BT[0, P:P + n], [1] * 20 + [2] * 12)
  np.testing.assert_array_equal(r.positions_BT[0, 2:P + n], list(range(22)) + list(range(12)))
  assert [c for _, _, c in Scripted.seen] == [p, p + aa + ok, p + aa + ok + bb + ask, p + cc + ok, p + cc + ok + dd + ok]
  assert Logged.actions == ["aa", "bb", "dd", "ee"]  # the summary never reaches the environment
  assert r.stats["env_evictions"] == 1 and r.stats["env_copied_tokens"] == 6 and r.stats["env_turns"] == 5
  e = r.extra
  np.testing.assert_array_equal(np.flatnonzero(e["eviction_mask_BN"][0]), [26, 27])
  teacher = p + aa + ok + bb + ok + dd  # the uncompressed context (no instruction), then the distilled turn
  np.testing.assert_array_equal(e["sdcc_teacher_seq_BU"][0, :len(teacher)], teacher)
  np.testing.assert_array_equal(e["sdcc_teacher_src_BN"][0, [26, 27]], [9, 10])


SETTINGS = EnvSettings(name="test_evict_ok", max_turns=5, turn_tokens=3, max_episode_tokens=48, evict="drop_oldest",
                       context_budget=9, keep_last_turns=1, kv_cache=False)


class Recording(turn_sampler.Reprefill):
  """`Reprefill` that keeps (turn, row, context, tokens) of every live row: the independent reference."""
  log: list = []

  def turn(self, params, version, rows_b, contexts, key, cfg):
    out = super().turn(params, version, rows_b, contexts, key, cfg)
    t = self.prefills - 1
    for i, b in enumerate(rows_b[:len(set(rows_b))]):
      Recording.log.append((t, b, list(contexts[i]), out["tokens_BN"][i, :out["lengths_B"][i]].tolist()))
    return out


@pytest.fixture(scope="module", params=["drop_oldest", "summary"])
def evicted(request):
  Recording.log = []
  mp = pytest.MonkeyPatch()
  mp.setattr(turn_sampler, "Reprefill", Recording)
  settings = dataclasses.replace(SETTINGS, evict=request.param)
  try:
    r = run_episodes(make_gen(), PARAMS, [1, 2], 2, settings, jax.random.key(7), version=0, width=P)
  finally:
    mp.undo()
  return r, list(Recording.log), request.param


def _packed_logp(params, r):
  seq, pos, seg = (jnp.asarray(a) for a in (r.sequence_BT, r.positions_BT, r.segment_ids_BT))
  return completion_logprobs(params, seq, pos, seg, r.mask_BN.shape[1], CFG, 1.0)["logp_BT"]


def _per_context_logp(params, ctx, toks):
  """log π(toks | ctx) as its own sequence: one plain forward, positions 0.., no segments, log-softmax here."""
  ids = jnp.asarray([ctx + toks], jnp.int32)
  logits = forward(params, ids, CFG)[0, len(ctx) - 1:-1]
  return jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1), ids[0, len(ctx):, None], -1)[:, 0]


def test_evicted_episode_layout_invariants(evicted):
  r, log, policy = evicted
  assert r.stats["env_evictions"] >= 2, r.stats
  assert (r.segment_ids_BT.max(1) >= 2).any()
  for t, b, ctx, toks in log:
    if policy == "drop_oldest":
      assert len(ctx) <= SETTINGS.context_budget  # every context the policy saw was within the budget
    cols = np.flatnonzero((r.turn_BN[b] == t) & (r.mask_BN[b] > 0))
    np.testing.assert_array_equal(r.sequence_BT[b, P + cols], toks)  # the policy's tokens, exactly
    # the tokens before them in their segment are exactly the context they were sampled with
    seg = r.segment_ids_BT[b, P + cols[0]]
    same = np.flatnonzero(r.segment_ids_BT[b] == seg)
    np.testing.assert_array_equal(r.sequence_BT[b, same[same < P + cols[0]]], ctx)
    np.testing.assert_array_equal(r.positions_BT[b, P + cols], len(ctx) + np.arange(len(cols)))


def test_packed_row_equals_per_context_forwards_in_value_and_gradient(evicted):
  """Σ w·log π over policy tokens: the packed row (one forward, segments) against one forward per sampled context
  (the sampler's own contexts, recorded), in value and in gradient w.r.t. every parameter; and μ = π (fp32)."""
  r, log, policy = evicted
  w_BN = jnp.asarray(np.random.default_rng(0).normal(size=r.mask_BN.shape), jnp.float32)
  mask = jnp.asarray(r.mask_BN)

  def packed(params):
    return jnp.sum(w_BN * mask * _packed_logp(params, r))

  # The reference: every sampled context followed by its turn's tokens as its own row (right-padded: causal
  # attention never reaches the padding), a plain forward and log-softmax, weighted like the packed tokens.
  L = max(len(ctx) + len(toks) for _, _, ctx, toks in log)
  ids_ML = np.zeros((len(log), L), np.int32)
  w_ML = np.zeros((len(log), L - 1), np.float32)
  for i, (t, b, ctx, toks) in enumerate(log):
    ids_ML[i, :len(ctx) + len(toks)] = ctx + toks
    cols = np.flatnonzero((r.turn_BN[b] == t) & (r.mask_BN[b] > 0))
    w_ML[i, len(ctx) - 1:len(ctx) - 1 + len(toks)] = np.asarray(w_BN)[b, cols]

  def separate(params):
    logp_MLV = jax.nn.log_softmax(forward(params, jnp.asarray(ids_ML), CFG)[:, :-1].astype(jnp.float32), -1)
    logp_ML = jnp.take_along_axis(logp_MLV, jnp.asarray(ids_ML)[:, 1:, None], -1)[..., 0]
    return jnp.sum(jnp.asarray(w_ML) * logp_ML)

  v1, g1 = jax.jit(jax.value_and_grad(packed))(PARAMS)
  v2, g2 = jax.jit(jax.value_and_grad(separate))(PARAMS)
  assert int((w_ML != 0).sum()) == int(r.mask_BN.sum())  # every policy token is in exactly one reference row
  np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g1, g2)
  m = r.mask_BN > 0
  np.testing.assert_allclose(np.asarray(_packed_logp(PARAMS, r))[m], r.behavior_logp_BN[m], atol=1e-4)


@pytest.mark.parametrize("share", [False, True])
def test_learner_packing_scores_evicted_rows_as_their_padded_rows(evicted, share):
  """`optim.pack_width` on evicted episodes: their rows (several segments each) packed together score every
  policy token as the padded rows do, in value and in gradient; `share`: with each later segment's copy of the
  first message left out and the first message written once (`pack(prompt_len=P)`, as the loop packs)."""
  r, _, _ = evicted
  T, N = r.sequence_BT.shape[1], r.mask_BN.shape[1]
  assert (r.segment_ids_BT.max(1) >= 2).any()
  pk = packing.pack(r.sequence_BT, r.positions_BT, r.segment_ids_BT, 2 * T, prompt_len=(T - N) if share else 0)
  real = int((r.segment_ids_BT > 0).sum())
  if share:  # every later segment drops all but the last token of its copy of the first message
    plen_B = (r.segment_ids_BT[:, :T - N] > 0).sum(1)
    later_B = np.asarray([len(np.unique(x[x > 1])) for x in r.segment_ids_BT])
    assert (later_B > 0).any() and pk.share_RW is not None
    assert int(pk.len_B.sum()) == real - int((later_B * (plen_B - 1)).sum())
  else:
    assert pk.share_RW is None and int(pk.len_B.sum()) == real
  pk = jax.tree.map(jnp.asarray, pk)
  assert pk.tokens_RW.shape[0] < len(pk.len_B)  # episodes share packed rows
  w_BN = jnp.asarray(np.random.default_rng(1).normal(size=r.mask_BN.shape) * r.mask_BN, jnp.float32)
  packed = lambda params: jnp.sum(w_BN * packing.packed_logprobs(params, pk, T, N, CFG, 1.0)["logp_BT"])
  padded = lambda params: jnp.sum(w_BN * _packed_logp(params, r))
  v1, g1 = jax.jit(jax.value_and_grad(packed))(PARAMS)
  v2, g2 = jax.jit(jax.value_and_grad(padded))(PARAMS)
  np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g1, g2)


def test_loop_packs_evicted_episodes_with_their_first_message_once(evicted):
  """`loop.pack_batch` on evicted episodes: with `optim.pack_width=0` one row each at the compacted width (fewer
  columns than the padded rows, still one row per episode), with a width the shared layout too; either way the
  packed forward scores every policy token as the padded rows do, and ALP (not packable) keeps the padded rows."""
  from jaxrl_llm import learner, loop  # noqa: PLC0415
  r, _, _ = evicted
  T, N = r.sequence_BT.shape[1], r.mask_BN.shape[1]
  B = r.mask_BN.shape[0]
  batch = learner.Batch(sequence_BT=jnp.asarray(r.sequence_BT), positions_BT=jnp.asarray(r.positions_BT),
                        segment_ids_BT=jnp.asarray(r.segment_ids_BT), mask_BN=jnp.asarray(r.mask_BN),
                        adv_BN=jnp.zeros(r.mask_BN.shape), behavior_logp_BN=jnp.asarray(r.behavior_logp_BN),
                        versions_BN=jnp.zeros(r.mask_BN.shape, jnp.int32), lag_B=jnp.zeros(B, jnp.int32))
  c = _sdcc_config()
  want = np.asarray(_packed_logp(PARAMS, r))
  m = r.mask_BN > 0
  for width in (0, 2 * T):
    c.optim.pack_width = width
    got, _ = loop.pack_batch(c, batch, r)
    pk = got.pack
    assert pk.share_RW is not None and packing.skipped_tokens(pk, r.segment_ids_BT) > 0
    if width == 0:
      assert pk.tokens_RW.shape == (B, packing.compact_width(r.sequence_BT, r.positions_BT, r.segment_ids_BT,
                                                              T - N)) and pk.tokens_RW.shape[1] < T
    lp = np.asarray(packing.packed_logprobs(PARAMS, pk, T, N, CFG, 1.0)["logp_BT"])
    np.testing.assert_allclose(lp[m], want[m], atol=1e-4)
  c.optim.pack_width, c.loss.name = 0, "alp"
  same, _ = loop.pack_batch(c, batch, r)
  assert same is batch


def test_kept_kv_cache_reprefills_after_an_eviction():
  """With `env.kv_cache` an evicted episode's cache is stale (its context was rewritten): the turn after an eviction
  re-prefills, and μ still equals the learner's log-probs on the segment rows."""
  s = dataclasses.replace(SETTINGS, kv_cache=True, max_turns=4)
  r = run_episodes(make_gen(), PARAMS, [1], 2, s, jax.random.key(7), version=0, width=P)
  assert r.stats["env_evictions"] > 0
  evict_turns = {int(r.turn_BN[b, c]) for b, c in zip(*np.nonzero(r.extra["eviction_mask_BN"]))}
  assert r.stats["env_prefills"] == 1 + len(evict_turns)  # the first turn, then each turn that follows evictions
  m = r.mask_BN > 0
  np.testing.assert_allclose(np.asarray(_packed_logp(PARAMS, r))[m], r.behavior_logp_BN[m], atol=1e-4)


def test_copied_context_gets_zero_gradient(evicted):
  """d(ppo_clip loss)/d logp is exactly 0 on the copied contexts (and on every mask-0 column)."""
  r, _, _ = evicted
  copies = (r.segment_ids_BT[:, P:] > 1) & (r.mask_BN == 0) & (r.env_mask_BN == 0)
  assert copies.sum() > 4
  spec = losses.get("ppo_clip")
  adv = jnp.asarray(np.random.default_rng(1).normal(size=r.mask_BN.shape), jnp.float32)

  def total(logp):
    inp = LossInputs(logp_BN=logp, mask_BN=jnp.asarray(r.mask_BN), adv_BN=adv, prox_logp_BN=jnp.asarray(r.behavior_logp_BN),
                     behavior_logp_BN=jnp.asarray(r.behavior_logp_BN))
    num, den = losses.reduce_parts(spec.fn(inp, losses.make_hparams(spec))[0], inp.mask_BN)
    return num / jnp.maximum(den, 1.0)

  g = np.asarray(jax.grad(total)(jnp.asarray(r.behavior_logp_BN) + 0.1))
  assert (g[copies] == 0).all() and (g[r.mask_BN == 0] == 0).all()
  assert np.abs(g[r.mask_BN > 0]).sum() > 0


def test_no_eviction_is_todays_record():
  """`evict="none"` and a budget never reached give the same rows (and no eviction extras on "none")."""
  base = EnvSettings(name="test_evict_ok", max_turns=3, turn_tokens=3, max_episode_tokens=24)
  a = run_episodes(make_gen(), PARAMS, [4], 2, base, jax.random.key(3), version=1, width=P)
  import dataclasses  # noqa: PLC0415
  b = run_episodes(make_gen(), PARAMS, [4], 2, dataclasses.replace(base, evict="drop_oldest", context_budget=1000),
                   jax.random.key(3), version=1, width=P)
  assert a.extra is None and "env_evictions" not in a.stats
  for k, v in a.arrays().items():
    np.testing.assert_array_equal(v, getattr(b, k), err_msg=k)
  assert b.stats["env_evictions"] == 0 and not b.extra["eviction_mask_BN"].any()


def test_sdcc_teacher_is_the_policy_on_the_uncompressed_context(evicted):
  """The teacher head's logits at each distilled token equal a plain forward over (context before the eviction +
  the turn's tokens); its tokens are the first turn of each new segment."""
  r, log, policy = evicted
  if policy != "drop_oldest":
    pytest.skip("the uncompressed context is rebuilt here the drop_oldest way (summary: the scripted golden case)")
  ex = evict.sdcc_extras(PARAMS, r.extra, CFG, 1.0, with_teacher=True)
  e_BN = np.asarray(ex["eviction_mask_BN"])
  assert e_BN.sum() > 0
  head = ex["teacher_head"]
  logits_BNV = jnp.einsum("bnd,dv->bnv", head.hidden_BND, head.w_DV)
  by_turn = {(t, b): (ctx, toks) for t, b, ctx, toks in log}
  checked = 0
  for b in range(r.mask_BN.shape[0]):
    for t in sorted({int(x) for x in r.turn_BN[b][e_BN[b] > 0]}):
      cols = np.flatnonzero((r.turn_BN[b] == t) & (r.mask_BN[b] > 0))
      assert (e_BN[b, cols] == 1).all()
      prev_ctx, prev_toks = by_turn[(t - 1, b)]  # the uncompressed context: last context + turn + observation
      obs = render_env_message(CHAR_ENCODER, "ok", turn_ended=char_tok.eos_id in prev_toks)
      uncompressed = prev_ctx + prev_toks + obs
      toks = by_turn[(t, b)][1]
      ids = jnp.asarray([uncompressed + toks], jnp.int32)
      want = forward(PARAMS, ids, CFG)[0, len(uncompressed) - 1:-1]
      np.testing.assert_allclose(logits_BNV[b, cols], want, rtol=1e-4, atol=1e-4)
      checked += 1
  assert checked == r.stats["env_evictions"] - r.stats["env_sdcc_skipped"]


def _sdcc_config():
  import os  # noqa: PLC0415
  from jaxrl_llm.config import load_file  # noqa: PLC0415
  return load_file(os.path.join(os.path.dirname(__file__), "..", "configs", "sdcc_tiny.py"))


@pytest.mark.parametrize("field,value,named", [
    ("evict", "forget_all", "env.evict"), ("context_budget", 0, "env.context_budget"),
    ("keep_last_turns", 0, "env.keep_last_turns"), ("context_budget", 2.5, "env.context_budget"),
])
def test_eviction_config_validation_names_the_field(field, value, named):
  from jaxrl_llm import config as config_lib  # noqa: PLC0415
  c = _sdcc_config()
  c.env = config_lib.ml_collections.ConfigDict({**c.env.to_dict(), field: value})
  with pytest.raises(config_lib.ConfigError, match=f"config.{named}="):
    config_lib.validate(c)


def test_sdcc_needs_eviction():
  """sdcc runs only where episodes evict: without `env.evict` its eviction mask and teacher are missing."""
  from jaxrl_llm import config as config_lib  # noqa: PLC0415
  c = _sdcc_config()
  config_lib.validate(c)
  assert {"eviction", "teacher_logits"} <= config_lib.available_needs(c)
  c.env.evict = "none"
  with pytest.raises(config_lib.ConfigError, match="eviction"):
    config_lib.validate(c)


def test_shared_prompt_4d_mask_layout_equals_the_segment_row(evicted):
  """The packed-4D-mask alternative (first message written once, `evict.shared_prompt_layout`) scores every policy
  token as the segment row does, with fewer columns; and the grouped scorer (shared GRPO prompt) agrees too."""
  from jaxrl_llm.learner import make_score_fn  # noqa: PLC0415
  from jaxrl_llm.models.transformer import logits_from_hidden, hidden  # noqa: PLC0415
  r, _, _ = evicted
  plen_B = (r.segment_ids_BT[:, :P] > 0).sum(1)
  lay = evict.shared_prompt_layout(r.sequence_BT, r.positions_BT, r.segment_ids_BT, plen_B, P)
  assert lay["tokens_BS"].shape[1] < r.sequence_BT.shape[1] - 2
  h = hidden(PARAMS, jnp.asarray(lay["tokens_BS"]), CFG, positions_BT=jnp.asarray(lay["positions_BS"]),
             mask_BTT=jnp.asarray(lay["mask_BSS"]))
  logp_BSV = jax.nn.log_softmax(logits_from_hidden(PARAMS, h, CFG).astype(jnp.float32), -1)
  want = np.asarray(_packed_logp(PARAMS, r))
  checked = 0
  for b in range(r.mask_BN.shape[0]):
    for i in range(1, lay["src_BS"].shape[1]):
      col = lay["src_BS"][b, i]
      if col >= P and r.mask_BN[b, col - P] > 0:
        got = float(logp_BSV[b, i - 1, lay["tokens_BS"][b, i]])
        np.testing.assert_allclose(got, want[b, col - P], atol=1e-4)
        checked += 1
  assert checked == int(r.mask_BN.sum())
  score = make_score_fn(CFG, 1.0, group_size=2)
  grouped = score(PARAMS, *(jnp.asarray(a) for a in (r.sequence_BT, r.positions_BT, r.segment_ids_BT, r.mask_BN)))
  np.testing.assert_allclose(np.asarray(grouped), np.where(r.mask_BN > 0, want, 0), atol=1e-4)


def test_eviction_extra_survives_plain_data_and_sdcc_trains_async(tmp_path):
  """The eviction layout is rollout data: `record.to_plain` keeps it (checkpoints, async gathering) and `from_plain`
  restores it; teacher outputs (device arrays) are still refused. configs/sdcc_tiny.py trains 2 async steps with
  the learner writing each episode's first message once (`learner_copies_skipped`, `optim.pack_width=0`)."""
  from jaxrl_llm import loop, record  # noqa: PLC0415
  s = dataclasses.replace(SETTINGS, max_turns=3)
  r = run_episodes(make_gen(), PARAMS, [5], 2, s, jax.random.key(2), version=0, width=P)
  back = record.from_plain(record.to_plain(r))
  assert set(back.extra) == set(r.extra)
  for k, v in r.extra.items():
    np.testing.assert_array_equal(back.extra[k], v)
  with pytest.raises(ValueError, match="not checkpointed"):
    record.to_plain(r.replace(extra={**r.extra, "teacher_logp_BN": jnp.zeros(r.mask_BN.shape)}))
  c = _sdcc_config()
  c.num_steps, c.rollout.mode, c.rollout.lag, c.rollout.num_workers = 2, "async", 1, 2
  c.log.tensorboard = False
  rows = loop.run(c, str(tmp_path / "async"))
  assert [x["step"] for x in rows] == [0, 1] and all(np.isfinite(x["loss"]) for x in rows)
  assert sum(x["env_evictions"] for x in rows) > 0 and all("sdcc_kl" in x for x in rows)
  assert all(x.get("learner_copies_skipped", 0) > 0 for x in rows if x["env_evictions"])
