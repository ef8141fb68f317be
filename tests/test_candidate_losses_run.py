"""dppo_topk, opd_reverse_kl_mc and s2d_opd run from their configs: the sampler records μ's top-k / Monte-Carlo
candidates, the teachers score them at batch-building time, the learner gathers the student at them."""

import math
import os

import jax
import numpy as np
import pytest

from jaxrl_llm import config as config_lib, loop, loss_configs, wiring
from jaxrl_llm.config import load_file
from jaxrl_llm.distill import opd, teacher as teacher_lib
from jaxrl_llm.rollout.sources.common import sync_rollout
from jaxrl_llm.tasks import tokenizer as tok
from test_loop import fresh_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
  return tmp_path_factory.mktemp("teachers")


def load(name, cache=None, **over):
  c = load_file(os.path.join(ROOT, "configs", f"{name}.py"))
  c.log.tensorboard = c.log.progress = False
  c.checkpoint.every, c.eval.every, c.num_steps = 0, 0, 2
  if cache is not None:  # plumbing needs teachers, not good ones (cached for the module)
    c.distill.teacher_cache_dir = str(cache)
    c.distill.teacher_sft_steps = 20
    if c.distill.ref_teacher == "sft":
      c.distill.ref_teacher_sft_steps = 10
  for k, v in over.items():
    sec, key = k.split("__")
    c[sec][key] = v
  return c


def check_rows(rows, *metrics):
  assert [r["step"] for r in rows] == list(range(len(rows)))
  assert not any(r["update_skipped"] for r in rows)
  for r in rows:
    for k in ("loss", "grad_norm") + metrics:
      assert math.isfinite(r[k]), (k, r[k])
    assert r["grad_norm"] > 0


def test_each_loss_names_its_config():
  assert loss_configs.config_for("dppo_topk") == "dppo_topk_tiny.py"
  assert loss_configs.config_for("opd_reverse_kl_mc") == "opd_mc_tiny.py"
  assert loss_configs.config_for("s2d_opd") == "opd_s2d_tiny.py"
  for name in ("dppo_topk", "opd_mc_tiny", "opd_s2d_tiny"):
    config_lib.validate(load(name if name != "dppo_topk" else "dppo_topk_tiny"))


def test_dppo_topk_on_policy_divergence_is_zero(tmp_path):
  rows = loop.run(load("dppo_topk_tiny"), str(tmp_path))
  check_rows(rows, "divergence", "mask_frac")
  # Lag 0, a float32 sampler: μ is π_θ, so the top-K TV between them is rounding (the learner's top-K gather
  # at μ's ids against the sampler's record) and nothing is masked.
  assert all(r["divergence"] < 1e-5 and r["divergence_max"] < 1e-4 and r["mask_frac"] == 0 for r in rows), rows


def test_dppo_topk_off_policy_divergence_is_positive(tmp_path):
  c = load("dppo_topk_tiny", rollout__mode="fixed_lag", rollout__lag=1, optim__lr=3e-2, optim__warmup_steps=0)
  rows = loop.run(c, str(tmp_path))
  check_rows(rows, "divergence")
  assert rows[1]["lag_mean"] == 1 and rows[1]["divergence"] > 1e-3, rows[1]


def test_mc_trains_from_its_config(teachers, tmp_path):
  rows = loop.run(load("opd_mc_tiny", teachers), str(tmp_path))
  check_rows(rows, "mc_adv")
  for r in rows:
    assert r["mc_valid"] == 1.0 and r["mc_col0_match"] == 1.0
    assert abs(r["ratio_max"] - 1.0) < 1e-4  # on-policy: π_θ = μ at every candidate
    assert r["loss"] == pytest.approx(-r["mc_adv"], rel=1e-4, abs=1e-6)  # ratio 1: the surrogate is −A


def test_s2d_trains_from_its_config(teachers, tmp_path):
  c = load("opd_s2d_tiny", teachers, optim__lr=1e-2, optim__warmup_steps=0)
  rows = loop.run(c, str(tmp_path))
  check_rows(rows, "direct_reward", "jsd_k1", "kl_anchor")
  assert rows[0]["alpha"] == pytest.approx(2.5)  # alpha0
  assert rows[1]["alpha"] in (pytest.approx(2.475), pytest.approx(2.5))  # one adaptive step (clipped at alpha_max)
  assert rows[0]["kl_anchor"] == pytest.approx(0.0, abs=1e-6)  # the student is still its frozen initial copy
  assert rows[1]["kl_anchor"] > 0  # ...and has moved from it after one update (ref_logp_BN is scored)
  assert all(0 < r["keep_frac"] <= 1 for r in rows)
  assert all(r["jsd_k1"] > 0 for r in rows)  # teacher and reference teacher differ


def _teacher_logp(c, r, role, batch):
  """Independent: log_softmax(teacher logits / T) over the full vocabulary at every completion position."""
  cfg, params = teacher_lib.load_teacher(c, r.P, r.train_examples, tok.vocab_size, role=role)
  logits = teacher_lib.teacher_logits(params, cfg, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT,
                                      batch.mask_BN.shape[1])
  return np.asarray(jax.nn.log_softmax(logits / opd.scoring_temperature(c), axis=-1))


def _at(lp_BNV, ids_BNk):
  return np.take_along_axis(lp_BNV, np.asarray(ids_BNk), axis=-1)


