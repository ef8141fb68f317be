"""Golden values and gradients for DPPO (binary TV / KL) and DPPO top-K."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import dppo as dppo_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("dppo")
TOPK = losses.get("dppo_topk")


def _grad(inputs, hp, spec=SPEC, mode="token-mean", **kw):
  def f(lp):
    loss_BN, aux = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(loss_BN, inputs.mask_BN, mode, keep_BN=aux.get("keep_BN"), **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


# Sampled-token probabilities (π, μ) and advantages chosen so every branch of the mask triggers.
P = np.array([[0.60, 0.30, 0.10, 0.60],
              [0.10, 0.50, 0.45, 0.05]], np.float64)
MU = np.array([[0.30, 0.25, 0.50, 0.10],
               [0.50, 0.20, 0.40, 0.05]], np.float64)
A = np.array([[1.0, 1.0, 1.0, -1.0],
              [-1.0, -1.0, 2.0, 0.5]], np.float32)
# (0,0) A>0 π>μ TV .30 -> masked; (0,1) A>0 π>μ TV .05 -> kept; (0,2) A>0 π<μ TV .40 -> kept (pull-back);
# (0,3) A<0 π>μ TV .5, ratio 6 > C -> kept with weight 5; (1,0) A<0 π<μ TV .4 -> masked;
# (1,1) A<0 π>μ -> kept; (1,2) small TV -> kept; (1,3) masked out by the loss mask (padding -inf).


def _inputs(p=P, mu=MU, adv=A, prox=None):
  logp = np.log(p).astype(np.float32)
  behav = np.log(mu).astype(np.float32)
  mask = np.ones(p.shape, np.float32)
  mask[1, 3] = 0
  logp[1, 3] = -np.inf
  behav[1, 3] = -np.inf
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    behavior_logp_BN=jnp.asarray(behav),
                    prox_logp_BN=None if prox is None else jnp.asarray(prox))


def _golden(div, delta, cap=5.0):
  mask = np.ones(P.shape, bool)
  mask[1, 3] = False
  drop = ((A > 0) & (P > MU) & (div > delta)) | ((A < 0) & (P < MU) & (div > delta))
  keep = mask & ~drop
  w = np.minimum(P / MU, cap)
  return keep, np.where(keep, -w * A, 0.0)


def test_binary_tv_golden():
  inputs = _inputs()
  hp = dppo_mod.Hparams()
  loss_BN, aux = SPEC.fn(inputs, hp)
  keep, gnum = _golden(np.abs(P - MU), 0.15)
  want_keep = np.array([[0, 1, 1, 1], [0, 1, 1, 0]], bool)
  np.testing.assert_array_equal(keep, want_keep)
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), want_keep.astype(np.float32))
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(keep, -np.minimum(P / MU, 5) * A * np.log(P), 0),
                             rtol=1e-5, atol=1e-7)
  for drop, den in [(False, 7.0), (True, 5.0)]:
    g = _grad(inputs, hp, drop_rejected=drop)
    np.testing.assert_allclose(g, gnum / den, rtol=1e-5, atol=1e-8)
    assert np.all(np.isfinite(g)) and g[1, 3] == 0
  assert abs(gnum[0, 3]) == 5.0  # the ratio cap C = 5 bound
  np.testing.assert_allclose(float(aux["mask_frac"][0]), 2.0)


def test_binary_kl_golden():
  inputs = _inputs()
  hp = dppo_mod.Hparams(divergence="binary_kl")
  e = 1e-8
  kl = MU * (np.log(MU + e) - np.log(P + e)) + (1 - MU) * (np.log(1 - MU + e) - np.log(1 - P + e))
  keep, gnum = _golden(kl, 0.05)
  # KL at (0,1) is 0.0061 (< .05, kept) and at (1,2) 0.0050 (kept); the two large moves are masked.
  np.testing.assert_array_equal(keep, np.array([[0, 1, 1, 1], [0, 1, 1, 0]], bool))
  np.testing.assert_allclose(_grad(inputs, hp), gnum / 7.0, rtol=1e-5, atol=1e-8)
  _, aux = SPEC.fn(inputs, hp)
  counted = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
  np.testing.assert_allclose(float(aux["divergence"][0]), kl[counted].sum(), rtol=1e-4)


def test_anchor_is_behavior_not_prox():
  """The proximal log-probs play no role (the paper's anchor is μ)."""
  a = _grad(_inputs(prox=np.zeros(P.shape, np.float32)), dppo_mod.Hparams())
  b = _grad(_inputs(prox=np.full(P.shape, -7.0, np.float32)), dppo_mod.Hparams())
  np.testing.assert_array_equal(a, b)
  assert SPEC.needs == frozenset({"behavior_logp"})


def test_recompute_anchor_uses_prox():
  """anchor="prox" (verl's recompute form): π_old replaces μ in the ratio and in the TV mask."""
  base = _inputs()
  junk_mu = np.log(np.full(P.shape, 0.9)).astype(np.float32)  # μ far from π_old: must play no role
  junk_mu[1, 3] = -np.inf
  inputs = base.replace(prox_logp_BN=base.behavior_logp_BN, behavior_logp_BN=jnp.asarray(junk_mu))
  hp = dppo_mod.Hparams(anchor="prox")
  loss_BN, aux = SPEC.fn(inputs, hp)
  keep, gnum = _golden(np.abs(P - MU), 0.15)  # float64 numpy with π_old = MU
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(keep, -np.minimum(P / MU, 5) * A * np.log(P), 0),
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_grad(inputs, hp), gnum / 7.0, rtol=1e-5, atol=1e-8)
  # The default anchor reads μ = 0.9 instead: a different gradient.
  assert not np.allclose(_grad(inputs, dppo_mod.Hparams()), gnum / 7.0)
  with pytest.raises(ValueError, match="prox_logp"):
    SPEC.fn(base, hp)
  with pytest.raises(ValueError, match="anchor"):
    SPEC.fn(inputs, dppo_mod.Hparams(anchor="old"))


