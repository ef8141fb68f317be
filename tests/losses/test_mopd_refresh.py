"""Golden values/gradients for Open-MOPD's M4 loss `mopd_refresh` (the reward rebuilt from the current student)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import losses
from jaxrl_llm.distill import mopd
from tests.losses.test_opd_topk_kl import _case, _inputs

SPEC = losses.get("mopd_refresh")


def _golden(ids, tp, sq, mask):
  """Per-token value and d(Σ value)/d log q_k by hand (float64): r = (log p − log q)·softmax over the valid ids."""
  ok = (ids >= 0) & np.isfinite(tp) & np.isfinite(sq) & (mask[..., None] > 0)
  lp, lq = np.where(ok, tp, 0.0).astype(np.float64), np.where(ok, sq, 0.0).astype(np.float64)
  e = np.where(ok, np.exp(lq - np.where(ok, lq, -np.inf).max(-1, keepdims=True)), 0.0)
  pbar = np.where(ok, e / np.maximum(e.sum(-1, keepdims=True), 1e-300), 0.0)
  r = np.where(ok, (lp - lq) * pbar, 0.0)
  return -(r * lq).sum(-1) * (mask > 0), -r


def test_golden_value_and_gradient_and_masked_tokens_get_none():
  ids, tp, sq, mask = _case()
  inputs = _inputs(ids, tp, sq, mask)
  val, grad = _golden(ids, tp, sq, mask)
  loss_BN, aux = SPEC.fn(inputs, SPEC.Hparams())
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = jax.grad(lambda s: SPEC.fn(inputs.replace(student_topk_logp_BNk=s), SPEC.Hparams())[0].sum())(
      inputs.student_topk_logp_BNk)
  np.testing.assert_allclose(np.asarray(g), grad, rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(g)[1, 2] == 0) and np.asarray(g)[0, 1, 2] == 0  # a padded token, an invalid slot
  assert np.isfinite(float(aux["mopd_refresh_reward"][0]))


def test_the_reward_is_rebuilt_from_the_student_it_is_given():
  """M4's point: the same cached teacher scores give a different reward for a moved student (no stale reward), and
  a student equal to the teacher on the top-k ids gets reward 0 and no gradient."""
  ids, tp, sq, mask = _case()
  moved = sq + np.where(np.isfinite(sq), np.linspace(-0.5, 0.5, sq.size).reshape(sq.shape), 0).astype(np.float32)
  r0 = np.asarray(mopd.refresh_reward(jnp.asarray(sq), jnp.asarray(tp), jnp.asarray(mask)))
  r1 = np.asarray(mopd.refresh_reward(jnp.asarray(moved), jnp.asarray(tp), jnp.asarray(mask)))
  assert not np.allclose(r0, r1)
  same = _inputs(ids, tp, tp.copy(), mask)
  g = jax.grad(lambda s: SPEC.fn(same.replace(student_topk_logp_BNk=s), SPEC.Hparams())[0].sum())(
      same.student_topk_logp_BNk)
  np.testing.assert_allclose(np.asarray(g), 0.0, atol=1e-7)
