"""Golden values and gradients for decoupled PPO (AReaL) and its behaviour filter."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import decoupled_ppo as dp
from jaxrl_llm.types import LossInputs
from ._util import mismatch_inputs

SPEC = losses.get("decoupled_ppo")


def _grad(inputs, hp, mode="token-mean", spec=SPEC, **kw):
  def f(lp):
    out = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(out[0], inputs.mask_BN, mode, keep_BN=out[1].get("keep_BN"), **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


LW = np.array([[0.0, 1.8, -0.5, 0.3], [0.9, -1.0, 0.2, 0.0], [0.1, 0.4, 0.0, 0.0]])  # log π_prox/μ


def _case(lw=LW, lr=None):
  """Clip triggers at (1,0) (A>0, r>1.2) and (1,1) (A<0, r<0.8); row 2 has -inf padding after 2 tokens."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0]], np.float32)
  if lr is None:
    lr = np.array([[0.05, -0.1, 0.0, 0.1], [0.3, -0.3, 0.1, -0.05], [0.25, -0.02, 0.0, 0.0]])  # log π_θ/π_prox
  adv = np.array([[1.0] * 4, [1.5, -0.7, -2.0, 0.4], [-0.8] * 4], np.float32)
  mask = np.ones((3, 4), np.float32)
  mask[2, 2:] = 0
  prox = (logp - lr).astype(np.float32)
  behav = (prox - lw).astype(np.float32)
  for x in (logp, prox, behav):
    x[2, 2:] = -np.inf
  return logp, prox, behav, adv, mask


_inputs = mismatch_inputs


def _np_surr(r, a, el, eh, c=None):
  unc, clp = -a * r, -a * np.clip(r, 1 - el, 1 + eh)
  use_clip = clp > unc
  loss, d = np.where(use_clip, clp, unc), np.where(use_clip, 0.0, -a * r)
  if c is not None:
    dual = (a < 0) & (loss > -a * c)
    loss, d = np.where(dual, -a * c, loss), np.where(dual, 0.0, d)
  return loss, d


def _np_weight(lw, m, hp):
  """AReaL's apply_rejection_sampling on 2-D padded inputs, in numpy."""
  L = m.sum(1, keepdims=True)
  w = np.exp(lw)
  if hp.filter_metric is None:  # AReaL with no rejection sampling applies no weight ("one")
    return np.where(m, w if hp.unfiltered_weight == "ratio" else 1.0, 0.0), m
  stat = {"ratio": lw, "k1": lw, "k2": 0.5 * lw ** 2, "k3": np.exp(-lw) + lw - 1}[hp.filter_metric]
  stat = np.where(m, stat, 0.0)
  if hp.filter_level == "sequence":
    if hp.filter_agg == "sum":
      stat = stat.sum(1, keepdims=True)
    elif hp.filter_agg == "mean":
      stat = stat.sum(1, keepdims=True) / np.maximum(L, 1)
    else:
      stat = np.where(L > 0, np.where(m, stat, -np.inf).max(1, keepdims=True), 0.0)
    stat = np.broadcast_to(stat, lw.shape)
    if hp.filter_metric == "ratio":
      w = np.broadcast_to(np.exp(lw.sum(1, keepdims=True) / np.maximum(L, 1)), lw.shape)
  if hp.filter_metric == "ratio":
    stat = np.exp(stat)
  inb = stat <= hp.filter_upper
  if hp.filter_lower is not None:
    inb &= stat >= hp.filter_lower
  if hp.filter_action == "mask":
    keep = m & inb
    return np.where(keep, w, 0.0), keep
  lo = 0.0 if hp.filter_lower is None else hp.filter_lower
  return np.where(m, np.where(inb, w, np.clip(w, lo, hp.filter_upper)), 0.0), m


def _golden(logp, prox, behav, adv, mask, hp, prox_for_ratio=None):
  m = mask > 0
  f64 = lambda x: np.where(m, x.astype(np.float64), 0.0)
  lp, px, bh = f64(logp), f64(prox), f64(behav)
  w, keep = _np_weight(px - bh, m, hp)
  s, ds = _np_surr(np.exp(lp - px), adv, hp.eps_low, hp.eps_high, hp.dual_clip)
  return np.where(m, w * s, 0.0), np.where(m, w * ds / mask.sum(), 0.0), keep, w


FILTERS = [
    dict(filter_metric=None),
    dict(filter_metric=None, unfiltered_weight="one"),
    dict(),  # AReaL default: ratio, token, mask, upper 5
    dict(filter_lower=0.5, filter_upper=2.0),
    dict(filter_action="clamp", filter_lower=0.5, filter_upper=2.0),
    dict(filter_level="sequence", filter_agg="mean", filter_upper=1.3),
    dict(filter_level="sequence", filter_agg="max", filter_upper=2.0),
    dict(filter_level="sequence", filter_agg="sum", filter_action="clamp", filter_upper=1.2),
    dict(filter_metric="k1", filter_upper=0.5),
    dict(filter_metric="k2", filter_level="sequence", filter_agg="sum", filter_upper=0.6),
    dict(filter_metric="k3", filter_upper=0.3),
]


