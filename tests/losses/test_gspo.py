"""Golden values and gradients for GSPO (GSPO-token form)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import gspo as gspo_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("gspo")
HP = gspo_mod.Hparams()


def _grad(inputs, hp, mode="seq-mean-token-mean", spec=SPEC):
  def f(lp):
    return losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _case():
  # Rows: (0) unclipped A>0; (1) s above 1+ε_r with A>0 -> clipped; (2) s below 1-ε_l with A<0 -> clipped;
  # (3) A<0 with s>1+ε_r -> not clipped (pull-back); (4) -inf padding after two tokens; (5) empty.
  logp = np.full((6, 4), -1.0, np.float32)
  lr = np.array([
      [1e-4, -2e-4, 3e-4, 0.0],
      [1e-3, 2e-3, 0.0, 1e-3],
      [-2e-3, -1e-3, 0.0, -1e-3],
      [2e-3, 1e-3, 1e-3, 0.0],
      [5e-5, 5e-5, 0.0, 0.0],
      [0.0, 0.0, 0.0, 0.0],
  ], np.float32)
  prox = (logp - lr).astype(np.float32)
  mask = np.ones((6, 4), np.float32)
  mask[4, 2:] = 0
  mask[5] = 0
  logp[4, 2:] = -np.inf
  prox[4, 2:] = -np.inf
  logp[5] = -np.inf
  adv = np.array([1.0, 2.0, -1.5, -0.5, 0.7, 3.0], np.float32)[:, None] * np.ones((1, 4), np.float32)
  return logp, prox, mask, adv


def _golden(logp, prox, mask, adv, eps_l, eps_h, cap=10.0):
  B, N = logp.shape
  val = np.zeros((B, N))
  grad = np.zeros((B, N))
  L = mask.sum(1)
  n_seq = (L > 0).sum()
  for b in range(B):
    if L[b] == 0:
      continue
    with np.errstate(invalid="ignore"):
      d = np.where(mask[b] > 0, np.nan_to_num(logp[b].astype(np.float64) - prox[b]), 0.0)
    log_s = d.sum() / L[b]
    s = np.exp(min(log_s, cap))
    for t in range(N):
      if mask[b, t] == 0:
        continue
      a = adv[b, t]
      unc, clp = -a * s, -a * np.clip(s, 1 - eps_l, 1 + eps_h)
      val[b, t] = max(unc, clp)
      flows = (clp <= unc) and log_s <= cap
      grad[b, t] = (-a * s if flows else 0.0) / L[b] / n_seq
  return val, grad


def _inputs(logp, prox, mask, adv):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    prox_logp_BN=jnp.asarray(prox))


def test_golden_values_and_gradients():
  logp, prox, mask, adv = _case()
  inputs = _inputs(logp, prox, mask, adv)
  loss_BN, aux = SPEC.fn(inputs, HP)
  val, grad = _golden(logp, prox, mask, adv, HP.eps_low, HP.eps_high)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, HP)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  # The clip really triggered on rows 1 and 2 (zero gradient) and not on 0, 3, 4.
  assert np.all(g[1] == 0) and np.all(g[2] == 0)
  assert np.all(g[0] != 0) and np.all(g[3] != 0) and np.all(g[4, :2] != 0)
  assert np.all(np.isfinite(g)) and np.all(g[~(mask > 0)] == 0)
  clip_sum, clip_cnt = aux["clip_frac"]
  assert float(clip_cnt) == mask.sum() and float(clip_sum) == 8.0


def test_sequence_objective_equivalence():
  """GSPO-token under seq-mean-token-mean has the gradient of the sequence surrogate (1/B')Σ -Â_i·s_i."""
  logp, prox, mask, adv = _case()
  hp = gspo_mod.Hparams(eps_low=0.2, eps_high=0.2)
  inputs = _inputs(logp, prox, mask, adv)

  def seq_obj(lp):
    d = jnp.where(mask > 0, lp - prox, 0.0)
    s = jnp.exp(d.sum(1) / jnp.maximum(mask.sum(1), 1))
    has = mask.sum(1) > 0
    return jnp.where(has, -adv[:, 0] * s, 0.0).sum() / has.sum()

  want = jax.grad(seq_obj)(jnp.where(mask > 0, logp, 0.0))
  np.testing.assert_allclose(_grad(inputs, hp), np.asarray(want), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_on_policy_equals_pg(mode):
  logp, _, mask, adv = _case()
  inputs = _inputs(logp, logp, mask, adv)
  pg = losses.get("pg")
  want = _grad(inputs, pg.Hparams(), mode, spec=pg)
  np.testing.assert_allclose(_grad(inputs, HP, mode), want, rtol=1e-6, atol=1e-8)


def test_log_ratio_clamp_kills_gradient():
  # A<0 with a huge sequence ratio: unclipped branch, but log s > 10 is clamped (verl), so no gradient.
  logp = np.array([[-0.5, -0.5]], np.float32)
  prox = np.array([[-15.0, -15.0]], np.float32)
  mask = np.ones((1, 2), np.float32)
  adv = np.full((1, 2), -1.0, np.float32)
  inputs = _inputs(logp, prox, mask, adv)
  loss_BN, _ = SPEC.fn(inputs, HP)
  np.testing.assert_allclose(np.asarray(loss_BN), np.exp(10.0), rtol=1e-5)
  assert np.all(_grad(inputs, HP) == 0)


def test_seq_advantage_option_uses_masked_mean():
  logp, prox, mask, adv = _case()
  adv_tok = adv * np.array([1.0, 0.5, 1.5, 1.0], np.float32)  # per-token advantages
  hp = gspo_mod.Hparams(eps_low=0.2, eps_high=0.2, seq_advantage=True)
  a = _grad(_inputs(logp, prox, mask, adv_tok), hp)
  seq_adv = (adv_tok * mask).sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1)
  b = _grad(_inputs(logp, prox, mask, np.broadcast_to(seq_adv, adv.shape).astype(np.float32)), hp)
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
