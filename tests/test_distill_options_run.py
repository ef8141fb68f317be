"""ADWIN horizons, Open-MOPD teachers and the teacher cache through the real pieces: tiny SFT teachers, the
loop's `make_batch`, and 2-step runs of configs/opd_adwin_tiny.py, opd_mopd_tiny.py and opd_topk_cache_tiny.py."""

import collections
import math
import os

import numpy as np
import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import load_file
from jaxrl_llm.distill import extras as extras_lib
from jaxrl_llm.distill import mopd
from jaxrl_llm.distill import teacher as teacher_lib
from jaxrl_llm.distill.opd import scoring_temperature
from jaxrl_llm.record import concat, rows
from jaxrl_llm.rollout.sources.common import sync_rollout
from jaxrl_llm.tasks import tokenizer as tok
from test_loop import fresh_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCORES = ("teacher_logp_BN", "teacher_topk_ids_BNk", "teacher_topk_logp_BNk", "teacher_topk_residual_logp_BN")


def config(name, cache_dir, steps=2):
  c = load_file(os.path.join(ROOT, "configs", f"{name}.py"))
  c.log.tensorboard = False
  c.checkpoint.every = 0
  c.eval.every = 0
  c.num_steps = steps
  c.distill.teacher_cache_dir = str(cache_dir)
  c.distill.teacher_sft_steps = 20  # plumbing tests need teachers, not good ones
  for spec in c.distill.get("teachers") or ():
    spec.teacher_sft_steps = 20
  return c


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("teachers")


def full_scores(c, spec, r, ro):
  """An independent scoring of the whole rollout by one teacher (`spec`: a distill.teachers entry, or {})."""
  ci = extras_lib.teacher_config(c, spec) if spec else c
  cfg, params = teacher_lib.load_teacher(ci, r.P, r.train_examples, tok.vocab_size)
  score = teacher_lib.make_teacher_scorer(cfg, scoring_temperature(c), c.distill.topk, group_size=c.rollout.group_size)
  return {f: np.asarray(v) for f, v in score(params, ro.sequence_BT, ro.positions_BT, ro.segment_ids_BT,
                                              ro.mask_BN).items()}


def test_adwin_batch_trains_on_the_first_h_tokens(cache):
  c = config("opd_adwin_tiny", cache)
  r, state, extra, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  batch, info = loop.make_batch(r, store, state, extra, ro)
  H = c.distill.adwin.h_init
  m = np.asarray(ro.mask_BN) > 0
  want = m & (np.cumsum(m, axis=1) <= H)  # the first H counted tokens of each row
  assert want.sum() < m.sum()  # some row is longer than H: the prefix cuts
  np.testing.assert_array_equal(np.asarray(batch.mask_BN), want.astype(np.float32))
  assert not np.asarray(batch.adv_BN)[~want].any()
  assert info["adwin_horizon"] == H and info["adwin_kept_frac"] == pytest.approx(want.sum() / m.sum())
  # Step 0 probes the full-length rows: the share of |log p − log μ| inside the first H tokens.
  t = full_scores(c, {}, r, ro)
  sig = np.where(m, np.abs(t["teacher_logp_BN"] - np.asarray(ro.behavior_logp_BN)), 0.0)
  assert info["adwin_agreement"] == pytest.approx(sig[want].sum() / sig.sum(), rel=1e-5)
  np.testing.assert_allclose(np.asarray(batch.extra["teacher_logp_BN"]), t["teacher_logp_BN"], rtol=0, atol=1e-6)
  a = c.distill.adwin
  nxt = math.floor(H * a.gamma_down) if info["adwin_agreement"] >= a.tau else math.ceil(H * a.gamma_up)
  assert r.batch_extras.state()["adwin"] == {"horizon": min(max(nxt, a.h_min), a.h_max), "last_probe_step": 0}


def test_mopd_rows_take_their_domain_teachers_scores(cache):
  c = config("opd_mopd_tiny", cache)
  r, state, extra, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  batch, info = loop.make_batch(r, store, state, extra, ro)
  # Independently: the example of each row's prompt text (the first with that text), example_id % 2.
  G, n = c.rollout.group_size, c.rollout.prompts_per_step
  step = r.ctx.gen.step_prompts([0], n, G)
  first = {}
  for i in range(len(r.train_examples)):
    first.setdefault(r.train_examples[i]["prompt"], r.train_examples[i]["example_id"] % 2)
  domain_B = np.array([first[ex["prompt"]] for ex in step.examples])
  assert 0 < domain_B.sum() < len(domain_B)  # both teachers have rows in this batch
  per = [full_scores(c, dict(spec), r, ro) for spec in c.distill.teachers]
  m = np.asarray(ro.mask_BN) > 0
  routed = {f: np.asarray(mopd.route(domain_B, np.stack([p[f] for p in per]))) for f in SCORES}
  # ppo_clip reads no teacher field: the routed reward is the advantage, weighted per row by M1 x M2.
  reward = np.where(m, routed["teacher_logp_BN"] - np.asarray(ro.behavior_logp_BN), 0.0)
  ntok = m.sum(1)
  w = mopd.domain_loss_weights(domain_B, ntok, c.distill.mopd.target_share)  # M2's first factor is 1 (anchored)
  np.testing.assert_allclose(np.asarray(batch.adv_BN), w[:, None] * reward, rtol=1e-5, atol=1e-5)
  assert info["mopd_weight_0"] == pytest.approx(w[domain_B == 0].mean(), rel=1e-6)
  assert info["mopd_token_share_1"] == pytest.approx(ntok[domain_B == 1].sum() / ntok.sum())
  # M0 alone with a top-k OPD loss: the routed top-k fields themselves.
  c.loss.name, c.distill.mopd.token_share, c.distill.mopd.gap_follow = "opd_topk_kl", False, False
  c.distill.mopd.reward_advantage = False
  r, state, extra, store = fresh_run(c)
  batch, _ = loop.make_batch(r, store, state, extra, ro)
  np.testing.assert_array_equal(np.asarray(batch.extra["teacher_topk_ids_BNk"]), routed["teacher_topk_ids_BNk"])
  np.testing.assert_allclose(np.asarray(batch.extra["teacher_topk_logp_BNk"]), routed["teacher_topk_logp_BNk"],
                             rtol=0, atol=1e-5)
  assert not np.allclose(per[0]["teacher_topk_logp_BNk"], per[1]["teacher_topk_logp_BNk"])  # two different teachers


