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
