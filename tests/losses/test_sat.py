"""SAT / SAT-GSPO: golden values, Prop. 4.1 properties, bit-identity when disabled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_llm import losses
from jaxrl_llm.losses import gspo as gspo_mod
from jaxrl_llm.losses import ppo_clip as ppo_mod
from jaxrl_llm.losses import sat as sat_mod
from jaxrl_llm.types import LossInputs

SAT = losses.get("sat")
SAT_GSPO = losses.get("sat_gspo")
HP = sat_mod.Hparams()


def _tok_grad(spec, inputs, hp):
  """Per-token gradient of Σ ℓ (each token's ℓ depends on its own log-prob only for token ratios)."""
  return np.asarray(jax.grad(lambda lp: spec.fn(inputs.replace(logp_BN=lp), hp)[0].sum())(inputs.logp_BN))


def _grad(spec, inputs, hp, mode="token-mean"):
  return np.asarray(jax.grad(lambda lp: losses.reduce(spec.fn(inputs.replace(logp_BN=lp), hp)[0],
                                                      inputs.mask_BN, mode))(inputs.logp_BN))


def _inputs(logp, den, mask, adv, behav=None):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(adv),
                    prox_logp_BN=jnp.asarray(den),
                    behavior_logp_BN=jnp.asarray(den if behav is None else behav))


def _np_sat(d, mask, adv, eps_l=0.2, eps_h=0.2, alpha=0.9, p=2.0):
  """Reference from addendum §1.2 in float64: returns (loss, dloss/dlogp, gate, c+, c-)."""
  act = mask > 0
  a = np.sort(np.abs(d[act]))
  q = a[int(np.ceil(alpha * a.size)) - 1] if a.size else 0.0
  gate = act & (q > 0) & (np.abs(d) > q)
  psi = lambda u: 1.0 / (1.0 + (u / (q if q > 0 else 1.0)) ** p)
  cp = np.where(gate, psi(np.maximum(d, 0)), 1.0)
  cm = np.where(gate, psi(np.maximum(-d, 0)), 1.0)
  r = np.exp(d)
  rbar = np.clip(r, 1 - eps_l * cm, 1 + eps_h * cp)
  unc, clp = -adv * r, -adv * rbar
  use_clip = clp > unc
  loss = np.where(act, np.where(use_clip, clp, unc), 0.0)
  grad = np.where(act & ~use_clip, -adv * r, 0.0)
  return loss, grad, gate, cp, cm, q


