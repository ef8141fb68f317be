"""Golden values and gradients for DRPO (smooth and eff variants)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import drpo as drpo_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("drpo")

P = np.array([[0.60, 0.30, 0.10, 0.90], [0.10, 0.50, 0.45, 0.05]])
MU = np.array([[0.30, 0.25, 0.50, 0.05], [0.50, 0.20, 0.40, 0.05]])
A = np.array([[1.0, -1.0, 1.0, -2.0], [-1.0, 2.0, 0.0, 0.5]], np.float32)


def _inputs(p=P, mu=MU):
  logp = np.log(p).astype(np.float32)
  behav = np.log(mu).astype(np.float32)
  mask = np.ones(p.shape, np.float32)
  mask[1, 3] = 0
  logp[1, 3] = -np.inf
  behav[1, 3] = -np.inf
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(A),
                    behavior_logp_BN=jnp.asarray(behav))


def _grad(inputs, hp, spec=SPEC, mode="token-mean"):
  f = lambda lp: losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


@pytest.mark.parametrize("eps", [12.5, 0.15])
@pytest.mark.parametrize("mu_weighted", [True, False])
def test_smooth_golden(eps, mu_weighted):
  hp = drpo_mod.Hparams(eps=eps, mu_weighted=mu_weighted)
  inputs = _inputs()
  loss_BN, aux = SPEC.fn(inputs, hp)
  m = np.ones(P.shape, bool)
  m[1, 3] = False
  r = P / MU
  c = MU if mu_weighted else np.ones_like(MU)
  val = np.where(m, -A * r + np.abs(A) * c * (r - 1) ** 2 / (2 * eps), 0)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-7)
  # The spec's weight formula: ∇ = −r·Â·w, w = 1 − sign(Â(r−1))·|π−μ|/ε (μ-weighted) or c(r−1) in place of π−μ.
  w = 1 - np.sign(A * (r - 1)) * (np.abs(P - MU) if mu_weighted else np.abs(r - 1)) / eps
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, np.where(m, -r * A * w, 0) / 7.0, rtol=1e-5, atol=1e-8)
  assert np.all(np.isfinite(g)) and g[1, 3] == 0
  if eps == 12.5 and mu_weighted:  # the unit puzzle: weights stay within [1 − 1/ε, 1 + 1/ε]
    assert np.all(np.abs(w[m] - 1) <= 1 / 12.5)
  if eps == 0.15 and mu_weighted:  # |π−μ| = .3 > ε at (0,0): the weight turns corrective (negative)
    assert w[0, 0] < 0 and float(aux["drpo_corrective_frac"][0]) >= 1


def test_eff_golden():
  hp = drpo_mod.Hparams(variant="eff", eps=0.15)
  inputs = _inputs()
  m = np.ones(P.shape, bool)
  m[1, 3] = False
  re = np.clip(P / MU, 0.1, 2.0)  # (0,3) has r = 18 -> 2.0; (1,0) r = .2
  coef = -A * re + np.abs(A) * MU * re * (re - 1) / 0.15
  loss_BN, _ = SPEC.fn(inputs, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(m, coef * np.log(P), 0), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_grad(inputs, hp), np.where(m, coef, 0) / 7.0, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("variant", ["smooth", "eff"])
def test_on_policy_equals_pg(variant):
  inputs = _inputs(mu=P)
  pg = losses.get("pg")
  np.testing.assert_allclose(_grad(inputs, drpo_mod.Hparams(variant=variant, eps=0.15)),
                             _grad(inputs, pg.Hparams(), spec=pg), rtol=1e-6, atol=0)
