"""Golden values and gradients for μ-GRPO (relaxed clip + negative-advantage veto)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import mu_grpo as mu_mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("mu_grpo")

# log r per token. Row 0 (Â<0): trigger at t=1 (r = e^-10 < 1e-4) and a later trigger at t=3.
# Row 1 (Â>0): same tiny ratio, never a trigger (veto is for negative responses only); r = e^2 > 5 clips.
# Row 2 (Â<0): no trigger (e^-9 = 1.2e-4 > 1e-4); padding at t=4.
LR = np.array([[0.1, -10.0, 0.2, -12.0, 0.3],
               [0.0, -10.0, 2.0, 0.1, -0.1],
               [0.05, -9.0, 0.1, 0.0, 0.0]], np.float32)
ADV = np.array([[-1.0] * 5, [2.0] * 5, [-0.5] * 5], np.float32)


def _inputs(lr=LR):
  logp = np.full(lr.shape, -1.0, np.float32)
  behav = (logp - lr).astype(np.float32)
  mask = np.ones(lr.shape, np.float32)
  mask[2, 4] = 0
  logp[2, 4] = -np.inf
  behav[2, 4] = -np.inf
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(ADV),
                    behavior_logp_BN=jnp.asarray(behav))


def _grad(inputs, hp, spec=SPEC, **kw):
  def f(lp):
    loss_BN, aux = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(loss_BN, inputs.mask_BN, "token-mean", keep_BN=aux.get("keep_BN"), **kw)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


KEEP = {
    "suffix_excl_trigger": [[1, 1, 0, 0, 0], [1] * 5, [1, 1, 1, 1, 0]],
    "nontrigger_suffix": [[1, 1, 0, 1, 0], [1] * 5, [1, 1, 1, 1, 0]],
    "sequence": [[0] * 5, [1] * 5, [1, 1, 1, 1, 0]],
}


@pytest.mark.parametrize("scope", sorted(KEEP))
def test_golden_values_and_gradients(scope):
  hp = mu_mod.Hparams(veto_scope=scope)
  inputs = _inputs()
  loss_BN, aux = SPEC.fn(inputs, hp)
  keep = np.array(KEEP[scope], bool)
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"]), keep.astype(np.float32))
  r = np.exp(LR.astype(np.float64))
  rc = np.clip(r, 0.0, 5.0)
  unc, clp = -ADV * r, -ADV * rc
  use_clip = clp > unc
  np.testing.assert_allclose(np.asarray(loss_BN), np.where(keep, np.where(use_clip, clp, unc), 0),
                             rtol=1e-5, atol=1e-7)
  assert use_clip[1, 2] and not use_clip[keep & (np.arange(5) != 2)].any()
  for drop, den in [(False, 14.0), (True, keep.sum())]:
    g = _grad(inputs, hp, drop_rejected=drop)
    np.testing.assert_allclose(g, np.where(keep & ~use_clip, -ADV * r, 0) / den, rtol=1e-5, atol=1e-12)
    assert np.all(np.isfinite(g)) and g[2, 4] == 0
  np.testing.assert_allclose(float(aux["trigger_frac"][0]), 2.0)
  np.testing.assert_allclose(float(aux["vetoed_seq_frac"][0]), 1.0)


def test_no_veto_and_threshold():
  inputs = _inputs()
  _, aux = SPEC.fn(inputs, mu_mod.Hparams(veto=False))
  assert "keep_BN" not in aux
  # With a 1e-3 threshold row 2's e^-9 token triggers as well.
  _, aux = SPEC.fn(inputs, mu_mod.Hparams(veto_ratio=1e-3))
  np.testing.assert_array_equal(np.asarray(aux["keep_BN"])[2], [1, 1, 0, 0, 0])


def test_on_policy_equals_pg():
  inputs = _inputs(lr=np.zeros_like(LR))
  pg = losses.get("pg")
  np.testing.assert_allclose(_grad(inputs, mu_mod.Hparams()), _grad(inputs, pg.Hparams(), spec=pg), rtol=1e-6, atol=0)