def test_cached_batches_equal_fresh_scores_and_each_row_is_scored_once(cache):
  c = config("opd_topk_cache_tiny", cache)
  r, state, extra, store = fresh_run(c)
  ex = r.batch_extras
  calls = collections.Counter()
  score = ex.teachers[0].score

  def counting(params, seq, pos, seg, mask):
    for row, live in zip(np.asarray(seq), np.asarray(mask) > 0):
      if live.any():
        calls[row.tobytes()] += 1
    return score(params, seq, pos, seg, mask)

  ex.teachers[0].score = counting
  a = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  b = sync_rollout(r.ctx, store, [1], 0, 0)[0]
  G = c.rollout.group_size
  mixed = concat([rows(a, 2 * G, 3 * G), rows(b, 0, G), rows(a, 0, G), rows(b, G, 2 * G)])  # replay-like
  served = {}
  for name, ro, hits in (("a", a, 0), ("mixed", mixed, 2 * G), ("a again", a, 4 * G)):
    batch, info = loop.make_batch(r, store, state, extra, ro)
    assert info["topk_cache_hits"] == hits and info["topk_cache_misses"] == 4 * G - hits, name
    want = full_scores(c, {}, r, ro)
    for f in ("teacher_topk_ids_BNk", "teacher_topk_logp_BNk"):
      np.testing.assert_allclose(np.asarray(batch.extra[f]), want[f], rtol=0, atol=1e-5, err_msg=f"{name} {f}")
    served[name] = {f: np.asarray(v) for f, v in batch.extra.items()}
  for f in served["a"]:  # served from the cache: the very numbers scored the first time
    np.testing.assert_array_equal(served["mixed"][f][2 * G:3 * G], served["a"][f][:G])
    np.testing.assert_array_equal(served["a again"][f], served["a"][f])
  assert len(calls) == 6 * G and set(calls.values()) == {1}  # 6 distinct groups, every row scored once


@pytest.mark.parametrize("name,metrics", [
    ("opd_adwin_tiny", ("adwin_horizon", "adwin_kept_frac")),
    ("opd_mopd_tiny", ("mopd_weight_0", "mopd_token_share_0", "mopd_gap_factor_1")),
    ("opd_topk_cache_tiny", ("topk_cache_hits", "topk_cache_misses", "kl_topk")),
])
def test_option_config_trains_two_steps(cache, tmp_path, name, metrics):
  c = config(name, cache)
  out = loop.run(c, str(tmp_path / name))
  assert len(out) == 2 and not any(row["update_skipped"] for row in out)
  for row in out:
    for k in ("loss", "grad_norm") + metrics:
      assert k in row and math.isfinite(row[k]), (k, row.get(k))
    assert row["grad_norm"] > 0
  if name == "opd_adwin_tiny":  # step 0 trains on h_init and probes; step 1 on the horizon its probe set
    a = c.distill.adwin
    assert out[0]["adwin_horizon"] == a.h_init and "adwin_agreement" not in out[1]
    grow = out[0]["adwin_agreement"] < a.tau
    assert out[1]["adwin_horizon"] == (min(math.ceil(a.h_init * a.gamma_up), a.h_max) if grow else
                                       max(math.floor(a.h_init * a.gamma_down), a.h_min))
  if name == "opd_topk_cache_tiny":  # step 1 replays groups of step 0: served from the cache
    assert out[0]["topk_cache_hits"] == 0 and out[1]["topk_cache_hits"] > 0


def test_adwin_and_mopd_state_resumes_exactly(cache, tmp_path):
  """The ADWIN horizon / probe schedule and the M2 references are checkpointed with the run (`state()` in the
  host data): a run cut at step 3 and resumed writes the metrics of the uninterrupted one."""
  from test_loop import strip
  from jaxrl_llm.metrics import read_jsonl
  for name in ("opd_adwin_tiny", "opd_mopd_tiny"):
    def c(steps):
      x = config(name, cache, steps=steps)
      x.checkpoint.every = 1
      return x
    loop.run(c(5), str(tmp_path / name / "a"))
    loop.run(c(3), str(tmp_path / name / "b"))
    loop.run(c(5), str(tmp_path / name / "b"))
    a, b = (strip(read_jsonl(str(tmp_path / name / x / "metrics.jsonl"))) for x in "ab")
    assert len(a) == 5 and a == b, name
    if name == "opd_adwin_tiny":  # the horizon moved before the cut: a restart from h_init would differ
      assert len({r["adwin_horizon"] for r in a[:4]}) > 1, [r["adwin_horizon"] for r in a]
