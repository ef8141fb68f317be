"""Golden values/gradients for S²D-OPD: Direct-OPD reward, top-ρ JSD selection, k3 anchor, adaptive α."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import s2d_opd as mod
from jaxrl_llm.types import LossInputs
from tests.losses.test_opd_reverse_kl_full import np_logsoftmax

SPEC = losses.get("s2d_opd")
B, N, k, V = 2, 10, 3, 7


def _case(seed=0):
  rng = np.random.default_rng(seed)
  ls = np_logsoftmax(rng.normal(0, 1.5, (B, N, V)))
  ids = np.argsort(-ls, -1)[..., :k].astype(np.int32)  # the student's top-k
  g = lambda a: np.take_along_axis(a, ids, -1).astype(np.float32)
  lq = g(ls)
  lT = g(np_logsoftmax(rng.normal(0, 1.5, (B, N, V))))
  lR = g(np_logsoftmax(rng.normal(0, 1.5, (B, N, V))))
  logp = rng.uniform(-2, -0.1, (B, N)).astype(np.float32)
  ref = (logp + rng.normal(0, 0.3, (B, N))).astype(np.float32)
  mask = np.ones((B, N), np.float32)
  mask[1, 7:] = 0  # row 1 has 7 valid states
  for x in (lq, lT, lR):
    x[1, 7:] = -np.inf
  logp[1, 7:], ref[1, 7:] = -np.inf, -np.inf
  return ids, lq, lT, lR, logp, ref, mask


def _inputs(ids, lq, lT, lR, logp, ref, mask, alpha=2.0):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.zeros(mask.shape),
                    ref_logp_BN=jnp.asarray(ref), teacher_topk_ids_BNk=jnp.asarray(ids),
                    teacher_topk_logp_BNk=jnp.asarray(lT), teacher_ref_topk_logp_BNk=jnp.asarray(lR),
                    student_topk_logp_BNk=jnp.asarray(lq), state=jnp.asarray(alpha, jnp.float32))


def _np_jsd(a, b):
  m = 0.5 * (a + b)
  kl = lambda x: np.where(x > 0, x * np.log(np.where(x > 0, x, 1) / np.where(x > 0, m, 1)), 0).sum(-1)
  return 0.5 * kl(a) + 0.5 * kl(b)


def _golden(ids, lq, lT, lR, logp, ref, mask, hp, alpha):
  m = mask > 0
  z = lambda x: np.where(m[..., None], x, 0.0).astype(np.float64)
  q, t, r = z(lq), z(lT), z(lR)
  pbar = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
  delta = t - r
  coef = pbar * delta
  pt, pr = np.exp(t), np.exp(r)
  score = _np_jsd(np.concatenate([pt, 1 - pt.sum(-1, keepdims=True)], -1),
                  np.concatenate([pr, 1 - pr.sum(-1, keepdims=True)], -1))
  keep = np.zeros((B, N), bool)
  for b in range(B):
    n = int(m[b].sum())
    k = max(1, int(np.ceil(hp.rho * n - 1e-9)))
    order = sorted(np.flatnonzero(m[b]), key=lambda t_: (-score[b, t_], t_))
    keep[b, order[:k]] = True
  d = np.where(m, ref.astype(np.float64), 0) - np.where(m, logp.astype(np.float64), 0)
  k3 = np.exp(d) - d - 1
  val = np.where(keep, -(coef * q).sum(-1) + alpha * k3, 0.0)
  dq = np.where(keep[..., None], -coef, 0.0)
  dlogp = np.where(keep, alpha * (1 - np.exp(d)), 0.0)
  rbar = coef.sum(-1)[m].mean()
  new_alpha = np.clip(alpha * (1 + hp.alpha_eps * np.sign(rbar)), hp.alpha_min, hp.alpha_max)
  return val, dq, dlogp, keep, new_alpha


@pytest.mark.parametrize("rho", [0.1, 0.3, 1.0])
def test_golden_values_gradients_selection_and_alpha(rho):
  case = _case()
  hp = mod.Hparams(rho=rho)
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, hp)
  val, dq, dlogp, keep, new_alpha = _golden(*case, hp, 2.0)
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(aux["state"]), new_alpha, rtol=1e-6)
  mask = case[-1]
  red = lambda x: losses.reduce(x, inputs.mask_BN, "token-mean", keep_BN=aux["keep_BN"], drop_rejected=True)
  gq = jax.grad(lambda s: red(SPEC.fn(inputs.replace(student_topk_logp_BNk=s), hp)[0]))(inputs.student_topk_logp_BNk)
  gl = jax.grad(lambda l: red(SPEC.fn(inputs.replace(logp_BN=l), hp)[0]))(inputs.logp_BN)
  nk = keep.sum()
  np.testing.assert_allclose(np.asarray(gq), dq / nk, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(gl), dlogp / nk, rtol=1e-5, atol=1e-7)
  assert np.isfinite(np.asarray(gq)).all() and np.all(np.asarray(gl)[mask == 0] == 0)
  # Mask size per response is max(1, ⌈ρ·n⌉): rows have 10 and 7 valid states.
  np.testing.assert_array_equal(keep.sum(-1), [max(1, int(np.ceil(rho * 10 - 1e-9))), max(1, int(np.ceil(rho * 7 - 1e-9)))])


def test_rho_one_is_direct_opd_on_every_valid_state():
  case = _case(1)
  _, aux = SPEC.fn(_inputs(*case), mod.Hparams(rho=1.0))
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), case[-1])


def test_single_valid_token_is_kept_and_alpha_clips():
  ids, lq, lT, lR, logp, ref, mask = _case(2)
  mask[0] = 0
  mask[0, 4] = 1
  _, aux = SPEC.fn(_inputs(ids, lq, lT, lR, logp, ref, mask, alpha=2.5), mod.Hparams())
  assert np.asarray(aux["keep_BN"])[0].sum() == 1 and np.asarray(aux["keep_BN"])[0, 4] == 1
  assert 0.5 <= float(aux["state"]) <= 2.5
  _, aux_fixed = SPEC.fn(_inputs(ids, lq, lT, lR, logp, ref, mask, alpha=1.7), mod.Hparams(adaptive_alpha=False))
  np.testing.assert_allclose(float(aux_fixed["state"]), 1.7)


def test_jsd_on_k_plus_1_classes_lower_bounds_full_jsd():
  rng = np.random.default_rng(3)
  la, lb = np_logsoftmax(rng.normal(0, 2, (50, V))), np_logsoftmax(rng.normal(0, 2, (50, V)))
  full = _np_jsd(np.exp(la), np.exp(lb))
  for k in (1, 3, 6):
    ids = np.argsort(-la, -1)[:, :k]
    got = np.asarray(mod.jsd_k_plus_1(jnp.asarray(np.take_along_axis(la, ids, -1), jnp.float32),
                                      jnp.asarray(np.take_along_axis(lb, ids, -1), jnp.float32),
                                      jnp.ones((50, k), bool)))
    assert np.all(got <= full + 1e-5), k
  ids = np.argsort(-la, -1)
  got = mod.jsd_k_plus_1(jnp.asarray(np.take_along_axis(la, ids, -1), jnp.float32),
                         jnp.asarray(np.take_along_axis(lb, ids, -1), jnp.float32), jnp.ones((50, V), bool))
  np.testing.assert_allclose(np.asarray(got), full, rtol=1e-4, atol=1e-6)  # k = V: equal


def test_ties_break_stably_toward_earlier_positions():
  score = jnp.asarray([[0.5, 0.9, 0.9, 0.1, 0.9]])
  keep = mod.top_rho_mask(score, jnp.ones((1, 5)), 0.4)
  np.testing.assert_array_equal(np.asarray(keep), [[False, True, True, False, False]])


def test_empty_mask_zero_grad():
  ids, lq, lT, lR, logp, ref, mask = _case()
  inputs = _inputs(ids, lq, lT, lR, logp, ref, np.zeros_like(mask))
  loss_BN, aux = SPEC.fn(inputs, mod.Hparams())
  assert float(jnp.abs(loss_BN).sum()) == 0.0 and float(aux["state"]) == 2.0
  g = jax.grad(lambda s: losses.reduce(SPEC.fn(inputs.replace(student_topk_logp_BNk=s), mod.Hparams())[0],
                                       inputs.mask_BN))(inputs.student_topk_logp_BNk)
  np.testing.assert_array_equal(np.asarray(g), 0.0)
