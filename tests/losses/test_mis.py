"""Golden values and gradients for masked importance sampling / rejection sampling (MIS)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import mis as mis_mod
from jaxrl_llm.types import LossInputs
from ._util import mismatch_inputs

SPEC = losses.get("mis")


def _grad(inputs, hp, mode="token-mean", spec=SPEC, **kw):
  def f(lp):
    out = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(out[0], inputs.mask_BN, mode, keep_BN=out[1].get("keep_BN"), **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


LRHO = np.array([[0.0, 1.2, -0.5, 0.3], [0.9, -1.0, 0.2, 0.0], [0.1, 0.4, 0.0, 0.0]])  # log π_old/μ


def _case(lrho=LRHO):
  """Row 1 clips tokens 0 and 1 (A>0, r>1.2; A<0, r<0.8); row 2 has -inf padding after two tokens."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0]], np.float32)
  lr = np.array([[0.05, -0.1, 0.0, 0.1], [0.3, -0.3, 0.1, -0.05], [0.25, -0.02, 0.0, 0.0]])  # log π_θ/π_old
  adv = np.array([[1.0] * 4, [1.5, -0.7, -2.0, 0.4], [-0.8] * 4], np.float32)
  mask = np.ones((3, 4), np.float32)
  mask[2, 2:] = 0
  prox = (logp - lr).astype(np.float32)
  behav = (prox - lrho).astype(np.float32)
  for x in (logp, prox, behav):
    x[2, 2:] = -np.inf
  return logp, prox, behav, adv, mask


_inputs = mismatch_inputs


def _np_surr(r, a, el, eh):
  unc, clp = -a * r, -a * np.clip(r, 1 - el, 1 + eh)
  use_clip = clp > unc
  return np.where(use_clip, clp, unc), np.where(use_clip, 0.0, -a * r)


def _np_keep(lrho, mask, hp):
  m = mask > 0
  lr = np.where(m, lrho, 0.0)
  L = m.sum(1, keepdims=True)
  keep = m.copy()
  for crit, lo, hi in zip(hp.criteria, hp.lower, hp.upper):
    level, metric = crit.rsplit("_", 1)
    d = {"k1": lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - lr - 1}[metric]
    d = np.where(m, d, 0.0)
    if level == "token":
      s = d
    elif level == "seq_sum":
      s = d.sum(1, keepdims=True)
    elif level == "seq_mean":
      s = d.sum(1, keepdims=True) / np.maximum(L, 1)
    else:
      s = np.where(L > 0, np.where(m, d, -np.inf).max(1, keepdims=True), 0.0)
    ok = ((np.exp(s) >= lo) & (np.exp(s) <= hi)) if metric == "k1" else (s <= hi)
    keep = keep & np.broadcast_to(ok, m.shape)
  if hp.veto is not None:
    keep = keep & ~((m & (np.exp(lr) < hp.veto)).any(1, keepdims=True))
  return keep


def _golden(logp, prox, behav, adv, mask, hp):
  m = mask > 0
  f64 = lambda x: np.where(m, x.astype(np.float64), 0.0)
  lp, px, bh = f64(logp), f64(prox), f64(behav)
  lrho = (px - bh) if hp.mode == "decoupled" else (lp - bh)
  keep = _np_keep(lrho, mask, hp)
  if hp.is_level is None:
    w = np.ones_like(lrho)
  else:
    w = np.exp(lrho if hp.is_level == "token" else np.broadcast_to(lrho.sum(1, keepdims=True), lrho.shape))
    if hp.is_cap is not None:
      w = np.minimum(w, hp.is_cap)
  w = keep * w
  if hp.mode == "decoupled":
    s, ds = _np_surr(np.exp(lp - px), adv, hp.eps_low, hp.eps_high)
    val, d = w * s, w * ds
  else:
    val, d = -w * adv * lp, -w * adv
  return np.where(m, val, 0.0), np.where(m, d / mask.sum(), 0.0), keep


CRITERIA = [
    (("token_k1",), (0.5,), (2.0,)),
    (("seq_sum_k1",), (0.5,), (2.0,)),
    (("seq_mean_k1",), (0.9,), (1.2,)),
    (("token_k2",), (0.0,), (0.1,)),
    (("seq_sum_k2",), (0.0,), (0.5,)),
    (("seq_mean_k3",), (0.0,), (0.05,)),
    (("seq_max_k3",), (0.0,), (0.6,)),
    (("token_k1", "seq_sum_k1"), (0.5, 0.5), (2.0, 2.0)),
]