def _case():
  # 10 active tokens with distinct |d| so q is the 9th smallest and exactly one token is gated.
  d = np.array([[0.01, -0.02, 0.03, 0.35, -0.05],
                [0.06, -0.07, 0.30, 0.08, 0.0],
                [-0.5, 0.0, 0.0, 0.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], np.float32)
  logp = np.full(d.shape, -1.0, np.float32)
  logp[1, 4] = -np.inf
  logp[2, 1:] = -np.inf
  den = (logp - d).astype(np.float32)
  adv = np.array([[1.0] * 5, [-1.0] * 5, [-1.0] * 5], np.float32)
  return logp, den, mask, adv, d


def test_golden_values_and_gradients():
  logp, den, mask, adv, d = _case()
  inputs = _inputs(logp, den, mask, adv)
  loss_BN, aux = SAT.fn(inputs, HP)
  dd = np.where(mask > 0, (np.where(mask > 0, logp, 0) - np.where(mask > 0, den, 0)).astype(np.float64), 0)
  loss, grad, gate, cp, cm, q = _np_sat(dd, mask, adv)
  # |d| sorted: .01 .02 .03 .05 .06 .07 .08 .30 .35 .50 -> q = .35, only the -0.5 token is gated.
  np.testing.assert_allclose(q, 0.35, rtol=1e-6)
  np.testing.assert_array_equal(gate, np.abs(d) == np.float32(0.5))
  np.testing.assert_allclose(float(aux["sat_q"][0]), 0.35, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(loss_BN), loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_grad(SAT, inputs, HP), grad / mask.sum(), rtol=1e-5, atol=1e-8)
  # The gated token (A<0, r = e^-0.5 = .607 < .8): PPO clips it too, SAT lower bound 1 - .2·ψ = .9342.
  np.testing.assert_allclose(cm[2, 0], 1 / (1 + (0.5 / 0.35) ** 2), rtol=1e-5)
  assert cp[2, 0] == 1.0
  # Token (0,3): d = .35 = q is NOT gated (strict >); PPO clips it (A>0, r=1.42 > 1.2).
  assert not gate[0, 3]
  assert float(aux["sat_gate_rate"][0]) == 1.0


def test_gate_changes_gradient_inside_band():
  # One A>0 token at r = e^0.15 = 1.16 < 1.2 (inside PPO's interval), gated: SAT's upper bound
  # 1 + .2·ψ(.15; q) is below r, so SAT kills its gradient while PPO keeps it.
  d = np.array([[0.15] + [0.001 * i for i in range(1, 10)]], np.float32)
  logp = np.full(d.shape, -1.0, np.float32)
  den = (logp - d).astype(np.float32)
  mask = np.ones(d.shape, np.float32)
  adv = np.ones(d.shape, np.float32)
  inputs = _inputs(logp, den, mask, adv)
  g_sat = _tok_grad(SAT, inputs, HP)
  g_ppo = _tok_grad(losses.get("ppo_clip"), inputs, ppo_mod.Hparams())
  assert g_sat[0, 0] == 0.0 and g_ppo[0, 0] != 0.0
  np.testing.assert_array_equal(g_sat[0, 1:], g_ppo[0, 1:])


finite = st.floats(-0.5, 0.5, width=32)


@settings(max_examples=20, deadline=None)
@given(st.lists(finite, min_size=12, max_size=12), st.lists(st.floats(-2, 2, width=32), min_size=3, max_size=3),
       st.lists(st.booleans(), min_size=12, max_size=12), st.sampled_from(["sat", "sat_gspo"]))
def test_prop_4_1(ds, advs, act, name):
  d = np.array(ds, np.float32).reshape(3, 4)
  mask = np.array(act, np.float32).reshape(3, 4)
  adv = np.repeat(np.array(advs, np.float32)[:, None], 4, 1)
  logp = np.full(d.shape, -1.0, np.float32)
  den = (logp - d).astype(np.float32)
  inputs = _inputs(logp, den, mask, adv)
  spec = losses.get(name)
  base, base_hp = ((losses.get("ppo_clip"), ppo_mod.Hparams()) if name == "sat" else
                   (losses.get("gspo"), gspo_mod.Hparams(eps_low=0.2, eps_high=0.2)))
  loss_sat, aux = spec.fn(inputs, HP)
  loss_ppo, _ = base.fn(inputs, base_hp)
  act_b = mask > 0
  # The staleness proxy the loss saw (token or broadcast sequence log-ratio).
  if name == "sat":
    dd = np.where(act_b, d, 0.0)
  else:
    L = np.maximum(mask.sum(1, keepdims=True), 1)
    dd = np.where(act_b, np.broadcast_to(np.where(act_b, logp - den, 0).sum(1, keepdims=True) / L, d.shape), 0.0)
  c_plus, c_minus, gate, q = (np.asarray(x) for x in sat_mod.sat_factors(jnp.asarray(dd), jnp.asarray(mask), 0.9, 2.0))
  # 1. Containment; only the sign(d) endpoint moves, and by more than half on gated tokens.
  assert np.all((c_plus <= 1) & (c_minus <= 1) & (c_plus > 0) & (c_minus > 0))
  assert np.all(c_minus[dd > 0] == 1.0) and np.all(c_plus[dd < 0] == 1.0)
  assert np.all(c_plus[gate & (dd > 0)] < 0.5) and np.all(c_minus[gate & (dd < 0)] < 0.5)
  assert np.all(c_plus[~gate] == 1.0) and np.all(c_minus[~gate] == 1.0)
  # 2. Pointwise pessimism: S_SAT <= S_PPO, i.e. loss_SAT >= loss_PPO.
  assert np.all(np.asarray(loss_sat) >= np.asarray(loss_ppo) - 1e-6)
  # 4. Gate rate <= 10% of active tokens.
  assert gate.sum() <= 0.1 * act_b.sum() + 1e-9
  # 3. Exact locus of change (token ratios: per-token gradient dℓ/dlog π = r·dℓ/dr).
  if name == "sat":
    g_sat, g_ppo = _tok_grad(spec, inputs, HP), _tok_grad(base, inputs, base_hp)
    r = np.exp(dd)
    band = act_b & (((adv > 0) & (r > 1 + 0.2 * c_plus) & (r < 1.2)) |
                    ((adv < 0) & (r > 0.8) & (r < 1 - 0.2 * c_minus)))
    np.testing.assert_array_equal(g_sat[~band], g_ppo[~band])
    assert np.all(g_sat[band] == 0)
    np.testing.assert_allclose(g_ppo[band], (-adv * r)[band], rtol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_disabled_is_bit_identical(mode):
  logp, den, mask, adv, _ = _case()
  inputs = _inputs(logp, den, mask, adv)
  off = sat_mod.Hparams(enabled=False)
  pairs = [(SAT, losses.get("ppo_clip"), ppo_mod.Hparams()),
           (SAT_GSPO, losses.get("gspo"), gspo_mod.Hparams(eps_low=0.2, eps_high=0.2))]
  for spec, base, base_hp in pairs:
    np.testing.assert_array_equal(np.asarray(spec.fn(inputs, off)[0]), np.asarray(base.fn(inputs, base_hp)[0]))
    np.testing.assert_array_equal(_grad(spec, inputs, off, mode), _grad(base, inputs, base_hp, mode))


def test_sat_gspo_golden():
  # Sequence log-ratios .02 (5 tokens), .25 (4 tokens), -.40 (3 tokens) broadcast to tokens.
  logp = np.full((3, 5), -1.0, np.float32)
  lr = np.array([[0.02] * 5, [0.25] * 4 + [0.0], [-0.4] * 3 + [0.0] * 2], np.float32)
  den = (logp - lr).astype(np.float32)
  adv = np.array([[1.0] * 5, [1.0] * 5, [-1.0] * 5], np.float32)
  mask = np.array([[1] * 5, [1] * 4 + [0], [1] * 3 + [0] * 2], np.float32)
  _, aux = SAT_GSPO.fn(_inputs(logp, den, mask, adv), HP)
  # 12 tokens: the lower 0.9-quantile is the 11th smallest |d| = .40 itself; nothing is strictly above,
  # so a whole 25%-of-tokens sequence is NOT gated (ties at q lower the realised rate).
  np.testing.assert_allclose(float(aux["sat_q"][0]), 0.4, rtol=1e-6)
  assert float(aux["sat_gate_rate"][0]) == 0.0
  # Shorten the third sequence to 1 token: 10 tokens, q = 9th smallest = .25, the -.4 token is gated.
  mask2 = np.array([[1] * 5, [1] * 4 + [0], [1] + [0] * 4], np.float32)
  inputs2 = _inputs(logp, den, mask2, adv)
  loss_BN, aux = SAT_GSPO.fn(inputs2, HP)
  np.testing.assert_allclose(float(aux["sat_q"][0]), 0.25, rtol=1e-5)
  assert float(aux["sat_gate_rate"][0]) == 1.0
  c = 1 / (1 + (0.4 / 0.25) ** 2)
  # A<0, ρ = e^-.4 = .670 is below both PPO's .8 and SAT's 1 - .2c = .9438: the clipped value moves.
  assert np.exp(-0.4) < 1 - 0.2 * c
  np.testing.assert_allclose(np.asarray(loss_BN)[2, 0], 1 - 0.2 * c, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(SAT_GSPO.fn(inputs2, sat_mod.Hparams(enabled=False))[0])[2, 0], 0.8,
                             rtol=1e-6)
  g = _grad(SAT_GSPO, inputs2, HP, "seq-mean-token-mean")
  # Seq 0 unclipped: -A·ρ/L/B'; seq 1 clipped above (ρ = e^.25 > 1.2): 0; seq 2 clipped: 0.
  want = np.zeros((3, 5))
  want[0] = -np.exp(0.02) / 5 / 3
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-8)


def test_denominator_option():
  logp, den, mask, adv, _ = _case()
  a = _grad(SAT, _inputs(logp, logp, mask, adv, behav=den), sat_mod.Hparams(denominator="behavior"))
  b = _grad(SAT, _inputs(logp, den, mask, adv, behav=logp), sat_mod.Hparams())
  np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["sat", "sat_gspo"])
def test_on_policy_equals_pg(name):
  logp, _, mask, adv, _ = _case()
  inputs = _inputs(logp, logp, mask, adv)
  pg = losses.get("pg")
  mode = "token-mean" if name == "sat" else "seq-mean-token-mean"
  np.testing.assert_allclose(_grad(losses.get(name), inputs, HP, mode), _grad(pg, inputs, pg.Hparams(), mode),
                             rtol=1e-6, atol=0)
