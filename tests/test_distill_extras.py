"""The distillation options' wiring (`distill.extras`) on hand-made batches with fake teachers: golden values."""

import collections

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.config import ConfigError
from jaxrl_llm.distill import extras as extras_lib
from jaxrl_llm.distill import opd
from jaxrl_llm.distill.topk_cache import RowCache
from jaxrl_llm.record import Rollout
from jaxrl_llm.types import LossInputs
from test_opd_run import opd_tiny

K = 3


def fake_teacher(y: int, calls=None):
  """A deterministic 'teacher' y: scores are functions of the row's tokens; `calls` counts the live rows it scored."""

  def score(params, sequence_BT, positions_BT, segment_ids_BT, mask_BN):
    del params, positions_BT, segment_ids_BT
    mask = np.asarray(mask_BN) > 0
    N = mask.shape[1]
    tok = np.asarray(sequence_BT)[:, -N:].astype(np.float32)
    if calls is not None:
      for row, m in zip(np.asarray(sequence_BT), mask):
        if m.any():
          calls[(y, row.tobytes())] += 1
    logp = -(y + 1) * 0.1 * (1.0 + tok)
    ids = (np.asarray(sequence_BT)[:, -N:, None] + y + np.arange(K)) % 50
    f32 = lambda x: np.asarray(x, np.float32)
    return {"teacher_logp_BN": f32(np.where(mask, logp, 0.0)),
            "teacher_topk_ids_BNk": np.where(mask[..., None], ids, 0).astype(np.int32),
            "teacher_topk_logp_BNk": f32(np.where(mask[..., None], logp[..., None] - np.arange(K), 0)),
            "teacher_topk_residual_logp_BN": f32(np.where(mask, -5.0 - y, 0.0))}

  return extras_lib.Teacher(None, score)


def rollout(tokens_BN, mask_BN, behavior_BN=None, lag=0, P=2):
  B, N = np.shape(mask_BN)
  seq = np.concatenate([np.full((B, P), 1, np.int32), np.asarray(tokens_BN, np.int32)], axis=1)
  return Rollout(sequence_BT=seq, positions_BT=np.tile(np.arange(P + N, dtype=np.int32), (B, 1)),
                 segment_ids_BT=np.ones_like(seq), mask_BN=np.asarray(mask_BN, np.float32),
                 behavior_logp_BN=np.zeros((B, N), np.float32) if behavior_BN is None else np.asarray(behavior_BN,
                                                                                                      np.float32),
                 versions_BN=np.zeros((B, N), np.int32), lag_B=np.full((B,), lag, np.int32))


def call(ex, ro):
  seq = tuple(np.asarray(x) for x in (ro.sequence_BT, ro.positions_BT, ro.segment_ids_BT))
  out = ex(ro, seq, jnp.asarray(ro.mask_BN))
  return out, out.pop("_batch")


ADWIN = {**extras_lib.ADWIN_DEFAULTS, "enabled": True, "h_init": 2, "h_min": 1, "h_max": 5, "gamma_down": 0.8,
         "gamma_up": 1.5, "tau": 0.8, "probe_period": 3, "max_probe_age": 2}
MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
# |log p − log μ| per token (μ: log-prob 0): the same numbers as the `adwin.kl_mass_alignment` unit test
SIGNAL = np.array([[1.0, 1.0, 1.0, 1.0, 0.0], [2.0, 0.0, 2.0, 7.0, 7.0]])


def adwin_extras(**over):
  teacher = extras_lib.Teacher(None, lambda p, s, q, g, m: {
      "teacher_logp_BN": jnp.where(jnp.asarray(m) > 0, -jnp.asarray(SIGNAL), 0.0)})
  return extras_lib.DistillExtras([teacher], ("teacher_logp_BN",), 1, K, adwin={**ADWIN, **over})


