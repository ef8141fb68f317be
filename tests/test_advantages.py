"""Golden tests for jaxrl_llm.advantages (values computed by hand / numpy, verl conventions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages as A

# Two groups, interleaved (non-contiguous ids), plus a singleton group 2.
REWARD = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5], np.float32)
GID = np.array([0, 1, 0, 1, 0, 2], np.int32)
# group 0: [1, 0, 1] mean 2/3, unbiased std sqrt(((1/3)^2*2 + (2/3)^2)/2) = sqrt(1/3)
# group 1: [0, 1]    mean 1/2, unbiased std sqrt((0.25+0.25)/1) = sqrt(0.5)
# group 2: [0.5]     singleton: mean 0, std 1


def test_grpo_golden_unbiased_std():
  adv = np.asarray(A.grpo(REWARD, GID, 3))
  s0, s1 = np.sqrt(1 / 3), np.sqrt(0.5)
  eps = 1e-6
  want = np.array([(1 / 3) / (s0 + eps), -0.5 / (s1 + eps), (-2 / 3) / (s0 + eps), 0.5 / (s1 + eps),
                   (1 / 3) / (s0 + eps), 0.5 / (1 + eps)])
  np.testing.assert_allclose(adv, want, rtol=1e-5)


def test_grpo_ddof0_and_matches_numpy_per_group():
  adv = np.asarray(A.grpo(REWARD, GID, 3, ddof=0, eps=0.0))
  for g in (0, 1):
    r = REWARD[GID == g]
    np.testing.assert_allclose(adv[GID == g], (r - r.mean()) / r.std(ddof=0), rtol=1e-5)
  np.testing.assert_allclose(adv[GID == 2], [0.5], rtol=1e-6)  # singleton convention independent of ddof


def test_grpo_without_std_is_dr_grpo():
  a = np.asarray(A.grpo(REWARD, GID, 3, std_normalize=False))
  b = np.asarray(A.dr_grpo(REWARD, GID, 3))
  want = np.array([1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 0.5])
  np.testing.assert_allclose(a, want, rtol=1e-6)
  np.testing.assert_allclose(b, want, rtol=1e-6)


def test_grpo_constant_group_is_zero_and_valid_mask_excludes_rows():
  r = np.array([1.0, 1.0, 1.0, 3.0, 5.0, 100.0], np.float32)
  g = np.array([0, 0, 0, 1, 1, 1], np.int32)
  v = np.array([1, 1, 1, 1, 1, 0], np.float32)  # row 5 is padding: must not enter group 1's stats.
  adv = np.asarray(A.grpo(r, g, 2, valid_B=v))
  np.testing.assert_allclose(adv[:3], 0.0, atol=0)
  s = np.std([3.0, 5.0], ddof=1)
  np.testing.assert_allclose(adv[3:5], [-1.0 / (s + 1e-6), 1.0 / (s + 1e-6)], rtol=1e-5)
  assert adv[5] == 0.0


def test_rloo_golden():
  adv = np.asarray(A.rloo(REWARD, GID, 3))
  # group 0 [1,0,1]: 1 - (0+1)/2 = 0.5; 0 - (1+1)/2 = -1; group 1 [0,1]: -1, 1; singleton: reward.
  want = np.array([0.5, -1.0, -1.0, 1.0, 0.5, 0.5])
  np.testing.assert_allclose(adv, want, rtol=1e-6)
  # identity with the group-mean form n/(n-1)·(R - mean)
  dr = np.asarray(A.dr_grpo(REWARD, GID, 3))
  np.testing.assert_allclose(adv[GID == 0], 1.5 * dr[GID == 0], rtol=1e-6)


def test_reinforce_pp_global_whitening():
  r = np.array([1.0, 0.0, 3.0, 2.0], np.float32)
  adv = np.asarray(A.reinforce_pp(r))
  want = (r - r.mean()) / np.sqrt(r.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(adv, want, rtol=1e-5)
  # with groups: subtract group mean, then whiten over the batch
  g = np.array([0, 0, 1, 1], np.int32)
  x = np.array([0.5, -0.5, 0.5, -0.5])
  adv = np.asarray(A.reinforce_pp(r, g, 2))
  np.testing.assert_allclose(adv, (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8), rtol=1e-5)


def test_reinforce_pp_token_weighted_matches_verl_style_masked_whiten():
  r = np.array([1.0, 0.0, 2.0], np.float32)
  lens = np.array([2, 1, 3], np.float32)
  adv = np.asarray(A.reinforce_pp(r, weight_B=lens))
  tok = np.repeat(r, lens.astype(int))  # what verl whitens: one value per token
  want = (r - tok.mean()) / np.sqrt(tok.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(adv, want, rtol=1e-5)


def test_reinforce_pp_ignores_invalid_rows():
  r = np.array([1.0, 0.0, 3.0, 1e6], np.float32)
  v = np.array([1, 1, 1, 0], np.float32)
  adv = np.asarray(A.reinforce_pp(r, valid_B=v))
  x = r[:3]
  np.testing.assert_allclose(adv[:3], (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8), rtol=1e-5)
  assert adv[3] == 0.0


def test_dapo_keep_mask():
  r = np.array([1.0, 1.0, 0.0, 1.0, 0.3, 0.0, 0.0], np.float32)
  g = np.array([0, 0, 1, 1, 2, 3, 3], np.int32)  # group 0 constant, 1 mixed, 2 singleton, 3 constant
  keep = np.asarray(A.dapo_keep_mask(r, g, 4))
  np.testing.assert_array_equal(keep, [0, 0, 1, 1, 0, 0, 0])
  # an invalid row cannot make a constant group "mixed"
  v = np.array([1, 1, 1, 1, 1, 1, 0], np.float32)
  r2 = r.copy()
  r2[6] = 1.0
  np.testing.assert_array_equal(np.asarray(A.dapo_keep_mask(r2, g, 4, valid_B=v)), [0, 0, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(A.dapo_keep_mask(r2, g, 4)), [0, 0, 1, 1, 0, 1, 1])


def test_kept_groups_are_exactly_the_nonzero_grpo_groups():
  rng = np.random.default_rng(0)
  r = rng.integers(0, 2, size=24).astype(np.float32)
  g = rng.permutation(np.repeat(np.arange(6), 4)).astype(np.int32)
  adv = np.asarray(A.grpo(r, g, 6))
  keep = np.asarray(A.dapo_keep_mask(r, g, 6))
  for k in range(6):
    assert (np.abs(adv[g == k]).max() > 0) == bool(keep[g == k].all())


def test_to_tokens():
  mask = np.array([[1, 1, 0], [0, 1, 1]], np.float32)
  out = np.asarray(A.to_tokens(jnp.array([2.0, -1.0]), mask))
  np.testing.assert_array_equal(out, [[2, 2, 0], [0, -1, -1]])


@pytest.mark.parametrize("fn", [A.grpo, A.dr_grpo, A.rloo, A.dapo_keep_mask])
def test_jittable_with_static_num_groups(fn):
  jf = jax.jit(fn, static_argnums=2)
  np.testing.assert_allclose(np.asarray(jf(REWARD, GID, 3)), np.asarray(fn(REWARD, GID, 3)), rtol=1e-6)


def test_empty_batch_is_finite():
  v = np.zeros(4, np.float32)
  r = np.arange(4, dtype=np.float32)
  g = np.array([0, 0, 1, 1], np.int32)
  for out in (A.grpo(r, g, 2, valid_B=v), A.rloo(r, g, 2, valid_B=v), A.reinforce_pp(r, valid_B=v)):
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_grpo_eps0_constant_group_is_zero_not_nan():
  r = np.array([1.0, 1.0, 0.0, 1.0], np.float32)
  g = np.array([0, 0, 1, 1], np.int32)
  adv = np.asarray(A.grpo(r, g, 2, eps=0.0))
  np.testing.assert_allclose(adv, [0.0, 0.0, -0.5 / np.sqrt(0.5), 0.5 / np.sqrt(0.5)], rtol=1e-6)


def test_collect_group_advantages_jitted_matches_eager_and_token_form():
  from jaxrl_llm.rollout import collect
  reward_B = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], np.float32)
  G = 3
  eager = A.grpo(jnp.asarray(reward_B), jnp.arange(6) // G, 2, std_normalize=True)
  np.testing.assert_allclose(collect.group_advantages(reward_B, G, "grpo", True), eager, rtol=1e-6)
  mask_BN = jnp.asarray(np.tril(np.ones((6, 4), np.float32), 1))
  np.testing.assert_allclose(collect.group_advantages(reward_B, G, "grpo", True, mask_BN), eager[:, None] * mask_BN,
                             rtol=1e-6)


def test_turn_level_credit_golden_and_equal_to_the_sequence_advantage_with_a_final_reward():
  """`collect.turn_advantages` (advantage.turn_level): A_bt = A_b + (G_k − R_b)/s_b by hand; with a final reward
  only, every turn's return-to-go is the return and the token advantages are the episode's; equal returns: 0."""
  from jaxrl_llm.rollout import collect
  turn_r = np.array([[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]], np.float32)  # group of 2; K = 3 turns
  R = turn_r.sum(1)  # [1, 0]
  turn_BN = np.array([[0, 0, -1, 1, 2], [0, -1, 1, 1, -1]])
  for name, std in (("grpo", True), ("grpo", False), ("rloo", False)):
    adv_B = np.asarray(collect.group_advantages(R, 2, name, std))
    got = collect.turn_advantages(R, turn_r, turn_BN, adv_B, 2, name, std)
    s = (np.std(R, ddof=1) + 1e-6) if std else 1.0
    togo = np.array([[1.0, 0.5, 0.5], [0.0, 0.0, 0.0]])
    want = np.where(turn_BN >= 0, adv_B[:, None] + (togo[np.arange(2)[:, None], np.clip(turn_BN, 0, 2)] - R[:, None]) / s,
                    0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert got[0, 4] < got[0, 0]  # the last turn earned only its own 0.5: less credit than the first (1.0)
  final = np.array([[0, 0, 1.0], [0, 0, 0.0], [0, 0, 1.0], [0, 0, 1.0]], np.float32)
  adv_B = np.asarray(collect.group_advantages(final.sum(1), 2, "grpo", True))
  tb = np.array([[0, 1, 2, -1]] * 4)
  got = collect.turn_advantages(final.sum(1), final, tb, adv_B, 2, "grpo", True)
  np.testing.assert_allclose(got[:, :3], np.repeat(adv_B[:, None], 3, 1), rtol=1e-6)
  assert np.all(got[:, 3] == 0) and np.all(got[2:] == 0)  # group 2's returns are equal: no signal
