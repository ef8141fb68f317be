"""Golden values/gradients for the top-k sparse KL (forward, reverse, skewed; with/without residual)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import opd_topk_kl as mod
from jaxrl_llm.types import LossInputs
from tests.losses.test_opd_reverse_kl_full import np_kl, np_logsoftmax

SPEC = losses.get("opd_topk_kl")
B, N, k, V = 2, 3, 3, 7


def _case(seed=0):
  """Teacher top-3 ids/log-probs and π_θ at the same ids (from random full distributions); row 1 pos 2
  is padding (-inf); slot 2 at (0, 1) is invalid (id −1, -inf teacher log-prob)."""
  rng = np.random.default_rng(seed)
  lt = np_logsoftmax(rng.normal(0, 1.5, (B, N, V)))
  ls = np_logsoftmax(rng.normal(0, 1.5, (B, N, V)))
  ids = np.argsort(-lt, -1)[..., :k].astype(np.int32)
  tp = np.take_along_axis(lt, ids, -1).astype(np.float32)
  sq = np.take_along_axis(ls, ids, -1).astype(np.float32)
  mask = np.ones((B, N), np.float32)
  mask[1, 2] = 0
  tp[1, 2], sq[1, 2] = -np.inf, -np.inf
  ids[0, 1, 2], tp[0, 1, 2] = -1, -np.inf
  return ids, tp, sq, mask


def _inputs(ids, tp, sq, mask):
  return LossInputs(logp_BN=jnp.zeros(mask.shape), mask_BN=jnp.asarray(mask), adv_BN=jnp.zeros(mask.shape),
                    teacher_topk_ids_BNk=jnp.asarray(ids), teacher_topk_logp_BNk=jnp.asarray(tp),
                    student_topk_logp_BNk=jnp.asarray(sq))


def _grad(inputs, hp, mode="token-mean"):
  f = lambda s: losses.reduce(SPEC.fn(inputs.replace(student_topk_logp_BNk=s), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.student_topk_logp_BNk))


def _golden(ids, tp, sq, mask, hp):
  """Value and d value / d log q_k by hand (float64)."""
  ok = (ids >= 0) & np.isfinite(tp) & np.isfinite(sq) & (mask[..., None] > 0)
  lp, lq = np.where(ok, tp, 0.0).astype(np.float64), np.where(ok, sq, 0.0).astype(np.float64)
  p, q = np.where(ok, np.exp(lp), 0.0), np.where(ok, np.exp(lq), 0.0)
  fwd, rev = p * (lp - lq), q * (lq - lp)
  dfwd, drev = -p, q * (lq - lp + 1.0)
  if hp.residual:
    pr, qr = 1 - p.sum(-1), 1 - q.sum(-1)
    lpr, lqr = np.log(pr), np.log(qr)
    fwd_r, rev_r = pr * (lpr - lqr), qr * (lqr - lpr)
    # ∂q_r/∂log q_k = −q_k; ∂log q_r/∂log q_k = −q_k/q_r.
    dfwd = dfwd + (pr / qr)[..., None] * q
    drev = drev - q * (lqr - lpr + 1.0)[..., None]
  else:
    fwd_r = rev_r = 0.0
  a = hp.skew_alpha
  val = {"forward": fwd.sum(-1) + fwd_r, "reverse": rev.sum(-1) + rev_r,
         "skewed": a * (fwd.sum(-1) + fwd_r) + (1 - a) * (rev.sum(-1) + rev_r)}[hp.direction]
  dv = {"forward": dfwd, "reverse": drev, "skewed": a * dfwd + (1 - a) * drev}[hp.direction]
  m = mask > 0
  return np.where(m, val, 0.0), np.where(ok, dv, 0.0) / m.sum()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("direction", ["forward", "reverse", "skewed"])
def test_golden_values_and_gradients(direction, residual):
  case = _case()
  hp = mod.Hparams(direction=direction, residual=residual, skew_alpha=0.3)
  inputs = _inputs(*case)
  loss_BN, _ = SPEC.fn(inputs, hp)
  val, grad = _golden(*case, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-4, atol=1e-6)
  assert np.isfinite(g).all() and np.all(g[1, 2] == 0) and g[0, 1, 2] == 0


def _full_vocab_case(seed):
  rng = np.random.default_rng(seed)
  lt = np_logsoftmax(rng.normal(0, 1.5, (B, N, V)))
  ls = np_logsoftmax(rng.normal(0, 1.5, (B, N, V)))
  return lt, ls


@pytest.mark.parametrize("residual", [False, True])
def test_k_equals_v_equals_dense(residual):
  lt, ls = _full_vocab_case(1)
  ids = np.argsort(-lt, -1).astype(np.int32)  # all V ids, teacher order
  mask = np.ones((B, N), np.float32)
  inputs = _inputs(ids, np.take_along_axis(lt, ids, -1).astype(np.float32),
                   np.take_along_axis(ls, ids, -1).astype(np.float32), mask)
  for direction, want in (("forward", np_kl(lt, ls)), ("reverse", np_kl(ls, lt))):
    got = SPEC.fn(inputs, mod.Hparams(direction=direction, residual=residual))[0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-6)


def test_residual_bucket_lower_bounds_full_kl_and_improves_on_no_residual_forward():
  lt, ls = _full_vocab_case(2)
  ids = np.argsort(-lt, -1)[..., :k].astype(np.int32)
  mask = np.ones((B, N), np.float32)
  inputs = _inputs(ids, np.take_along_axis(lt, ids, -1).astype(np.float32),
                   np.take_along_axis(ls, ids, -1).astype(np.float32), mask)
  for direction, full in (("forward", np_kl(lt, ls)), ("reverse", np_kl(ls, lt))):
    with_r = np.asarray(SPEC.fn(inputs, mod.Hparams(direction=direction, residual=True))[0])
    assert np.all(with_r <= full + 1e-6) and np.all(with_r >= -1e-6), direction  # data processing


def test_token_clip_clamps_each_element():
  case = _case(3)
  inputs = _inputs(*case)
  hp = mod.Hparams(direction="forward", token_clip=0.05)
  ids, tp, sq, mask = case
  ok = (ids >= 0) & np.isfinite(tp) & np.isfinite(sq) & (mask[..., None] > 0)
  el = np.where(ok, np.exp(np.where(ok, tp, 0)) * (np.where(ok, tp, 0) - np.where(ok, sq, 0)), 0.0)
  want = np.where(mask > 0, np.clip(el, -0.05, 0.05).sum(-1), 0.0)
  np.testing.assert_allclose(np.asarray(SPEC.fn(inputs, hp)[0]), want, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  clamped = ok & (np.abs(el) >= 0.05)
  assert clamped.any() and np.all(g[clamped] == 0)


def test_empty_mask_and_bad_direction():
  ids, tp, sq, mask = _case()
  inputs = _inputs(ids, tp, sq, np.zeros_like(mask))
  for residual in (False, True):
    np.testing.assert_array_equal(_grad(inputs, mod.Hparams(residual=residual)), 0.0)
  with pytest.raises(ValueError, match="direction"):
    SPEC.fn(inputs, mod.Hparams(direction="sideways"))
