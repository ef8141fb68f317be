"""PPO-EWMA is decoupled PPO with π_prox = the EWMA-weight policy: golden values and equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import ppo_ewma as ewma_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("ppo_ewma")


def _grad(inputs, hp, mode="token-mean", spec=SPEC):
  def f(lp):
    return losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _inputs(logp, ewma, behav, adv, mask):
  return LossInputs(logp_BN=jnp.asarray(logp, jnp.float32), mask_BN=jnp.asarray(mask, jnp.float32),
                    adv_BN=jnp.asarray(adv, jnp.float32), prox_logp_BN=jnp.asarray(ewma, jnp.float32),
                    behavior_logp_BN=jnp.asarray(behav, jnp.float32))


def test_golden_by_hand():
  # log π_θ/π_EWMA = [0.1, 0.3, 0, pad]; log π_EWMA/μ = [0, 1, 2, pad]; Â = 1.
  # t0: w = 1, r = e^0.1 unclipped; t1: w = e, r = e^0.3 > 1.2 clipped; t2: w = e^2 > 5 masked.
  logp = np.array([[-1.0, -1.0, -1.0, -np.inf]])
  ewma = np.array([[-1.1, -1.3, -1.0, -np.inf]])
  behav = np.array([[-1.1, -2.3, -3.0, -np.inf]])
  mask = np.array([[1.0, 1.0, 1.0, 0.0]])
  inputs = _inputs(logp, ewma, behav, np.ones((1, 4)), mask)
  hp = ewma_mod.Hparams()
  loss_BN, aux = SPEC.fn(inputs, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), [[-np.exp(0.1), -np.e * 1.2, 0.0, 0.0]], rtol=1e-5)
  np.testing.assert_allclose(_grad(inputs, hp), [[-np.exp(0.1) / 3, 0.0, 0.0, 0.0]], rtol=1e-5, atol=1e-8)
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), [[1, 1, 0, 0]])


@pytest.mark.parametrize("kw", [dict(), dict(filter_level="sequence", filter_upper=1.5, dual_clip=3.0)])
def test_equals_decoupled_ppo(kw):
  rng = np.random.default_rng(0)
  logp = rng.normal(-1.0, 0.3, (3, 5))
  ewma = logp - rng.normal(0, 0.3, (3, 5))
  behav = ewma - rng.normal(0, 0.8, (3, 5))
  mask = (rng.random((3, 5)) > 0.2).astype(np.float32)
  inputs = _inputs(logp, ewma, behav, rng.normal(size=(3, 5)), mask)
  dp = losses.get("decoupled_ppo")
  a, aux_a = SPEC.fn(inputs, ewma_mod.Hparams(**kw))
  b, aux_b = dp.fn(inputs, dp.Hparams(**kw))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(aux_a["keep_BN"]), np.asarray(aux_b["keep_BN"]))
  np.testing.assert_array_equal(_grad(inputs, ewma_mod.Hparams(**kw)), _grad(inputs, dp.Hparams(**kw), spec=dp))


def test_on_policy_equals_pg():
  logp = np.array([[-1.0, -0.5, -2.0], [-0.3, -np.inf, -np.inf]])
  mask = np.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
  inputs = _inputs(logp, logp, logp, np.array([[1.0, -2.0, 0.5], [0.3, 0.3, 0.3]]), mask)
  pg = losses.get("pg")
  np.testing.assert_allclose(_grad(inputs, ewma_mod.Hparams()), _grad(inputs, pg.Hparams(), spec=pg), rtol=1e-6)


def test_registered_needs_and_doc():
  # ewma_prox: only a run with rollout.old_logp="ewma" provides its π_prox (tests/test_config.py, tests/test_ewma.py)
  assert SPEC.needs == frozenset({"prox_logp", "behavior_logp", "ewma_prox"})
  assert "2605.12070" in SPEC.doc and "could not be pinned" in SPEC.doc
