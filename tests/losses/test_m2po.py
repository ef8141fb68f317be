"""Golden values and gradients for M2PO (paper masking and released-code adaptive clip)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_llm import losses
from jaxrl_llm.losses import m2po as m2po_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("m2po")


def _grad(inputs, hp, mode="token-mean", spec=SPEC, **kw):
  def f(lp):
    loss_BN, aux = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(loss_BN, inputs.mask_BN, mode, keep_BN=aux.get("keep_BN"), **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  logp = np.array([[-1.0, -0.5, -2.0, -0.3],
                   [-1.2, -0.7, -np.inf, -np.inf],
                   [-0.4, -3.0, -1.0, -1.5]], np.float32)
  lr = np.array([[0.05, 0.5, -0.1, 0.02],
                 [-0.6, 0.1, 0.0, 0.0],
                 [0.1, 0.01, -0.3, 0.0]], np.float32)
  prox = (logp - lr).astype(np.float32)
  prox[1, 2:] = -np.inf
  mask = np.ones((3, 4), np.float32)
  mask[1, 2:] = 0
  adv = np.array([[1.0] * 4, [-2.0] * 4, [-0.5] * 4], np.float32)
  return logp, prox, mask, adv, lr


def _inputs(logp, prox, mask, adv, behav=None):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    prox_logp_BN=jnp.asarray(prox),
                    behavior_logp_BN=jnp.asarray(prox if behav is None else behav))


def _np_keep(m2, mask, budget):
  """Loop reference: mask the k largest, k minimal with mean(rest) < budget; else keep the smallest."""
  flat = [(v, i) for i, (v, a) in enumerate(zip(m2.ravel(), mask.ravel())) if a > 0]
  order = sorted(flat, key=lambda p: -p[0])
  n = len(order)
  k = n - 1
  for kk in range(n):
    rest = [v for v, _ in order[kk:]]
    if np.mean(rest) < budget:
      k = kk
      break
  keep = np.zeros(m2.size, np.float32)
  for v, i in order[max(k, 0):]:
    keep[i] = 1.0
  return keep.reshape(m2.shape)


def test_paper_golden():
  logp, prox, mask, adv, lr = _case()
  hp = m2po_mod.Hparams()
  inputs = _inputs(logp, prox, mask, adv)
  loss_BN, aux = SPEC.fn(inputs, hp)
  m2 = np.where(mask > 0, lr.astype(np.float64) ** 2, 0)
  # mean M2 of all 10 active tokens = 0.0752 > 0.04; masking 0.36 (row1,t0) leaves 0.0436 > 0.04;
  # masking 0.25 too leaves 0.0178 < 0.04 -> k = 2.
  keep = _np_keep(m2, mask, 0.04)
  want_keep = mask.copy()
  want_keep[1, 0] = 0
  want_keep[0, 1] = 0
  np.testing.assert_array_equal(keep, want_keep)
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), want_keep)
  r = np.exp(lr.astype(np.float64))
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(want_keep > 0, -adv * r, 0), rtol=1e-6, atol=1e-7)
  for drop, den in [(False, mask.sum()), (True, want_keep.sum())]:
    g = _grad(inputs, hp, drop_rejected=drop)
    np.testing.assert_allclose(g, np.where(want_keep > 0, -adv * r, 0) / den, rtol=1e-5, atol=1e-8)
    assert np.all(g[mask == 0] == 0) and np.all(np.isfinite(g))
  assert float(aux["mask_frac"][0]) == 2.0


def test_paper_keeps_at_least_one_token():
  logp = np.zeros((1, 3), np.float32)
  prox = np.array([[-1.0, 2.0, -0.5]], np.float32)  # every M2 >= 0.25 > budget
  mask = np.ones((1, 3), np.float32)
  inputs = _inputs(logp, prox, mask, np.ones((1, 3), np.float32))
  _, aux = SPEC.fn(inputs, m2po_mod.Hparams())
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), [[0.0, 0.0, 1.0]])


@settings(max_examples=15, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0, width=32), min_size=6, max_size=6),
       st.lists(st.booleans(), min_size=6, max_size=6), st.sampled_from([0.01, 0.04, 0.2]))
def test_paper_mask_matches_loop_reference(lrs, act, budget):
  m2 = np.square(np.array(lrs, np.float32)).reshape(2, 3)
  mask = np.array(act, np.float32).reshape(2, 3)
  got = np.asarray(m2po_mod.m2_keep_mask(jnp.asarray(m2), jnp.asarray(mask), budget))
  want = _np_keep(m2.astype(np.float64), mask, budget) if mask.sum() else np.zeros_like(mask)
  # Equal M2 values may be masked in a different order; compare the kept multiset and its size.
  assert got.sum() == want.sum()
  np.testing.assert_allclose(np.sort(m2[got > 0]), np.sort(m2[want > 0]))
  if got.sum() > 1:
    assert m2[got > 0].mean() < budget


def _np_tau(lr, mask, adv, budget):
  seq_adv = (adv * mask).sum(1) / np.maximum(mask.sum(1), 1)
  harm = (mask > 0) & (((seq_adv[:, None] > 0) & (lr > 0)) | ((seq_adv[:, None] < 0) & (lr < 0)))
  v = np.sort((lr.astype(np.float64) ** 2)[harm])
  n = v.size
  if n == 0 or v.mean() <= budget:
    return np.inf
  target = budget * n
  for k in range(n):
    if v[: k + 1].sum() + v[k] * (n - k - 1) >= target:
      return 0.0 if k == 0 else np.sqrt(v[k - 1])
  return np.inf


@pytest.mark.parametrize("miniclip", [True, False])
def test_code_variant_golden(miniclip):
  logp, prox, mask, adv, lr = _case()
  hp = m2po_mod.Hparams(variant="code", m2_budget=0.01,
                        **(dict(min_eps_low=0.3, min_eps_high=0.5) if miniclip else {}))
  inputs = _inputs(logp, prox, mask, adv)
  loss_BN, aux = SPEC.fn(inputs, hp)
  # Harmful: row0 (A>0) r>1 -> {0.05, 0.5, 0.02}; row1 (A<0) r<1 -> {-0.6}; row2 (A<0) -> {-0.3}.
  # Δ² sorted = [0.0004, 0.0025, 0.09, 0.25, 0.36], target = 0.01·5 = 0.05. Capped sums at each
  # breakpoint: 0.002, 0.0104, 0.2729 >= 0.05 -> k = 2, τ² = 0.0025, τ = 0.05.
  tau = _np_tau(lr, mask, adv, 0.01)
  np.testing.assert_allclose(tau, 0.05, rtol=1e-5)
  eps_l, eps_h = 1 - np.exp(-tau), np.exp(tau) - 1
  if miniclip:  # the reference's miniclip_low / miniclip_high are floors on both radii
    eps_l, eps_h = max(eps_l, 0.3), max(eps_h, 0.5)
    assert eps_h == 0.5
  np.testing.assert_allclose(float(aux["eps_low"][0]), eps_l, rtol=1e-5)
  np.testing.assert_allclose(float(aux["eps_high"][0]), eps_h, rtol=1e-5)
  r = np.exp(lr.astype(np.float64))
  rc = np.clip(r, 1 - eps_l, 1 + eps_h)
  unc, clp = -adv * r, -adv * rc
  use_clip = clp > unc
  m = mask > 0
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(m, np.maximum(unc, clp), 0), rtol=1e-5, atol=1e-7)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, np.where(m & ~use_clip, -adv * r, 0) / mask.sum(), rtol=1e-5, atol=1e-8)
  assert (use_clip & m).any() and (~use_clip & m).any()


def test_code_defaults_leave_miniclip_unset():
  """The released training scripts set neither miniclip floor."""
  hp = m2po_mod.Hparams()
  assert hp.min_eps_low is None and hp.min_eps_high is None


def test_code_tau_no_constraint_and_zero():
  # Harmful mean already within budget -> τ = inf; one huge harmful token alone -> τ = 0.
  d2 = jnp.array([[0.001, 0.002, 5.0]])
  assert np.isinf(float(m2po_mod.m2_clip_tau(d2, jnp.array([[1, 1, 0]]), 0.04)))
  assert float(m2po_mod.m2_clip_tau(d2, jnp.array([[0, 0, 1]]), 0.04)) == 0.0
  assert np.isinf(float(m2po_mod.m2_clip_tau(d2, jnp.zeros((1, 3)), 0.04)))


@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("anchor", ["prox", "behavior"])
def test_on_policy_equals_pg(variant, anchor):
  logp, _, mask, adv, _ = _case()
  inputs = _inputs(logp, logp, mask, adv)
  pg = losses.get("pg")
  got = _grad(inputs, m2po_mod.Hparams(variant=variant, anchor=anchor))
  np.testing.assert_allclose(got, _grad(inputs, pg.Hparams(), spec=pg), rtol=1e-6, atol=0)


def test_anchor_selects_denominator():
  logp, prox, mask, adv, _ = _case()
  inputs = _inputs(logp, logp, mask, adv, behav=prox)  # prox = π_θ, behaviour differs
  a = _grad(inputs, m2po_mod.Hparams(anchor="behavior"))
  b = _grad(_inputs(logp, prox, mask, adv), m2po_mod.Hparams(anchor="prox"))
  np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="variant"):
    SPEC.fn(inputs, m2po_mod.Hparams(variant="nope"))
