"""Golden values and gradients for HisPO (hierarchical masks + triplet clip), from the paper's formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import hispo as hispo_mod
from jaxrl_llm.types import LossInputs
from ._util import mismatch_inputs

SPEC = losses.get("hispo")
HP = hispo_mod.Hparams()
NORM_LEN = 8.0


def _grad(inputs, hp, mode="seq-mean-token-sum-norm", spec=SPEC):
  def f(lp):
    kw = {"norm_len": NORM_LEN} if mode == "seq-mean-token-sum-norm" else {}
    return losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode, **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  """log r_dis: row 0 passes both gates; row 1 passes the sequence gate (mean 0) but tokens 0 (e^0.6) and
  1 (e^-0.8) fail |r_dis - 1| < 0.5; row 2 fails the sequence gate (|e^0.04 - 1| > 0.01), -inf padding.
  Triplet cases on the total ratio r: (0,0) unclipped; (0,1) Â>0 above 1.28; (0,2) Â<0 below 0.8;
  (0,3) Â<0, r ≈ 3.7 > c = 3 (dual clip); (1,2) Â<0, r ≈ 2.5 < c (gradient flows); (1,3) Â>0, r ≈ 0.6
  (no lower clip for Â>0)."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0]], np.float32)
  lr = np.array([[0.1, 0.4, -0.5, 1.3], [0.0, 0.0, 0.7, -0.5], [0.1, -0.1, 0.0, 0.0]])  # log π_θ/π_old
  ldis = np.array([[0.002, -0.004, 0.001, 0.003], [0.6, -0.8, 0.2, 0.0], [0.05, 0.03, 0.0, 0.0]])  # log π_old/μ
  adv = np.array([[1.0, 1.0, -1.0, -1.0], [1.0, 1.0, -1.0, 0.5], [0.8] * 4], np.float32)
  mask = np.ones((3, 4), np.float32)
  mask[2, 2:] = 0
  prox = (logp - lr).astype(np.float32)
  behav = (prox - ldis).astype(np.float32)
  for x in (logp, prox, behav):
    x[2, 2:] = -np.inf
  return logp, prox, behav, adv, mask


_inputs = mismatch_inputs


def _triplet(r, a, hp):
  """LongCat triplet clip objective (to maximise) and its derivative w.r.t. log π_θ, written literally."""
  pos_clip = np.minimum(r, 1 + hp.eps_pos_high) * a
  pos = np.minimum(r * a, pos_clip)
  d_pos = np.where(r * a <= pos_clip, a * r, 0.0)
  inner_clip = np.clip(r, 1 - hp.eps_neg_low, 1 + hp.eps_pos_high) * a
  inner = np.minimum(r * a, inner_clip)
  d_inner = np.where(r * a <= inner_clip, a * r, 0.0)
  neg = np.maximum(inner, hp.eps_neg_high * a)
  d_neg = np.where(inner >= hp.eps_neg_high * a, d_inner, 0.0)
  return np.where(a >= 0, pos, neg), np.where(a >= 0, d_pos, d_neg)


def _golden(logp, prox, behav, adv, mask, hp):
  m = mask > 0
  f64 = lambda x: np.where(m, x.astype(np.float64), 0.0)
  lp, px, bh = f64(logp), f64(prox), f64(behav)
  r_dis = np.exp(px - bh)
  L = np.maximum(m.sum(1, keepdims=True), 1)
  seq_ok = np.abs(np.exp((px - bh).sum(1, keepdims=True) / L) - 1) < hp.delta_seq
  h = m & seq_ok & (np.abs(r_dis - 1) < hp.delta_tok)
  if hp.clip_ratio == "total":
    obj, d = _triplet(np.exp(lp - bh), adv, hp)
    w = h * 1.0
  else:
    obj, d = _triplet(np.exp(lp - px), adv, hp)
    w = h * r_dis
  n_seq = (m.sum(1) > 0).sum()
  return np.where(m, -w * obj, 0.0), np.where(m, -w * d / (n_seq * NORM_LEN), 0.0), h


@pytest.mark.parametrize("clip_ratio", ["total", "stale"])
def test_golden_values_and_gradients(clip_ratio):
  case = _case()
  hp = hispo_mod.Hparams(clip_ratio=clip_ratio)
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, hp)
  val, grad, h = _golden(*case, hp)
  np.testing.assert_array_equal(h, np.array([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]], bool))
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), h.astype(np.float32))
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert np.all(np.isfinite(g)) and np.all(g[~h] == 0)
  # Clip / dual clip kill the gradient; the unclipped A<0 and the A>0-below-1 tokens keep it.
  assert g[0, 1] == 0 and g[0, 2] == 0 and g[0, 3] == 0
  assert g[0, 0] != 0 and g[1, 2] != 0 and g[1, 3] != 0
  assert float(aux["seq_masked_frac"][0]) == 1.0 and float(aux["seq_masked_frac"][1]) == 3.0
  assert float(aux["tok_masked_frac"][0]) == 2.0


def test_dual_clip_value():
  loss_BN, _ = SPEC.fn(_inputs(*_case()), HP)
  np.testing.assert_allclose(float(loss_BN[0, 3]), 3.0, rtol=1e-6)  # -Â·c with Â = -1, c = 3


@pytest.mark.parametrize("clip_ratio", ["total", "stale"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_on_policy_equals_pg(clip_ratio, agg):
  logp, _, _, adv, mask = _case()
  inputs = _inputs(logp, logp, logp, adv, mask)
  pg = losses.get("pg")
  got = _grad(inputs, hispo_mod.Hparams(clip_ratio=clip_ratio), agg)
  np.testing.assert_allclose(got, _grad(inputs, pg.Hparams(), agg, spec=pg), rtol=1e-6, atol=1e-8)


def test_bad_hparams_raise():
  with pytest.raises(ValueError, match="clip_ratio"):
    hispo_mod.Hparams(clip_ratio="dis")
  with pytest.raises(ValueError, match="eps_neg_high"):
    hispo_mod.Hparams(eps_neg_high=1.0)
