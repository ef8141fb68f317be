"""The packed learner (`jaxrl_llm.packing`): packing round-trips, and packed scoring and training equal the padded path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_llm import learner, packing
from jaxrl_llm.models import ModelConfig, init_params

CFG = ModelConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, max_seq_len=32)
P, N = 5, 6
SGD = optax.sgd(1.0)  # parameter change = -gradient: updated params compare gradients directly


def padded(rng, plen_B, clen_B):
  """A learner-shaped padded batch: prompts left-padded to P (position 0, segment 0 on padding), completions of
  `clen_B` tokens then padding (segment 0, mask 0), as the sampler lays them out."""
  B = len(plen_B)
  seq = np.zeros((B, P + N), np.int32)
  pos = np.zeros((B, P + N), np.int32)
  seg = np.zeros((B, P + N), np.int32)
  mask = np.zeros((B, N), np.float32)
  for b, (p, n) in enumerate(zip(plen_B, clen_B)):
    seq[b, P - p:P + n] = rng.integers(3, CFG.vocab_size, p + n)
    pos[b, P - p:] = np.arange(N + p)
    seg[b, P - p:P + n] = 1
    mask[b, :n] = 1.0
  return seq, pos, seg, mask


def make_batch(params, plen_B=(5, 2, 3, 1, 4, 5, 2, 3), clen_B=(6, 1, 2, 4, 1, 3, 6, 2), seed=0):
  seq, pos, seg, mask = padded(np.random.default_rng(seed), plen_B, clen_B)
  B = len(plen_B)
  logp = learner.make_score_fn(CFG, 1.0)(params, seq, pos, seg, mask)
  adv = np.linspace(-1.0, 1.5, B)[:, None] * mask
  return learner.Batch(sequence_BT=jnp.asarray(seq), positions_BT=jnp.asarray(pos), segment_ids_BT=jnp.asarray(seg),
                       mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv, jnp.float32),
                       behavior_logp_BN=logp - 0.05 * mask, versions_BN=jnp.zeros((B, N), jnp.int32),
                       lag_B=jnp.zeros((B,), jnp.int32), prox_logp_BN=None)


def with_pack(batch, width, chunks=1):
  pk = packing.pack(batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, width, chunks)
  return batch.replace(pack=jax.tree.map(jnp.asarray, pk))


def assert_trees_close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, **tol)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, P), st.integers(0, N)), min_size=1, max_size=12),
       width=st.integers(P + N, 3 * (P + N)), chunks=st.sampled_from([1, 2, 3]))
def test_pack_unpack_round_trip(lens, width, chunks):
  """Every real token comes back to its padded column with its position; each packed row holds at most `width`
  tokens in distinct segments 1..k; no chunk's rows mix with another chunk's; R follows the bucket rule."""
  lens = lens + [(1, 1)] * (-len(lens) % chunks)
  plen, clen = zip(*lens)
  seq, pos, seg, _ = padded(np.random.default_rng(len(lens)), plen, clen)
  pk = packing.pack(seq, pos, seg, width, chunks)
  B, Bc = len(lens), len(lens) // chunks
  got_seq, got_pos, got_real = packing.unpack(pk, P + N)
  np.testing.assert_array_equal(got_real, seg > 0)
  np.testing.assert_array_equal(np.where(seg > 0, got_seq, 0), np.where(seg > 0, seq, 0))
  np.testing.assert_array_equal(np.where(seg > 0, got_pos, 0), np.where(seg > 0, pos, 0))
  assert pk.tokens_RW.shape == (chunks * pk.rows, width)
  assert (pk.segment_ids_RW > 0).sum() == (seg > 0).sum()  # every real token once, nothing else
  step = -(-Bc // packing.BUCKETS)
  assert pk.rows % step == 0 or pk.rows == Bc
  for b in range(B):  # the segment of a sequence is its own: no other sequence shares (row, id)
    if pk.len_B[b]:
      r = (b // Bc) * pk.rows + pk.row_B[b]
      ids = pk.segment_ids_RW[r, pk.start_B[b]:pk.start_B[b] + pk.len_B[b]]
      assert len(set(ids.tolist())) == 1 and ids[0] > 0
      others = [c for c in range(B) if c != b and pk.len_B[c] and (c // Bc) * pk.rows + pk.row_B[c] == r]
      for c in others:
        oc = pk.segment_ids_RW[r, pk.start_B[c]]
        assert oc != ids[0]
        assert pk.start_B[c] + pk.len_B[c] <= pk.start_B[b] or pk.start_B[b] + pk.len_B[b] <= pk.start_B[c]


def test_first_fit_decreasing_packs_golden_rows():
  """Lengths 7, 5, 4, 3, 1 into width 8: FFD places 7+1, 5+3, 4 (hand-computed)."""
  row, start, used = packing.first_fit_decreasing(np.array([3, 7, 1, 5, 4]), 8)
  assert used == 3
  assert row.tolist() == [1, 0, 0, 1, 2] and start.tolist() == [5, 0, 7, 0, 0]
  with pytest.raises(ValueError, match="optim.pack_width"):
    packing.first_fit_decreasing(np.array([9]), 8)


def test_packed_logprobs_equal_padded():
  """Log-probs, entropy and gathered candidate log-probs on the packed rows equal the padded forward's on every
  scored token; the packing saves slots (the padded batch is mostly padding, the packed rows little)."""
  params = init_params(CFG, jax.random.key(1))
  batch = with_pack(make_batch(params), P + N)
  ids = jax.random.randint(jax.random.key(2), (*batch.mask_BN.shape, 3), 0, CFG.vocab_size)
  want = learner.completion_logprobs(params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, N, CFG, 0.7,
                                     with_entropy=True, gather_ids_BNk=ids)
  got = packing.packed_logprobs(params, batch.pack, P + N, N, CFG, 0.7, with_entropy=True, gather_ids_BNk=ids)
  m = np.asarray(batch.mask_BN) > 0
  for k in ("logp_BT", "entropy_BT"):
    np.testing.assert_allclose(np.asarray(got[k])[m], np.asarray(want[k])[m], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got["gathered_logp_BTk"])[m], np.asarray(want["gathered_logp_BTk"])[m],
                             atol=2e-5, rtol=1e-5)
  assert packing.pad_frac(batch.pack.segment_ids_RW) < 0.5 * packing.pad_frac(batch.segment_ids_BT)


def test_attention_never_crosses_segments():
  """Changing one sequence's tokens changes its own log-probs and no other sequence's (they share packed rows)."""
  params = init_params(CFG, jax.random.key(3))
  batch = make_batch(params)
  width = 2 * (P + N)
  pk = packing.pack(batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, width)
  b = 1  # a short sequence: FFD puts it after a longer one in a shared row
  shared = [c for c in range(len(pk.len_B)) if c != b and pk.row_B[c] == pk.row_B[b]]
  assert shared, "the test needs sequence b to share its row"
  seq = np.asarray(batch.sequence_BT).copy()
  seq[b, P - 2:P] = (seq[b, P - 2:P] + 5) % CFG.vocab_size  # its prompt tokens
  pk2 = packing.pack(seq, batch.positions_BT, batch.segment_ids_BT, width)
  assert (pk2.row_B == pk.row_B).all() and (pk2.start_B == pk.start_B).all()
  a = packing.packed_logprobs(params, jax.tree.map(jnp.asarray, pk), P + N, N, CFG, 1.0)["logp_BT"]
  z = packing.packed_logprobs(params, jax.tree.map(jnp.asarray, pk2), P + N, N, CFG, 1.0)["logp_BT"]
  m = np.asarray(batch.mask_BN) > 0
  others = np.ones(len(m), bool)
  others[b] = False
  np.testing.assert_array_equal(np.asarray(a)[others][m[others]], np.asarray(z)[others][m[others]])
  assert np.abs(np.asarray(a)[b][m[b]] - np.asarray(z)[b][m[b]]).max() > 1e-4


def step_outputs(params, batch, loss="ppo_clip", **kw):
  step = learner.make_train_step(CFG, SGD, loss, **kw)
  state, m = step(learner.init_state(jax.tree.map(lambda x: jnp.array(x, copy=True), params), SGD), batch,
                  jax.random.key(0))
  return state.params, m


@pytest.mark.parametrize("kw", [dict(), dict(agg_mode="seq-mean-token-mean", entropy_coef=0.01),
                                dict(grad_accum=2, minibatches=2)])
def test_train_step_packed_equals_padded(kw):
  """Gradients (SGD(1): updated params) and metrics of ppo_clip on packed rows equal the padded step's; with
  micro-batches and minibatches each of the 4 chunks is packed on its own."""
  params = init_params(CFG, jax.random.key(4))
  batch = make_batch(params)
  chunks = kw.get("grad_accum", 1) * kw.get("minibatches", 1)
  want_p, want_m = step_outputs(params, batch, **kw)
  got_p, got_m = step_outputs(params, with_pack(batch, P + N + 3, chunks), **kw)
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(want_p), jax.tree.leaves(params))) > 1e-4
  assert_trees_close(got_p, want_p, atol=2e-6, rtol=1e-4)
  for k in ("loss", "grad_norm", "entropy", "kl_mu_k3"):
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-4, atol=1e-6)


def test_fused_reference_kl_packed_equals_padded():
  """A loss with KL to the reference (scored inside the step through the packed rows too) gives the padded update."""
  params = init_params(CFG, jax.random.key(6))
  ref_params = init_params(CFG, jax.random.key(7))
  batch = make_batch(params)
  score = learner.make_score_fn(CFG, 1.0)
  step = learner.fuse_reference(learner.make_train_step(CFG, SGD, "ppo_clip", kl_coef=0.5), score)
  init = lambda: learner.init_state(jax.tree.map(lambda x: jnp.array(x, copy=True), params), SGD)
  want = step(init(), batch, jax.random.key(0), ref_params)
  got = step(init(), with_pack(batch, 2 * (P + N)), jax.random.key(0), ref_params)
  assert float(want[1]["kl_ref"]) > 1e-3  # the reference differs: the KL term is live
  assert_trees_close(got[0].params, want[0].params, atol=2e-6, rtol=1e-4)
  for k in want[1]:
    np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-4, atol=1e-6, err_msg=k)
  pk = with_pack(batch, P + N).pack
  a = score(ref_params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, batch.mask_BN)
  b = score(ref_params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, batch.mask_BN, pack=pk)
  np.testing.assert_allclose(b, a, atol=2e-5)
  wrapped = packing.packing_scorer(score, P + N)
  np.testing.assert_allclose(wrapped(ref_params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT,
                                     batch.mask_BN), a, atol=2e-5)


def test_rows_of_several_segments_pack_exactly():
  """An evicted episode's row holds several segments (here ids 1, 2, 1 again, with positions restarting in
  segment 2): packed with other sequences, each of its segments gets an id of its own in the packed row (equal
  ids stay equal) and every scored token's log-prob equals the padded forward's."""
  params = init_params(CFG, jax.random.key(4))
  batch = make_batch(params)
  seg = np.asarray(batch.segment_ids_BT).copy()
  pos0 = np.asarray(batch.positions_BT)
  pos = pos0.copy()
  seg[0, P + 1:P + 4] = 2  # row 0: prompt + 1 token in segment 1, 3 tokens in segment 2, the rest in 1 again
  pos[0, P + 1:P + 4] = np.arange(3)
  seg[6, P:P + 3] = 3  # row 6: ids 1 and 3 (not consecutive)
  batch = batch.replace(segment_ids_BT=jnp.asarray(seg), positions_BT=jnp.asarray(pos))
  pk = packing.pack(np.asarray(batch.sequence_BT), pos, seg, 2 * (P + N))
  for b in (0, 6):
    r, s0, n = int(pk.row_B[b]), int(pk.start_B[b]), int(pk.len_B[b])
    own = pk.segment_ids_RW[r, s0:s0 + n]
    f = int(pk.first_B[b])
    want = seg[b, f:f + n]
    assert len(set(own[want > 0])) == len(set(want[want > 0]))  # distinct stay distinct, equal stay equal
    assert all(len(set(own[want == i])) == 1 for i in set(want[want > 0]))
    others = np.r_[pk.segment_ids_RW[r, :s0], pk.segment_ids_RW[r, s0 + n:]]
    assert not set(own[own > 0]) & set(others[others > 0])  # no other sequence shares its ids
  assert any(pk.row_B[c] == pk.row_B[0] for c in range(1, len(pk.row_B)))  # row 0 shares its packed row
  want = learner.completion_logprobs(params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, N, CFG,
                                     1.0)["logp_BT"]
  got = packing.packed_logprobs(params, jax.tree.map(jnp.asarray, pk), P + N, N, CFG, 1.0)["logp_BT"]
  m = np.asarray(batch.mask_BN) > 0
  np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], atol=2e-5, rtol=1e-5)
  single = learner.completion_logprobs(params, batch.sequence_BT, jnp.asarray(pos0),
                                       jnp.asarray((seg > 0).astype(np.int32)), N, CFG, 1.0)["logp_BT"]
  assert np.abs(np.asarray(single)[0][m[0]] - np.asarray(want)[0][m[0]]).max() > 1e-4  # the segments mattered


def run_config(pack_width, steps=3):
  from test_loop import tiny
  c = tiny(rollout__mode="fixed_lag", rollout__lag=2, optim__lr=0.01, optim__warmup_steps=0)
  c.loss.entropy_coef = 0.01
  c.eval.every, c.checkpoint.every, c.num_steps = 0, 1, steps
  c.optim.pack_width = pack_width
  return c


@pytest.mark.slow
def test_run_packed_equals_padded_and_resumes_exactly(tmp_path):
  """3 fixed_lag steps (π_old recomputed at generation through the packed scorer): packing on equals packing off
  in every metric (tolerance); a packed run stopped after 2 steps and resumed equals the
  uninterrupted packed run bitwise."""
  from jaxrl_llm import loop
  from test_loop import assert_learns, strip
  off = loop.run(run_config(0), str(tmp_path / "off"))
  on = loop.run(run_config(22), str(tmp_path / "on"))
  assert_learns(on)
  for a, b in zip(strip(off), strip(on)):
    assert a.keys() == b.keys()
    for k in a:
      if k == "learner_pad_frac":  # tiny's rows (T = 11) are nearly full; two fit in every packed row of 22
        assert b[k] <= a[k] < 0.1, (a[k], b[k])
      elif isinstance(a[k], float):
        np.testing.assert_allclose(b[k], a[k], rtol=1e-3, atol=1e-5, err_msg=k)
      else:
        assert a[k] == b[k], k
  d = str(tmp_path / "resumed")
  loop.run(run_config(22, steps=2), d)
  loop.run(run_config(22, steps=3), d)
  from jaxrl_llm.metrics import read_jsonl
  assert strip(read_jsonl(f"{d}/metrics.jsonl")) == strip(on)


@pytest.mark.parametrize("field,value,match", [
    ("loss.name", "alp", "ALP"), ("optim.pack_width", 1, "int >= 2")])
def test_unsupported_combinations_refused(field, value, match):
  from jaxrl_llm.config import ConfigError, validate
  c = run_config(22)
  sec, key = field.split(".")
  c[sec][key] = value
  with pytest.raises(ConfigError, match=f"optim.pack_width.*{match}"):
    validate(c)


@pytest.mark.parametrize("name,match", [("kv_window_smd_tiny", "shadow")])
def test_shipped_configs_refuse_packing_they_cannot_use(name, match):
  """SMD's shadow forward: a valid config that becomes an error with packing on."""
  import os
  from jaxrl_llm.config import ConfigError, load_file, validate
  c = load_file(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", f"{name}.py"))
  validate(c)
  c.optim.pack_width = 64
  with pytest.raises(ConfigError, match=f"optim.pack_width.*{match}"):
    validate(c)


def test_loop_pack_batch_attaches_one_packing_per_micro_batch():
  """`loop.pack_batch`: off, the batch is untouched and the padded pad fraction is reported; on, the packing has
  grad_accum · minibatches chunks and the packed rows' pad fraction."""
  from jaxrl_llm import loop
  from jaxrl_llm.record import Rollout
  params = init_params(CFG, jax.random.key(8))
  batch = make_batch(params)
  ro = Rollout(**{k: np.asarray(v) for k, v in batch.arrays().items()})
  seg = np.asarray(batch.segment_ids_BT)
  c = run_config(0)
  same, frac = loop.pack_batch(c, batch, ro)
  assert same is batch and frac == pytest.approx(1 - (seg > 0).mean())
  c.optim.pack_width, c.optim.grad_accum, c.optim.minibatches = P + N + 5, 2, 2  # each pair of rows fits one
  packed, frac = loop.pack_batch(c, batch, ro)
  pk = packed.pack
  assert pk.tokens_RW.shape[0] == 4 * pk.rows
  assert frac == pytest.approx(1 - (seg > 0).sum() / pk.tokens_RW.size) and frac < 1 - (seg > 0).mean()


def test_teacher_scores_packed_equal_padded():
  """The distillation teacher's scores (log-probs, top-k ids / log-probs / residual, gathered candidates, hidden
  states of its VocabHead) on packed rows equal the padded scorer's on every loss token."""
  from jaxrl_llm.distill import teacher
  params = init_params(CFG, jax.random.key(9))
  batch = with_pack(make_batch(params), P + N + 4)
  ids = jax.random.randint(jax.random.key(2), (*batch.mask_BN.shape, 2), 0, CFG.vocab_size)
  score = teacher.make_teacher_scorer(CFG, 0.8, topk=3, head=True)
  args = (params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, batch.mask_BN, ids)
  want, got = score(*args), score(*args, pack=batch.pack)
  m = np.asarray(batch.mask_BN) > 0
  for k in ("teacher_logp_BN", "teacher_topk_ids_BNk", "teacher_topk_logp_BNk", "teacher_topk_residual_logp_BN",
            "gathered_logp_BNk"):
    np.testing.assert_allclose(np.asarray(got[k])[m], np.asarray(want[k])[m], atol=2e-5, rtol=1e-5, err_msg=k)
  np.testing.assert_allclose(np.asarray(got["teacher_head"].hidden_BND)[m],
                             np.asarray(want["teacher_head"].hidden_BND)[m], atol=2e-5, rtol=1e-5)


def test_opd_batch_extras_packed_equal_padded(tmp_path):
  """The OPD loop's teacher extras (top-k KL fields) with `optim.pack_width` on equal those with it off."""
  from jaxrl_llm.distill import opd
  from jaxrl_llm.rollout import old_logp
  from jaxrl_llm.rollout.sources.common import sync_rollout
  from test_loop import fresh_run
  from test_opd_run import opd_tiny
  c = opd_tiny(tmp_path, rollout__mode="fixed_lag", rollout__lag=1, loss__name="opd_topk_kl")
  r, state, extra, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  seq, mask = old_logp.rollout_seq(ro), jnp.asarray(ro.mask_BN)
  want = r.batch_extras(ro, seq, mask)
  c.optim.pack_width = ro.sequence_BT.shape[1] + 3
  packed = opd.make_batch_extras(c, task=r.task, width=r.P, train_examples=r.train_examples, student_cfg=r.model_cfg,
                                 encoder=r.encoder)
  got = packed(ro, seq, mask)
  assert sorted(got) == sorted(want) and "teacher_topk_logp_BNk" in got
  m = np.asarray(mask) > 0
  assert m.any()
  for k in want:
    if k != "sup_drift_B":
      np.testing.assert_allclose(np.asarray(got[k])[m], np.asarray(want[k])[m], atol=2e-5, rtol=1e-5, err_msg=k)


def test_moe_routes_travel_with_their_tokens():
  """`pack(routes_BTLk=...)`: every real token's expert ids land where the token lands."""
  rng = np.random.default_rng(0)
  B, T, L, k = 6, 9, 2, 2
  seg = (np.arange(T)[None, :] >= rng.integers(1, 4, B)[:, None]).astype(np.int32)
  seq = rng.integers(1, 30, (B, T)).astype(np.int32) * seg
  pos = np.maximum(np.cumsum(seg, 1) - 1, 0).astype(np.int32)
  routes = rng.integers(0, 4, (B, T, L, k)).astype(np.int32)
  pk = packing.pack(seq, pos, seg, 2 * T, routes_BTLk=routes)
  for b in range(B):
    r, s, f, n = int(pk.row_B[b]), int(pk.start_B[b]), int(pk.first_B[b]), int(pk.len_B[b])
    np.testing.assert_array_equal(pk.routes_RWLk[r, s:s + n], routes[b, f:f + n])
    np.testing.assert_array_equal(pk.tokens_RW[r, s:s + n], seq[b, f:f + n])


@pytest.mark.slow
def test_moe_run_packed_equals_padded(tmp_path):
  """configs/moe_tiny.py at fixed lag 1 with routing replay: packed and padded runs agree (the loss to rounding;
  the gradient to the load-balancing term, whose token set differs in row-final tokens), and π_old recomputed on
  the packed rows with the replayed routes equals μ."""
  import os
  from jaxrl_llm import loop
  from jaxrl_llm.config import load_file
  def cfg(w):
    c = load_file(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "moe_tiny.py"))
    c.log.tensorboard, c.checkpoint.every, c.eval.every, c.num_steps, c.sft.steps = False, 0, 0, 2, 20
    c.rollout.mode, c.rollout.lag, c.loss.entropy_coef, c.optim.pack_width = "fixed_lag", 1, 0.01, w
    return c
  off, on = loop.run(cfg(0), str(tmp_path / "off")), loop.run(cfg(64), str(tmp_path / "on"))
  for a, b in zip(off, on):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=2e-3)
    assert b["mismatch_abs_max"] < 1e-5 and b["grad_norm"] > 0