@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_golden_values_and_gradients(kw):
  case = _case()
  hp = dp.Hparams(**kw)
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, hp)
  val, grad, keep, w = _golden(*case, hp)
  m = case[4] > 0
  if kw.get("filter_metric", "ratio") is not None:
    # The filter really acts: some tokens masked or clamped, some untouched.
    lw = np.where(m, case[1].astype(np.float64), 0.0) - np.where(m, case[2].astype(np.float64), 0.0)
    w_open, _ = _np_weight(lw, m, dataclasses.replace(hp, filter_upper=np.inf, filter_lower=None))
    touched = (~keep & m) | (m & (w != w_open))
    assert 0 < touched.sum() < m.sum()
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert np.all(np.isfinite(g)) and np.all(g[~m] == 0) and np.all(g[~keep] == 0)
  assert g[1, 0] == 0 and g[1, 1] == 0  # PPO clip


def test_default_masks_weight_above_five_and_keeps_original_denominator():
  case = _case()
  inputs = _inputs(*case)
  hp = dp.Hparams()
  _, aux = SPEC.fn(inputs, hp)
  keep = np.asarray(aux["keep_BN"])
  assert keep[0, 1] == 0 and keep.sum() == case[4].sum() - 1  # only w = e^1.8 ≈ 6.05 > 5
  assert float(aux["behave_filtered_frac"][0]) == 1.0
  _, grad, keep, _ = _golden(*case, hp)
  np.testing.assert_allclose(_grad(inputs, hp), grad, rtol=1e-5, atol=1e-7)  # denominator = 10 tokens
  np.testing.assert_allclose(_grad(inputs, hp, drop_rejected=True), grad * 10 / 9, rtol=1e-5, atol=1e-7)


def test_dual_clip():
  lr = np.zeros((3, 4))
  lr[0, 0], lr[0, 1] = 1.5, np.log(2.0)  # r = 4.48 > c = 3 (capped) and r = 2 < c (unclipped for A<0)
  case = list(_case(lw=np.zeros((3, 4)), lr=lr))
  case[3] = np.full((3, 4), -1.0, np.float32)
  hp = dp.Hparams(dual_clip=3.0)
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, hp)
  val, grad, _, _ = _golden(*case, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(loss_BN[0, 0]), 3.0, rtol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert g[0, 0] == 0 and g[0, 1] != 0
  with pytest.raises(ValueError, match="dual_clip"):
    dp.Hparams(dual_clip=0.5)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kw", [dict(), dict(filter_level="sequence", filter_metric="k3", filter_upper=0.0)])
def test_on_policy_equals_pg(agg, kw):
  logp, _, _, adv, mask = _case()
  inputs = _inputs(logp, logp, logp, adv, mask)
  pg = losses.get("pg")
  np.testing.assert_allclose(_grad(inputs, dp.Hparams(**kw), agg), _grad(inputs, pg.Hparams(), agg, spec=pg),
                             rtol=1e-6, atol=1e-8)


def test_unfiltered_weight_one_is_plain_ppo_on_prox():
  """AReaL's no-rejection-sampling convention: the loss is the PPO surrogate on π_prox, no factor π_prox/μ."""
  logp, prox, behav, adv, mask = _case()
  hp = dp.Hparams(filter_metric=None, unfiltered_weight="one")
  assert dp.Hparams().unfiltered_weight == "ratio"
  loss_BN, _ = SPEC.fn(_inputs(logp, prox, behav, adv, mask), hp)
  want, _ = SPEC.fn(_inputs(logp, prox, prox, adv, mask), dp.Hparams(filter_metric=None))  # μ = π_prox: w = 1
  np.testing.assert_allclose(np.asarray(loss_BN), np.asarray(want), rtol=1e-6, atol=1e-7)
  # By hand, token (0,1): r = e^-0.1 in [0.8, 1.2], Â = 1 -> ℓ = -e^-0.1 (the "ratio" weight would add e^1.8).
  np.testing.assert_allclose(float(loss_BN[0, 1]), -np.exp(-0.1), rtol=1e-6)


def test_bad_hparams_raise():
  with pytest.raises(ValueError, match="unfiltered_weight"):
    dp.Hparams(unfiltered_weight="none")
  with pytest.raises(ValueError, match="filter_metric"):
    dp.Hparams(filter_metric="kl")
  with pytest.raises(ValueError, match="clamp"):
    dp.Hparams(filter_metric="k2", filter_action="clamp")
