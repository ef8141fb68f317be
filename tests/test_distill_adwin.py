"""ADWIN [GUESS] horizon rule: the properties its docstring states."""

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.distill import adwin

CFG = adwin.AdwinConfig(h_init=100, h_min=16, h_max=400, gamma_down=0.8, gamma_up=1.5, tau=0.8,
                        probe_period=5, max_probe_age=2)


def test_agreement_shrinks_disagreement_grows_within_bounds():
  s = adwin.init_state(CFG)
  assert s.horizon == 100
  assert adwin.update_horizon(s, 0.9, 10, 10, CFG).horizon == 80
  assert adwin.update_horizon(s, 0.8, 10, 10, CFG).horizon == 80  # ≥ τ shrinks
  assert adwin.update_horizon(s, 0.5, 10, 10, CFG).horizon == 150
  lo = s
  hi = s
  for _ in range(40):
    lo = adwin.update_horizon(lo, 1.0, 0, 0, CFG)
    hi = adwin.update_horizon(hi, 0.0, 0, 0, CFG)
  assert lo.horizon == 16 and hi.horizon == 400  # fixed points at the bounds
  small = adwin.AdwinState(horizon=17, last_probe_step=0)
  assert adwin.update_horizon(small, 1.0, 0, 0, adwin.AdwinConfig(h_min=1, gamma_down=0.99)).horizon == 16  # moves ≥ 1


def test_stale_probes_are_ignored():
  s = adwin.init_state(CFG)
  assert adwin.update_horizon(s, 0.0, 7, 10, CFG) == s  # age 3 > 2
  assert adwin.update_horizon(s, 0.0, 8, 10, CFG).horizon == 150  # age 2 counts


def test_probe_schedule():
  s = adwin.init_state(CFG)
  assert adwin.should_probe(s, 0, CFG)
  s = adwin.mark_probe(s, 0)
  assert not adwin.should_probe(s, 4, CFG) and adwin.should_probe(s, 5, CFG)


def test_prefix_mask_counts_tokens_with_left_padding():
  mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], jnp.float32)
  np.testing.assert_array_equal(np.asarray(adwin.prefix_mask(mask, 2)), [[0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(adwin.prefix_mask(mask, jnp.asarray([1, 5]))),
                                [[0, 0, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]])


def test_teacher_anchored_length_and_alignment_proxies():
  mask = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], jnp.float32)
  rkl = jnp.asarray([[0.1, 0.2, 3.0, 5.0, 0.1], [0.1, 0.1, 0.1, 9.0, 9.0]])
  np.testing.assert_array_equal(np.asarray(adwin.teacher_anchored_length(rkl, mask, 1.0, 4)), [3, 3])
  np.testing.assert_array_equal(np.asarray(adwin.teacher_anchored_length(rkl, mask, 1.0, 2)), [2, 2])
  loss = jnp.asarray([[1.0, 1.0, 1.0, 1.0, 0.0], [2.0, 0.0, 2.0, 7.0, 7.0]])
  np.testing.assert_allclose(float(adwin.kl_mass_alignment(loss, mask, 2)), 4.0 / 8.0)  # (1+1 + 2+0) / (4 + 4)
  assert float(adwin.kl_mass_alignment(loss, mask, 5)) == 1.0
  g = {"a": jnp.asarray([1.0, 2.0]), "b": jnp.asarray([[3.0]])}
  np.testing.assert_allclose(float(adwin.cosine_alignment(g, g)), 1.0, rtol=1e-6)
  neg = {"a": -g["a"], "b": -g["b"]}
  np.testing.assert_allclose(float(adwin.cosine_alignment(g, neg)), -1.0, rtol=1e-6)
  assert float(adwin.cosine_alignment(g, {"a": jnp.zeros(2), "b": jnp.zeros((1, 1))})) == 0.0


def test_generation_stops_at_the_horizon_and_its_record_keeps_the_full_layout():
  """Issue 47: ADWIN generates no token past the horizon (the sampler's cap is H's power-of-two bucket) except on
  probe steps (full length). The padded record is a full-width record: the learner's recomputed π_old equals μ on
  every kept token (sync), the columns past the cap are padding."""
  import os
  from jaxrl_llm import loop
  from jaxrl_llm.config import load_file
  from jaxrl_llm.rollout.generation import budget_bucket
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = load_file(os.path.join(root, "configs", "opd_adwin_tiny.py"))
  c.num_steps, c.checkpoint.every, c.eval.every = 4, 0, 0
  c.log.tensorboard = c.log.progress = False
  c.distill.adwin.h_init, c.distill.adwin.tau = 2, 0.0  # every probe agrees: H shrinks to 1 at step 0's probe
  c.distill.teacher_sft_steps = 20
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    c.distill.teacher_cache_dir = os.path.join(d, "teachers")
    rows = loop.run(c, os.path.join(d, "run"))
  N = c.sampler.max_new_tokens
  for r in rows:
    probe = "adwin_agreement" in r  # probe_period 2: steps 0 and 2
    assert probe == (r["step"] % 2 == 0), rows
    if probe:
      assert "gen_max_new_tokens" not in r, r
    else:
      cap = budget_bucket(int(r["adwin_horizon"]), N)
      assert r.get("gen_max_new_tokens", N) == cap and r["completion_len"] <= cap, r
    assert r["mismatch_abs_max"] < 1e-5, r
  assert [r.get("gen_max_new_tokens") for r in rows] == [None, 1, None, 1], rows  # 1 new token instead of N = 4


def test_pad_response_lays_n_columns_out_as_n_of_a_stopped_row():
  from jaxrl_llm.rollout.generation import budget_bucket, pad_response
  assert [budget_bucket(n, 16) for n in (1, 2, 3, 5, 9, 16, 40)] == [1, 2, 4, 8, 16, 16, 16]
  P, n, N, pad = 2, 2, 4, 0
  out = {"tokens_BN": np.array([[5, 6]]), "mask_BN": np.array([[1.0, 1.0]]), "behavior_logp_BN": np.array([[-1., -2.]]),
         "lengths_B": np.array([2]), "sequence_BT": np.array([[9, 8, 5, 6]]), "positions_BT": np.array([[0, 1, 2, 3]]),
         "segment_ids_BT": np.array([[1, 1, 1, 1]]), "behavior_topk_ids_BNk": np.array([[[5, 7], [6, 7]]]),
         "spec_accept_rate": 0.5}
  got = pad_response(out, N, pad)
  assert got["tokens_BN"].tolist() == [[5, 6, 0, 0]] and got["mask_BN"].tolist() == [[1, 1, 0, 0]]
  assert got["sequence_BT"].tolist() == [[9, 8, 5, 6, 0, 0]] and got["positions_BT"].tolist() == [[0, 1, 2, 3, 4, 5]]
  assert got["segment_ids_BT"].tolist() == [[1, 1, 1, 1, 0, 0]] and got["lengths_B"].tolist() == [2]
  assert got["behavior_topk_ids_BNk"].shape == (1, 4, 2) and got["behavior_topk_ids_BNk"][0, 2:].tolist() == [[0, 0]] * 2
  assert got["behavior_logp_BN"].tolist() == [[-1, -2, 0, 0]] and got["spec_accept_rate"] == 0.5
  assert P + N == got["sequence_BT"].shape[1]