@pytest.mark.parametrize("crit", CRITERIA, ids=lambda c: "+".join(c[0]))
@pytest.mark.parametrize("is_level,is_cap", [(None, None), ("token", None), ("sequence", 1.5)])
def test_golden_values_and_gradients(crit, is_level, is_cap):
  case = _case()
  hp = mis_mod.Hparams(criteria=crit[0], lower=crit[1], upper=crit[2], is_level=is_level, is_cap=is_cap)
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, hp)
  val, grad, keep = _golden(*case, hp)
  mask = case[4]
  # The criterion really rejects something and keeps something.
  assert 0 < keep.sum() < mask.sum()
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  np.testing.assert_allclose(float(aux["masked_frac"][0]), mask.sum() - keep.sum())
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert np.all(g[~keep] == 0) and np.all(np.isfinite(g))


def test_default_is_token_mis():
  hp = mis_mod.Hparams()
  assert hp.criteria == ("token_k1",) and hp.lower == (0.5,) and hp.upper == (2.0,) and hp.is_level == "token"
  case = _case()
  _, _, keep = _golden(*case, hp)
  # ρ = e^1.2, e^0.9 above 2 and e^-1 below 0.5 are rejected.
  want = np.array([[1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]], bool)
  np.testing.assert_array_equal(keep, want)


def test_k1_direction_thresholds_the_ratio_itself():
  # Asymmetric band [0.5, 1.5]: ρ = 1.8 is rejected and ρ = 0.6 kept. (verl HEAD's -log ρ rule would
  # accept ρ ∈ [1/1.5, 1/0.5] = [0.667, 2]: the opposite on both tokens.)
  lrho = np.zeros((3, 4))
  lrho[0, 0], lrho[0, 1] = np.log(1.8), np.log(0.6)
  hp = mis_mod.Hparams(lower=(0.5,), upper=(1.5,))
  _, aux = SPEC.fn(_inputs(*_case(lrho)), hp)
  keep = np.asarray(aux["keep_BN"])
  assert keep[0, 0] == 0 and keep[0, 1] == 1


def test_catastrophic_veto_rejects_whole_sequence():
  lrho = LRHO.copy()
  lrho[1, 2] = -10.0  # ρ ≈ 4.5e-5 < 1e-4
  case = _case(lrho)
  hp = mis_mod.Hparams(criteria=("token_k1",), lower=(0.0,), upper=(10.0,), veto=1e-4)
  _, aux = SPEC.fn(_inputs(*case), hp)
  keep = np.asarray(aux["keep_BN"])
  np.testing.assert_array_equal(keep, case[4] * np.array([[1], [0], [1]]))
  val, grad, _ = _golden(*case, hp)
  np.testing.assert_allclose(_grad(_inputs(*case), hp), grad, rtol=1e-5, atol=1e-7)
  assert np.all(_grad(_inputs(*case), hp)[1] == 0)


@pytest.mark.parametrize("crit", CRITERIA[:3], ids=lambda c: "+".join(c[0]))
def test_bypass_golden(crit):
  case = _case()
  hp = mis_mod.Hparams(criteria=crit[0], lower=crit[1], upper=crit[2], mode="bypass")
  inputs = _inputs(*case)
  val, grad, keep = _golden(*case, hp)
  np.testing.assert_array_equal(np.asarray(SPEC.fn(inputs, hp)[1]["keep_BN"]), keep.astype(np.float32))
  np.testing.assert_allclose(_grad(inputs, hp), grad, rtol=1e-5, atol=1e-7)


def test_drop_rejected_shrinks_denominator():
  case = _case()
  hp = mis_mod.Hparams()
  inputs = _inputs(*case)
  _, grad, keep = _golden(*case, hp)
  g = _grad(inputs, hp, drop_rejected=True)
  np.testing.assert_allclose(g, grad * case[4].sum() / keep.sum(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_on_policy_equals_pg(mode, agg):
  logp, _, _, adv, mask = _case()
  inputs = _inputs(logp, logp, logp, adv, mask)
  pg = losses.get("pg")
  hp = mis_mod.Hparams(criteria=("token_k1", "seq_mean_k1", "seq_max_k3"), lower=(0.5, 0.999, 0.0),
                       upper=(2.0, 1.001, 0.01), veto=1e-4, is_level="sequence", mode=mode)
  np.testing.assert_allclose(_grad(inputs, hp, agg), _grad(inputs, pg.Hparams(), agg, spec=pg), rtol=1e-6, atol=1e-8)


def test_bad_hparams_raise():
  with pytest.raises(ValueError, match="criteria"):
    mis_mod.Hparams(criteria=("seq_max_k1",))
  with pytest.raises(ValueError, match="same length"):
    mis_mod.Hparams(criteria=("token_k1", "token_k2"))
  assert mis_mod.Hparams(criteria=["token_k2"], lower=[0.0], upper=[1.0]).criteria == ("token_k2",)