def test_adwin_trains_on_the_prefix_and_a_probe_moves_the_next_horizon():
  ex = adwin_extras()
  ro = rollout(np.zeros((2, 5)), MASK)
  out, b = call(ex, ro)  # step 0: H = h_init = 2, and a probe: agreement = mass in the first 2 tokens (1+1 + 2+0) / 8
  np.testing.assert_array_equal(np.asarray(b["mask_BN"]), [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]])
  assert b["info"]["adwin_horizon"] == 2 and b["info"]["adwin_kept_frac"] == 0.5
  assert b["info"]["adwin_agreement"] == pytest.approx(0.5)  # < τ = 0.8: H ← ceil(2 · 1.5) = 3
  np.testing.assert_array_equal(np.asarray(out["teacher_logp_BN"]), np.where(np.asarray(MASK) > 0, -SIGNAL, 0))
  _, b = call(ex, ro)  # step 1: no probe (period 3)
  assert b["info"]["adwin_horizon"] == 3 and "adwin_agreement" not in b["info"]
  np.testing.assert_array_equal(np.asarray(b["mask_BN"]), [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
  call(ex, ro)
  stale = rollout(np.zeros((2, 5)), MASK, lag=3)  # step 3 probes, but its rows are 3 > max_probe_age = 2 versions old
  _, b = call(ex, stale)
  assert b["info"]["adwin_agreement"] == pytest.approx(7 / 8) and b["info"]["adwin_probe_age"] == 3
  assert ex.state() == {"step": 4, "gap_ref": [None], "adwin": {"horizon": 3, "last_probe_step": 3}}
  fresh = rollout(np.zeros((2, 5)), MASK, lag=2)
  again = adwin_extras()
  again.restore(ex.state())
  for e in (ex, again):  # step 4: horizon unchanged by the stale probe; a restored copy continues the same
    _, b = call(e, fresh)
    assert b["info"]["adwin_horizon"] == 3 and "adwin_agreement" not in b["info"]
  for _ in range(2):  # step 6 probes a 2-version-old batch (counts): 7/8 ≥ τ shrinks H to floor(3 · 0.8) = 2
    outs = [call(e, fresh)[1] for e in (ex, again)]
  assert outs[0]["info"] == outs[1]["info"] and outs[0]["info"]["adwin_agreement"] == pytest.approx(7 / 8)
  assert ex.adwin_state.horizon == again.adwin_state.horizon == 2


def test_adwin_teacher_anchored_cut():
  ex = adwin_extras(h_init=4, anchor_threshold=1.5)  # reverse KL log μ − log p = SIGNAL: row 1 exceeds at token 1
  _, b = call(ex, rollout(np.zeros((2, 5)), MASK))
  np.testing.assert_array_equal(np.asarray(b["mask_BN"]), [[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])


def mopd_extras(mopd):
  return extras_lib.DistillExtras([fake_teacher(0), fake_teacher(1)],
                                  ("teacher_logp_BN", "teacher_topk_ids_BNk", "teacher_topk_logp_BNk"), 1, K,
                                  domains=lambda seq: np.array([0, 0, 1, 1], np.int32), mopd=mopd)


TOKENS = np.arange(4 * 4).reshape(4, 4) % 7 + 3
MOPD_MASK = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]  # 8 tokens in domain 0, 4 in domain 1


def test_mopd_routes_each_row_to_its_domains_teacher():
  ex = mopd_extras({**extras_lib.MOPD_DEFAULTS})
  ro = rollout(TOKENS, MOPD_MASK)
  out, b = call(ex, ro)
  seq = (ro.sequence_BT, ro.positions_BT, ro.segment_ids_BT, ro.mask_BN)
  want = [fake_teacher(y).score(None, *seq) for y in (0, 1)]
  for f in ("teacher_logp_BN", "teacher_topk_ids_BNk", "teacher_topk_logp_BNk"):
    np.testing.assert_array_equal(out[f][:2], want[0][f][:2])
    np.testing.assert_array_equal(out[f][2:], want[1][f][2:])
  assert "adv_BN" not in b  # M0 alone: the loss reads the routed teacher, the advantage stays the task's
  assert b["info"]["mopd_token_share_0"] == pytest.approx(8 / 12) and b["info"]["mopd_weight_1"] == 1.0


def test_mopd_token_share_and_gap_weights_multiply_the_teacher_reward_advantage():
  m = {**extras_lib.MOPD_DEFAULTS, "token_share": True, "target_share": (0.7, 0.3), "gap_follow": True,
       "reward_advantage": True}
  ex = mopd_extras(m)
  ro = rollout(TOKENS, MOPD_MASK)
  out, b = call(ex, ro)
  # o = (8/12, 4/12), g* = (0.7, 0.3): w = g*/o = (1.05, 0.9); Σ ntok·w = 8·1.05 + 4·0.9 = 12 (mean 1 already);
  # M2 anchors its reference at this first magnitude: factor 1.
  w = np.array([1.05, 1.05, 0.9, 0.9])
  r = np.where(np.asarray(MOPD_MASK) > 0, out["teacher_logp_BN"], 0.0)  # log p_d − log μ with log μ = 0
  np.testing.assert_allclose(np.asarray(b["adv_BN"]), w[:, None] * r, rtol=1e-6)
  assert b["info"]["mopd_weight_0"] == pytest.approx(1.05) and b["info"]["mopd_gap_factor_0"] == 1.0
  # Next batch: domain 0's mean |r| doubles, domain 1's is unchanged.
  mag0 = np.abs(r[:2][np.asarray(MOPD_MASK)[:2] > 0]).mean()
  behavior = np.zeros((4, 4), np.float32)
  behavior[:2] = mag0  # |log p − log μ| = |r| + mag0 on domain 0's tokens (r < 0): its mean doubles
  _, b = call(ex, rollout(TOKENS, MOPD_MASK, behavior))
  assert b["info"]["mopd_gap_factor_0"] == pytest.approx(2.0) and b["info"]["mopd_gap_factor_1"] == pytest.approx(1.0)
  # w ∝ (1.05·2, 0.9), rescaled to Σ ntok·w = 12: 12 / (8·2.1 + 4·0.9) = 12 / 20.4
  w2 = np.array([2.1, 2.1, 0.9, 0.9]) * 12 / 20.4
  r2 = np.where(np.asarray(MOPD_MASK) > 0, out["teacher_logp_BN"] - behavior, 0.0)
  np.testing.assert_allclose(np.asarray(b["adv_BN"]), w2[:, None] * r2, rtol=1e-5)
  mag1 = np.abs(r[2:][np.asarray(MOPD_MASK)[2:] > 0]).mean()
  assert ex.state()["gap_ref"] == [pytest.approx(mag0), pytest.approx(mag1)]  # anchored at the first magnitudes


def test_mopd_gap_reference_ema_follows_the_earlier_steps():
  m = {**extras_lib.MOPD_DEFAULTS, "gap_follow": True, "gap_reference": "ema", "gap_decay": 0.75,
       "reward_advantage": True}
  ex = mopd_extras(m)
  call(ex, rollout(TOKENS, MOPD_MASK))
  mag0 = ex.gap_ref[0]
  behavior = np.zeros((4, 4), np.float32)
  behavior[:2] = mag0  # domain 0's mean |r| doubles
  for factor, ref in ((2.0, 0.75 * mag0 + 0.25 * 2 * mag0), (2 * mag0 / (1.25 * mag0), None)):
    _, b = call(ex, rollout(TOKENS, MOPD_MASK, behavior))
    assert b["info"]["mopd_gap_factor_0"] == pytest.approx(factor)
    assert b["info"]["mopd_gap_factor_1"] == pytest.approx(1)
    if ref is not None:
      assert ex.gap_ref[0] == pytest.approx(ref)


def test_ppo_clip_on_the_teacher_reward_is_opd_reverse_kl():
  """`mopd.reward_advantage` + ppo_clip with weight 1 is opd_reverse_kl's advantage form, token by token."""
  rng = np.random.default_rng(0)
  logp, prox, teacher = (jnp.asarray(rng.normal(-2, 0.5, (3, 5)), jnp.float32) for _ in range(3))
  mask = jnp.asarray(rng.random((3, 5)) > 0.3, jnp.float32)
  base = LossInputs(logp_BN=logp, mask_BN=mask, adv_BN=jnp.zeros((3, 5)), prox_logp_BN=prox, behavior_logp_BN=prox,
                    teacher_logp_BN=teacher)
  spec_opd, spec_ppo = losses.get("opd_reverse_kl"), losses.get("ppo_clip")
  want, _ = spec_opd.fn(base, losses.make_hparams(spec_opd))
  got, _ = spec_ppo.fn(base.replace(adv_BN=jnp.where(mask > 0, teacher - prox, 0.0)), losses.make_hparams(spec_ppo))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_cached_rows_are_scored_once_and_served_equal():
  """Rows seen before are served from the cache (keyed by content and teacher), equal to scoring them again;
  every live row is scored once, by its own domain's teacher; wholly masked groups are never scored."""
  rng = np.random.default_rng(0)
  groups = {name: (rng.integers(3, 50, (2, 3)), d) for name, d in
            [("A0", 0), ("A1", 1), ("A2", 0), ("A3", 1), ("B0", 0), ("B1", 1), ("C0", 1), ("C1", 1), ("C2", 1)]}
  dom_of = {np.asarray(t[j], np.int32).tobytes(): d for t, d in groups.values() for j in range(2)}
  domains = lambda seq: np.array([dom_of[np.asarray(r[-3:], np.int32).tobytes()] for r in np.asarray(seq)], np.int32)
  fields = ("teacher_logp_BN", "teacher_topk_ids_BNk", "teacher_topk_logp_BNk")
  calls = collections.Counter()
  ex = extras_lib.DistillExtras([fake_teacher(0, calls), fake_teacher(1, calls)], fields, 2, K, domains=domains,
                                cache=RowCache(100))
  plain = extras_lib.DistillExtras([fake_teacher(0), fake_teacher(1)], fields, 2, K, domains=domains)
  batch = lambda names, masked=(): rollout(np.concatenate([groups[n][0] for n in names]),
                                           np.repeat([[0.0] * 3 if n in masked else [1.0] * 3 for n in names], 2, 0))
  served = []
  for names, masked, hits in [(["A0", "A1", "A2", "A3"], ["A2"], 0),  # A2: DAPO-filtered, zeros
                              (["A3", "B0", "A0", "B1"], [], 4),  # replay-like: A3, A0 again, in other places
                              (["A1", "C0", "C1", "C2"], [], 2)]:  # teacher 1 scores 3 groups (padded to 4)
    ro = batch(names, masked)
    out, b = call(ex, ro)
    want, _ = call(plain, ro)
    for f in fields:
      np.testing.assert_array_equal(np.asarray(out[f]), np.asarray(want[f]))
    assert b["info"]["topk_cache_hits"] == hits and b["info"]["topk_cache_misses"] == 8 - hits - 2 * len(masked)
    served.append(out)
  assert not np.asarray(served[0]["teacher_logp_BN"])[4:6].any()
  np.testing.assert_array_equal(served[1]["teacher_topk_logp_BNk"][4:6], served[0]["teacher_topk_logp_BNk"][0:2])
  assert len(calls) == 2 * 8 and set(calls.values()) == {1}  # 8 live groups of 2 rows, each row scored once


def two_teachers(c):
  c.distill.teacher = "mopd"
  c.distill.teachers = [ml_collections.ConfigDict({"teacher": "sft", "teacher_d_model": 64, "teacher_n_layers": 2,
                                                   "teacher_sft_steps": 5}),
                        ml_collections.ConfigDict({"teacher": "sft", "teacher_d_model": 32, "teacher_n_layers": 1,
                                                   "teacher_sft_steps": 5, "seed": 3})]
  return c


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.distill.update({"adwin": {"enabled": True, "h_int": 3}}), "distill.adwin.h_int"),
    (lambda c: c.distill.update({"adwin": {"enabled": True, "h_min": 8, "h_max": 4}}), "distill.adwin.h_max"),
    (lambda c: c.distill.update({"teachers": [{"teacher": "sft"}]}), "distill.teacher"),
    (lambda c: c.distill.update({"teacher": "mopd"}), "distill.teachers"),
    (lambda c: two_teachers(c).distill.update({"mopd": {"token_share": True}}), "distill.mopd.reward_advantage"),
    (lambda c: two_teachers(c).distill.update({"mopd": {"reward_advantage": True}}), "distill.mopd.reward_advantage"),
    (lambda c: two_teachers(c).distill.update({"mopd": {"target_share": (1.0,)}}), "distill.mopd.target_share"),
    (lambda c: two_teachers(c).loss.update({"name": "opd_forward_kl"}), "distill.teachers"),
    (lambda c: c.distill.update({"topk_cache": {"enabled": True, "capacity": 0}}), "distill.topk_cache.capacity"),
    (lambda c: (c.distill.update({"topk_cache": {"enabled": True}}), c.loss.update({"name": "opd_forward_kl"})),
     "distill.topk_cache.enabled"),
])
def test_options_are_validated_by_name(edit, field):
  c = opd_tiny("/tmp/unused")
  edit(c)
  with pytest.raises(ConfigError, match=f"config.{field}"):
    opd.validate(c)


def test_valid_option_configs_and_off_by_default():
  c = opd_tiny("/tmp/unused")
  assert not extras_lib.enabled(c)
  opd.validate(c)
  c = two_teachers(opd_tiny("/tmp/unused"))
  c.loss.name = "ppo_clip"
  c.distill.mopd = {"token_share": True, "gap_follow": True, "reward_advantage": True}
  assert extras_lib.enabled(c)
  opd.validate(c)


def test_example_domains_column_name_or_example_id():
  exs = [{"example_id": 7}, {"example_id": 4, "domain": 1}, {"example_id": 5, "domain": "b"}]
  np.testing.assert_array_equal(extras_lib.example_domains(exs, 2, ["a", "b"]), [1, 1, 1])
  np.testing.assert_array_equal(extras_lib.example_domains(exs[:1], 3, ["", "", ""]), [1])
  with pytest.raises(ValueError, match="names no teacher"):
    extras_lib.example_domains([{"example_id": 0, "domain": "c"}], 2, ["a", "b"])
