"""Golden values and gradients for CISPO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import cispo as cispo_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("cispo")


def _grad(inputs, hp, mode="token-mean", spec=SPEC, **kw):
  def f(lp):
    loss_BN, aux = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(loss_BN, inputs.mask_BN, mode, keep_BN=aux.get("keep_BN"), **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  logp = np.array([[-1.0, -0.5, -2.0, -0.3],
                   [-1.2, -0.7, -np.inf, -np.inf],
                   [-0.4, -3.0, -1.0, -1.5]], np.float32)
  # log r per token: inside, above the cap, far below 1 (no lower bound), ...
  lr = np.array([[0.05, 0.5, -2.0, 2.0],
                 [-0.5, 0.3, 0.0, 0.0],
                 [0.1, 1.0, -0.3, -1.0]], np.float32)
  prox = (logp - lr).astype(np.float32)
  prox[1, 2:] = -np.inf
  mask = np.ones((3, 4), np.float32)
  mask[1, 2:] = 0
  adv = np.array([[1.0] * 4, [-2.0] * 4, [0.5, -0.5, 0.5, -0.5]], np.float32)
  return logp, prox, mask, adv, lr


def _inputs(logp, prox, mask, adv):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    prox_logp_BN=jnp.asarray(prox))


@pytest.mark.parametrize("eps_high", [0.2, 4.0])
def test_golden_values_and_gradients(eps_high):
  logp, prox, mask, adv, lr = _case()
  hp = cispo_mod.Hparams(eps_high=eps_high)
  inputs = _inputs(logp, prox, mask, adv)
  loss_BN, aux = SPEC.fn(inputs, hp)
  w = np.clip(np.exp(lr.astype(np.float64)), 0.0, 1.0 + eps_high)
  m = mask > 0
  val = np.where(m, -w * adv * np.where(m, logp, 0.0), 0.0)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  grad = np.where(m, -w * adv, 0.0) / mask.sum()
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  # Every counted token keeps a gradient (the defining property vs PPO), masked ones get exactly 0.
  assert np.all(g[m] != 0) and np.all(g[~m] == 0)
  n_clip = ((np.exp(lr) > 1 + eps_high) & m).sum()
  assert float(aux["clip_frac"][0]) == n_clip and n_clip > 0


def test_token_mask_option():
  logp, prox, mask, adv, lr = _case()
  hp = cispo_mod.Hparams(token_mask=True)
  inputs = _inputs(logp, prox, mask, adv)
  _, aux = SPEC.fn(inputs, hp)
  r = np.exp(lr.astype(np.float64))
  m = mask > 0
  drop = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
  keep = m & ~drop
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  assert drop[m].sum() == 4  # (0,1), (0,3), (1,0), (2,3) masked; (2,1) is A<0 & r>1 -> kept; (0,2) A>0 & r<1 -> kept
  w = np.clip(r, 0.0, 1.2)
  for drop_rejected, den in [(False, mask.sum()), (True, keep.sum())]:
    g = _grad(inputs, hp, drop_rejected=drop_rejected)
    np.testing.assert_allclose(g, np.where(keep, -w * adv, 0.0) / den, rtol=1e-5, atol=1e-7)


def test_on_policy_equals_pg():
  logp, _, mask, adv, _ = _case()
  inputs = _inputs(logp, logp, mask, adv)
  pg = losses.get("pg")
  np.testing.assert_array_equal(_grad(inputs, cispo_mod.Hparams()), _grad(inputs, pg.Hparams(), spec=pg))