@pytest.mark.parametrize("div", ["binary_tv", "binary_kl"])
def test_on_policy_equals_pg(div):
  inputs = _inputs(mu=P)
  pg = losses.get("pg")
  np.testing.assert_allclose(_grad(inputs, dppo_mod.Hparams(divergence=div)), _grad(inputs, pg.Hparams(), spec=pg),
                             rtol=1e-6, atol=0)


def _topk_inputs():
  # B=1, N=3, k=2. Position 0: sampled token is μ's top-1; position 1: sampled token outside the
  # top-2; position 2: padding.
  logp = np.log(np.array([[0.5, 0.2, 1.0]])).astype(np.float32)
  behav = np.log(np.array([[0.3, 0.05, 1.0]])).astype(np.float32)
  mu_k = np.array([[[0.3, 0.2], [0.6, 0.3], [1.0, 1e-9]]])
  p_k = np.array([[[0.5, 0.1], [0.4, 0.3], [1.0, 1e-9]]])
  mask = np.array([[1.0, 1.0, 0.0]], np.float32)
  logp[0, 2] = -np.inf
  adv = np.array([[1.0, 1.0, 1.0]], np.float32)
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    behavior_logp_BN=jnp.asarray(behav),
                    behavior_topk_ids_BNk=jnp.zeros((1, 3, 2), jnp.int32),
                    behavior_topk_logp_BNk=jnp.asarray(np.log(mu_k).astype(np.float32)),
                    topk_logp_BNk=jnp.asarray(np.log(p_k).astype(np.float32)))


def test_topk_tv_golden():
  inputs = _topk_inputs()
  # t0: buckets top-2 + other: π (.5,.1,.4), μ (.3,.2,.5): TV = .5(.2+.1+.1) = .2 > .15, A>0 & π>μ -> masked.
  # t1: buckets top-2 + sampled + other: π (.4,.3,.2,.1), μ (.6,.3,.05,.05): TV = .5(.2+0+.15+.05) = .2
  #     -> A>0 & π>μ & TV>δ -> masked too; with δ = .25 both kept.
  p, mu = dppo_mod.topk_buckets(inputs, 1e-5)
  np.testing.assert_allclose(np.asarray(p)[0, :2], [[0.5, 0.1, 0.0, 0.4], [0.4, 0.3, 0.2, 0.1]], atol=1e-6)
  np.testing.assert_allclose(np.asarray(mu)[0, :2], [[0.3, 0.2, 0.0, 0.5], [0.6, 0.3, 0.05, 0.05]], atol=1e-6)
  _, aux = TOPK.fn(inputs, dppo_mod.TopkHparams())
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), [[0.0, 0.0, 0.0]])
  hp = dppo_mod.TopkHparams(delta_tv=0.25)
  _, aux = TOPK.fn(inputs, hp)
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), [[1.0, 1.0, 0.0]])
  np.testing.assert_allclose(float(aux["divergence"][0]), 0.4, rtol=1e-5)
  g = _grad(inputs, hp, spec=TOPK)
  np.testing.assert_allclose(g, [[-0.5 / 0.3 / 2, -0.2 / 0.05 / 2, 0.0]], rtol=1e-5)
  assert np.all(np.isfinite(g))


def test_topk_kl_golden():
  inputs = _topk_inputs()
  _, aux = TOPK.fn(inputs, dppo_mod.TopkHparams(divergence="topk_kl", delta_kl=10.0))
  e = 1e-8
  kl = lambda mu, p: sum(m * (np.log(m + e) - np.log(q + e)) for m, q in zip(mu, p))
  want = kl([0.3, 0.2, 0.5], [0.5, 0.1, 0.4]) + kl([0.6, 0.3, 0.05, 0.05], [0.4, 0.3, 0.2, 0.1])
  np.testing.assert_allclose(float(aux["divergence"][0]), want, rtol=1e-4)
