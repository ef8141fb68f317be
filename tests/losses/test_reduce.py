"""Aggregation golden values: drop_rejected with a fully rejected row (value and gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses

LOGP = np.array([[-0.5, -1.0, -0.2], [-0.3, -0.7, -1.1], [-0.9, -0.4, -2.0]])
ADV = np.array([[1.0] * 3, [-2.0] * 3, [0.5] * 3])
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]], np.float64)
KEEP = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 0]], np.float64)  # row 1: every token rejected


def _np_ref(mode, drop):
  """float64 reference: ℓ = −A·exp(logp)·keep; B' and L_b from the denominator mask."""
  tok = -ADV * np.exp(LOGP) * KEEP * MASK
  dtok = tok  # d ℓ / d logp = ℓ for this loss
  den = KEEP if drop else MASK
  L = den.sum(-1)
  has = L > 0
  if mode == "token-mean":
    return tok.sum() / den.sum(), dtok / den.sum()
  scale = {"seq-mean-token-mean": 1 / np.maximum(L, 1), "seq-mean-token-sum": np.ones(3),
           "seq-mean-token-sum-norm": np.full(3, 1 / 4.0)}[mode]
  w = np.where(has, scale, 0.0) / has.sum()
  return (tok.sum(-1) * w).sum(), dtok * w[:, None]


@pytest.mark.parametrize("mode", losses.MODES)
@pytest.mark.parametrize("drop", [False, True])
def test_fully_rejected_row_leaves_b_prime(mode, drop):
  def f(lp):
    loss_BN = -jnp.asarray(ADV, jnp.float32) * jnp.exp(lp) * jnp.asarray(KEEP, jnp.float32)
    return losses.reduce(loss_BN, jnp.asarray(MASK, jnp.float32), mode, keep_BN=jnp.asarray(KEEP, jnp.float32),
                         drop_rejected=drop, norm_len=4.0)
  lp = jnp.asarray(LOGP, jnp.float32)
  want, want_g = _np_ref(mode, drop)
  np.testing.assert_allclose(float(f(lp)), want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(jax.grad(f)(lp)), want_g, rtol=1e-6, atol=1e-8)


def test_fully_rejected_row_hand_value():
  # seq-mean-token-sum with drop: rows 0 and 2 count (B' = 2), row 1 does not.
  # row 0: −(e^−0.5 + e^−0.2); row 2: −0.5·(e^−0.9 + e^−0.4).
  want = (-(np.exp(-0.5) + np.exp(-0.2)) - 0.5 * (np.exp(-0.9) + np.exp(-0.4))) / 2
  loss_BN = -jnp.asarray(ADV * np.exp(LOGP) * KEEP, jnp.float32)
  got = losses.reduce(loss_BN, jnp.asarray(MASK, jnp.float32), "seq-mean-token-sum",
                      keep_BN=jnp.asarray(KEEP, jnp.float32), drop_rejected=True)
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