def test_batch_extras_are_the_teachers_at_the_recorded_candidates(teachers):
  c = load("opd_s2d_tiny", teachers)
  c.sampler.mc_samples = 3  # both candidate sets in one teacher forward (the MC loss would read the second)
  c.loss.name = "s2d_opd"
  r, state, extra, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  assert ro.behavior_topk_ids_BNk.shape[-1] == 16 and ro.mc_ids_BNJ.shape[-1] == 3
  batch, _ = loop.make_batch(r, store, state, extra, ro)
  m = np.asarray(batch.mask_BN) > 0
  ex = batch.extra
  assert {"teacher_topk_ids_BNk", "teacher_topk_logp_BNk", "teacher_ref_topk_logp_BNk"} <= set(ex)
  np.testing.assert_array_equal(np.asarray(ex["teacher_topk_ids_BNk"]), ro.behavior_topk_ids_BNk)  # student's top-K
  lp = _teacher_logp(c, r, "teacher", batch)
  np.testing.assert_allclose(np.asarray(ex["teacher_topk_logp_BNk"])[m], _at(lp, ro.behavior_topk_ids_BNk)[m],
                             atol=2e-5)
  ref = _teacher_logp(c, r, "ref_teacher", batch)
  np.testing.assert_allclose(np.asarray(ex["teacher_ref_topk_logp_BNk"])[m], _at(ref, ro.behavior_topk_ids_BNk)[m],
                             atol=2e-5)
  assert np.abs(lp - ref)[m].max() > 1e-2  # two different teachers
  # The MC loss's teacher field from the same forward.
  c.loss.name = "opd_reverse_kl_mc"
  r, state, extra, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  batch, _ = loop.make_batch(r, store, state, extra, ro)
  assert sorted(batch.extra) == ["mc_teacher_logp_BNJ"]
  np.testing.assert_allclose(np.asarray(batch.extra["mc_teacher_logp_BNJ"])[m], _at(lp, ro.mc_ids_BNJ)[m], atol=2e-5)
  np.testing.assert_array_equal(np.asarray(batch.mc_ids_BNJ), ro.mc_ids_BNJ)  # the learner reads the record's


def test_needs_are_provided_only_when_their_producer_is_on():
  c = load("tiny", loss__name="dppo_topk")
  with pytest.raises(config_lib.ConfigError, match=r"config\.loss\.name='dppo_topk'.*behavior_topk"):
    config_lib.validate(c)
  c.sampler.behavior_topk = 4
  config_lib.validate(c)
  c = load("opd_tiny", loss__name="opd_reverse_kl_mc")
  with pytest.raises(config_lib.ConfigError, match=r"needs \['mc'\]"):
    config_lib.validate(c)
  c.sampler.mc_samples = 2
  config_lib.validate(c)
  c = load("opd_tiny", loss__name="s2d_opd")
  c.sampler.behavior_topk = 8  # candidates recorded, but no reference teacher
  with pytest.raises(config_lib.ConfigError, match=r"needs \['teacher_ref_topk'\]"):
    config_lib.validate(c)
  c.distill.ref_teacher, c.sampler.behavior_topk = "sft", 0  # a reference teacher, but no candidates
  with pytest.raises(config_lib.ConfigError, match=r"needs \['teacher_ref_topk'\]"):
    config_lib.validate(c)
  c.sampler.behavior_topk = 8
  config_lib.validate(c)


def test_partial_rollouts_take_the_records():
  """Partial rollouts record μ's candidates (tests/test_partial_rollout.py checks them against `generate`)."""
  config_lib.validate(load("opd_mc_tiny", rollout__mode="async", rollout__partial_chunk=2))


def test_ref_teacher_fields_are_validated():
  c = load("opd_s2d_tiny")
  opd.validate(c)
  c.distill.ref_teacher_sft_steps = 0
  with pytest.raises(config_lib.ConfigError, match=r"config\.distill\.ref_teacher_sft_steps=0"):
    opd.validate(c)
  c = load("opd_s2d_tiny")
  del c.distill["ref_teacher_n_layers"]
  with pytest.raises(config_lib.ConfigError, match=r"config\.distill\.ref_teacher_n_layers: missing"):
    opd.validate(c)
  c = load("opd_s2d_tiny")
  c.distill.ref_teacher = "/nonexistent/folder"
  with pytest.raises(config_lib.ConfigError, match=r"config\.distill\.ref_teacher='/nonexistent/folder'"):
    teacher_lib.load_teacher(c, 8, [], tok.vocab_size, role="ref_teacher")


def test_sampler_config_carries_the_record_options_except_when_greedy():
  c = load("opd_s2d_tiny")
  c.sampler.mc_samples = 3
  sc = wiring.sampler_config(c)
  assert (sc.behavior_topk, sc.mc_samples) == (16, 3)
  greedy = wiring.sampler_config(c, greedy=True)
  assert (greedy.behavior_topk, greedy.mc_samples) == (0, 0)
  c = load("tiny")
  assert (wiring.sampler_config(c).behavior_topk, wiring.sampler_config(c).mc_samples) == (0, 0)
  del c.sampler["behavior_topk"], c.sampler["mc_samples"]  # a config written before the fields: off
  config_lib.validate(c)
  assert wiring.sampler_config(c) == wiring.sampler_config(load("tiny"))


def test_ref_teacher_cache_key_differs_from_the_teacher_unless_equal():
  c = load("opd_s2d_tiny")
  key = lambda role: teacher_lib.cache_key(c, 8, tok.vocab_size, role=role)
  assert key("teacher") != key("ref_teacher")
  c.distill.ref_teacher_sft_steps = c.distill.teacher_sft_steps
  assert key("teacher") == key("ref_teacher")  # the same model: one cached folder
