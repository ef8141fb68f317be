"""Open-MOPD: routing, token-share balancing, gap-following budget, reward refresh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.distill import mopd


def test_hard_routing_picks_each_rows_teacher():
  vals = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2)  # [D, B, T]
  dom = jnp.asarray([2, 0, 1, 2])
  np.testing.assert_array_equal(np.asarray(mopd.route(dom, vals)), np.asarray(vals)[[2, 0, 1, 2], np.arange(4)])


def test_token_share_balancing_hits_targets_and_keeps_mean_one():
  dom = np.array([0, 0, 1, 2, 2])
  ntok = np.array([1000.0, 3000.0, 100.0, 500.0, 400.0])  # IF-like domain 1 has 2% of tokens
  w = mopd.token_share_weights(dom, ntok, [1 / 3, 1 / 3, 1 / 3])
  np.testing.assert_allclose((ntok * w).sum() / ntok.sum(), 1.0)
  share = np.bincount(dom, weights=ntok * w) / (ntok * w).sum()
  np.testing.assert_allclose(share, [1 / 3] * 3)
  assert w[2] > w[0]
  # An absent domain: the targets renormalise over the present ones.
  w2 = mopd.token_share_weights(np.array([0, 0]), np.array([10.0, 30.0]), [0.5, 0.5])
  np.testing.assert_allclose(w2, [1.0, 1.0])
  np.testing.assert_array_equal(mopd.token_share_weights(np.array([0]), np.array([0.0]), [1.0]), [1.0])


def test_gap_factor_clip_and_reference():
  f = mopd.gap_factor([2.0, 1000.0, 1e-5, np.nan], [1.0, 1.0, 1.0, 1.0], alpha=1.0)
  np.testing.assert_allclose(f, [2.0, 20.0, 0.05, 1.0])
  np.testing.assert_allclose(mopd.gap_factor([4.0], [1.0], alpha=0.5), [2.0])
  ref = mopd.update_reference([np.nan, 2.0], [5.0, 9.0])
  np.testing.assert_allclose(ref, [5.0, 2.0])  # anchored: first value sticks
  np.testing.assert_allclose(mopd.update_reference([1.0, np.nan], [3.0, np.nan], "ema", 0.5), [2.0, np.nan])
  with pytest.raises(ValueError):
    mopd.update_reference([1.0], [1.0], "divide")


def test_domain_magnitude_statistics():
  a = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 10.0, 0.0, 0.0]])
  m = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
  np.testing.assert_allclose(mopd.domain_magnitude(a, m, [0, 1], 3), [2.5, 10.0, np.nan])
  np.testing.assert_allclose(mopd.domain_magnitude(a, m, [0, 1], 2, "top10"), [4.0, 10.0])
  np.testing.assert_allclose(mopd.domain_magnitude(a, m, [0, 1], 2, "q75")[0], np.quantile([1, 2, 3, 4], 0.75))


def test_combined_weights_follow_the_gap():
  dom, ntok = np.array([0, 1]), np.array([100.0, 100.0])
  w = mopd.domain_loss_weights(dom, ntok, [0.5, 0.5], m_Y=[2.0, 1.0], ref_Y=[1.0, 1.0])
  np.testing.assert_allclose(w, [4 / 3, 2 / 3])  # domain 0's gap doubled -> twice the budget, mean 1
  w_raw = mopd.domain_loss_weights(dom, ntok, [0.5, 0.5], m_Y=[2.0, 1.0], ref_Y=[1.0, 1.0], renormalize=False)
  np.testing.assert_allclose(w_raw, [2.0, 1.0])


def test_refresh_reward_formula_and_staleness():
  rng = np.random.default_rng(0)
  lq = np.log(rng.dirichlet(np.ones(4), (2, 3)))[..., :3].astype(np.float32)
  lp = np.log(rng.dirichlet(np.ones(4), (2, 3)))[..., :3].astype(np.float32)
  mask = np.ones((2, 3), np.float32)
  mask[1, 2] = 0
  lp[0, 0, 1] = -np.inf
  r = np.asarray(mopd.refresh_reward(jnp.asarray(lq), jnp.asarray(lp), jnp.asarray(mask)))
  ok = np.isfinite(lp) & (mask[..., None] > 0)
  q = np.where(ok, np.exp(lq), 0.0)
  want = np.where(ok, (np.where(ok, lp, 0) - lq) * q / np.maximum(q.sum(-1, keepdims=True), 1e-30), 0.0)
  np.testing.assert_allclose(r, want, rtol=1e-5, atol=1e-7)
  g = jax.grad(lambda x: mopd.refresh_reward(x, jnp.asarray(lp), jnp.asarray(mask)).sum())(jnp.asarray(lq))
  np.testing.assert_array_equal(np.asarray(g), 0.0)  # a reward: no gradient
  moved = np.asarray(mopd.refresh_reward(jnp.asarray(lq + 0.3 * np.arange(3)), jnp.asarray(lp), jnp.asarray(mask)))
  assert np.abs(moved - r).max() > 1e-3  # after the student moves, the cached reward is stale
