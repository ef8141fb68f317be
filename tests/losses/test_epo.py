"""Golden values and gradients for EPO (methods-rl §7.6; released code WujiangXu/EPO)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import epo as E
from jaxrl_llm.types import LossInputs

SPEC = losses.get("epo")

LOGP = np.array([[-1.0, -0.5, -2.0, -0.8, -np.inf],
                 [-1.2, -0.7, -0.3, -0.9, -1.1]], np.float32)
LR = np.array([[0.1, 0.5, -0.5, 0.0, 0.0],
               [2.0, -0.1, 0.3, -0.4, 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], np.float32)
ADV = np.array([[1.0] * 5, [-1.5] * 5], np.float32)
TURN = np.array([[0, 0, 1, 1, 1], [1, 1, 2, 2, 3]], np.int32)
# History means per turn: 1.0, 2.0, 0.5; turn 3 has none.
HIST_SUM = np.array([2.0, 6.0, 0.5, 0.0], np.float32)
HIST_CNT = np.array([2.0, 3.0, 1.0, 0.0], np.float32)
# turn 0 (gated off by smooth_from_turn=1): 5.0 would be out of band; turn 1 band (1.6, 2.4): 3.0 out,
# 1.6 out (strict bound); turn 1 for row 1: 2.0 in, 1.0 out; turn 2 band (0.4, 0.6): 0.5 in, 0.9 out;
# turn 3: no history.
ENT = np.array([[5.0, 0.2, 3.0, 1.6, np.nan],
                [2.0, 1.0, 0.5, 0.9, 7.0]], np.float32)
HIST_OF = {0: 1.0, 1: 2.0, 2: 0.5}


def _hp(**kw):
  base = dict(max_turns=4, smooth_from_turn=1, smooth_schedule=False, entropy_coef=0.01, smooth_coef=2.0)
  base.update(kw)
  return E.Hparams(**base)


def _state(step=0):
  return {"ent_sum_U": jnp.asarray(HIST_SUM), "ent_count_U": jnp.asarray(HIST_CNT), "step": jnp.asarray(step, jnp.int32)}


def _inputs(lr=LR, ent=ENT, state=None, mask=MASK):
  prox = np.where(mask > 0, LOGP - lr, -np.inf).astype(np.float32)
  return LossInputs(logp_BN=jnp.asarray(LOGP), mask_BN=jnp.asarray(mask), adv_BN=jnp.asarray(ADV),
                    prox_logp_BN=jnp.asarray(prox), entropy_BN=jnp.asarray(ent), turn_BN=jnp.asarray(TURN),
                    state=_state() if state is None else state)


def _ppo_np(lr, adv, eps=0.2, c=3.0):
  r = np.exp(lr.astype(np.float64))
  loss = np.maximum(-adv * r, -adv * np.clip(r, 1 - eps, 1 + eps))
  loss = np.where(adv < 0, np.minimum(loss, -adv * c), loss)
  # gradient coefficient d loss / d logp: -A·r where r flows, 0 where clipped / dual-clipped
  flows = (-adv * r >= -adv * np.clip(r, 1 - eps, 1 + eps)) & ~((adv < 0) & (-adv * r > -adv * c))
  return loss, np.where(flows, -adv * r, 0.0)


def _penalty_np(ent, hp):
  p = np.zeros(ent.shape)
  dp = np.zeros(ent.shape)  # dP/dH (hinge only)
  for b in range(ent.shape[0]):
    for t in range(ent.shape[1]):
      k = int(TURN[b, t])
      if MASK[b, t] == 0 or k not in HIST_OF or k < hp.smooth_from_turn:
        continue
      lo, hi, h = hp.band_low * HIST_OF[k], hp.band_high * HIST_OF[k], ent[b, t]
      if hp.smooth_penalty == "indicator":
        p[b, t] = 0.0 if lo < h < hi else hp.out_range_penalty
      else:
        p[b, t] = hp.out_range_penalty * (max(lo - h, 0.0) + max(h - hi, 0.0))
        dp[b, t] = hp.out_range_penalty * (-1.0 if h < lo else (1.0 if h > hi else 0.0))
  return p, dp


def _grads(inputs, hp, mode="token-mean"):
  def f(lp, ent):
    return losses.reduce(SPEC.fn(inputs.replace(logp_BN=lp, entropy_BN=ent), hp)[0], inputs.mask_BN, mode)
  return [np.asarray(x) for x in jax.grad(f, argnums=(0, 1))(inputs.logp_BN, inputs.entropy_BN)]


@pytest.mark.parametrize("kind", ["indicator", "hinge"])
def test_golden_values_and_gradients(kind):
  hp = _hp(smooth_penalty=kind)
  inputs = _inputs()
  loss_BN, aux = SPEC.fn(inputs, hp)
  m = MASK > 0
  ppo, dppo = _ppo_np(LR, ADV)
  ent = np.where(m, ENT, 0.0)
  p, dp = _penalty_np(ent, hp)
  want = np.where(m, ppo - hp.entropy_coef * (ent - hp.smooth_coef * p), 0.0)
  np.testing.assert_allclose(np.asarray(loss_BN), want, rtol=1e-5, atol=1e-6)
  g_lp, g_ent = _grads(inputs, hp)
  n = MASK.sum()
  np.testing.assert_allclose(g_lp, np.where(m, dppo, 0.0) / n, rtol=1e-5, atol=1e-7)
  # indicator: the penalty has no gradient (released code), only the bonus −β·H does
  want_ent = np.where(m, -hp.entropy_coef * (1.0 - hp.smooth_coef * dp), 0.0) / n
  np.testing.assert_allclose(g_ent, want_ent, rtol=1e-5, atol=1e-9)
  if kind == "indicator":
    np.testing.assert_allclose(g_ent, np.where(m, -hp.entropy_coef, 0.0) / n, rtol=1e-6)
  # the cases the fixture was built to trigger: dual clip, upper clip, band exits both ways, strict bound
  assert (dppo[1, 0] == 0.0) and (dppo[0, 1] == 0.0)
  np.testing.assert_allclose(float(aux["smooth_penalty"][0]), p[m].sum(), rtol=1e-5)
  assert float(aux["out_of_band_frac"][0]) == 4.0  # (0,2) high, (0,3) on the bound, (1,1) low, (1,3) high


def test_hinge_pushes_entropy_back_into_band():
  hp = _hp(smooth_penalty="hinge", entropy_coef=1.0, smooth_coef=50.0)
  _, g_ent = _grads(_inputs(), hp)
  # descent direction −g: too high (0,2) → entropy goes down; too low (1,1) → up; in band (1,0) → bonus only (up)
  assert g_ent[0, 2] > 0 and g_ent[1, 1] < 0 and g_ent[1, 0] < 0


def test_gates_turn_threshold_and_missing_history():
  hp = _hp(smooth_from_turn=2, smooth_penalty="indicator")
  loss_BN, _ = SPEC.fn(_inputs(), hp)
  p, _ = _penalty_np(np.where(MASK > 0, ENT, 0.0), hp)
  assert p[0, 2] == 0.0 and p[1, 3] == hp.out_range_penalty and p[1, 4] == 0.0
  ppo, _ = _ppo_np(LR, ADV)
  want = np.where(MASK > 0, ppo - hp.entropy_coef * (np.where(MASK > 0, ENT, 0) - hp.smooth_coef * p), 0.0)
  np.testing.assert_allclose(np.asarray(loss_BN), want, rtol=1e-5, atol=1e-6)
  # default smooth_from_turn = 25 (code: max_step 50 // 2): no penalty on these early turns
  _, aux = SPEC.fn(_inputs(), E.Hparams(max_turns=4))
  assert float(aux["smooth_penalty"][0]) == 0.0


def test_history_update():
  hp = _hp()
  _, aux = SPEC.fn(_inputs(state=_state(step=5)), hp)
  s = aux["state"]
  m = MASK > 0
  add_sum = np.zeros(4)
  add_cnt = np.zeros(4)
  for b, t in zip(*np.nonzero(m)):
    add_sum[TURN[b, t]] += ENT[b, t]
    add_cnt[TURN[b, t]] += 1
  np.testing.assert_allclose(np.asarray(s["ent_sum_U"]), HIST_SUM + add_sum, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(s["ent_count_U"]), HIST_CNT + add_cnt)
  assert int(s["step"]) == 6
  # turns beyond max_turns are neither penalised nor recorded
  hp3 = _hp(max_turns=3)
  st3 = {"ent_sum_U": jnp.asarray(HIST_SUM[:3]), "ent_count_U": jnp.asarray(HIST_CNT[:3]), "step": jnp.asarray(0)}
  _, aux3 = SPEC.fn(_inputs(state=st3), hp3)
  np.testing.assert_allclose(np.asarray(aux3["state"]["ent_count_U"]), (HIST_CNT + add_cnt)[:3])


def test_init_state_then_first_step_has_no_penalty():
  hp = _hp()
  st = SPEC.init_state(hp)
  assert st["ent_sum_U"].shape == (4,) and int(st["step"]) == 0
  _, aux = SPEC.fn(_inputs(state=st), hp)
  assert float(aux["smooth_penalty"][0]) == 0.0


def test_schedule_weight_golden():
  hp = E.Hparams(schedule_steps=150)
  w = lambda k: float(E.smooth_weight(k, hp))
  assert w(0) == pytest.approx(1.0)
  assert w(75) == pytest.approx(1.0 - 0.2 * (1 - math.exp(-2.0)), rel=1e-6)
  assert w(30) == pytest.approx(1.0 - 0.2 * (1 - math.exp(-2.0 * 30 / 75)), rel=1e-6)
  assert w(120) == pytest.approx(0.8 * math.exp(-3.0 * 45 / 75), rel=1e-6)
  assert w(150) == pytest.approx(0.8 * math.exp(-3.0), rel=1e-6)
  assert w(400) == pytest.approx(0.8 * math.exp(-3.0), rel=1e-6)  # clamped to the horizon
  # the weight multiplies the penalty
  hp_s = _hp(smooth_schedule=True, schedule_steps=150)
  _, a0 = SPEC.fn(_inputs(state=_state(step=0)), hp_s)
  _, a1 = SPEC.fn(_inputs(state=_state(step=120)), hp_s)
  np.testing.assert_allclose(float(a1["smooth_penalty"][0]) / float(a0["smooth_penalty"][0]), w(120), rtol=1e-5)


def test_on_policy_gradient_is_pg():
  hp = _hp()
  g_lp, _ = _grads(_inputs(lr=np.zeros_like(LR)), hp)
  np.testing.assert_allclose(g_lp, np.where(MASK > 0, -ADV, 0.0) / MASK.sum(), rtol=1e-6, atol=1e-8)


def test_bad_penalty_name_raises():
  with pytest.raises(ValueError, match="smooth_penalty"):
    SPEC.fn(_inputs(), _hp(smooth_penalty="quadratic"))


def test_padding_nan_entropy_and_inf_logp_are_finite():
  # ENT holds NaN and LOGP -inf at the padded position of row 0.
  g_lp, g_ent = _grads(_inputs(), _hp(smooth_penalty="hinge"))
  assert np.all(np.isfinite(g_lp)) and np.all(np.isfinite(g_ent))
  assert g_lp[0, 4] == 0.0 and g_ent[0, 4] == 0.0


def test_default_smoothing_has_a_gradient():
  """The default penalty (the paper's smoothing) moves the parameters: out of band, d loss / d H is the bonus's
  −β/n scaled by (1 − λ·0.1·sign); under the released code's indicator it would be −β/n everywhere."""
  hp = E.Hparams(max_turns=4, smooth_from_turn=1, smooth_schedule=False, entropy_coef=0.01, smooth_coef=2.0)
  assert hp.smooth_penalty == "hinge"
  _, g_ent = _grads(_inputs(), hp)
  n, beta = MASK.sum(), 0.01
  # (0,2): turn 1, H=3.0 above the band (1.6, 2.4); (1,1): H=1.0 below it; (1,0): H=2.0 in band
  np.testing.assert_allclose(g_ent[0, 2], -beta * (1 - 2.0 * 0.1) / n, rtol=1e-5)
  np.testing.assert_allclose(g_ent[1, 1], -beta * (1 + 2.0 * 0.1) / n, rtol=1e-5)
  np.testing.assert_allclose(g_ent[1, 0], -beta / n, rtol=1e-5)


def test_a_run_smooths_from_half_its_turn_limit():
  """configs/epo_tiny.py (4 turns): smoothing starts at turn 2, inside the episode (the code's max_step // 2),
  not at the 50-step default's 25; loss.hparams still overrides it."""
  import os
  from jaxrl_llm.config import load_file
  c = load_file(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "epo_tiny.py"))
  assert c.env.max_turns == 4
  hp = losses.make_hparams(SPEC, losses.run_hparams(c))
  assert hp.smooth_from_turn == 2 and hp.smooth_penalty == "hinge"
  c.loss.hparams.smooth_from_turn = 3
  assert losses.make_hparams(SPEC, losses.run_hparams(c)).smooth_from_turn == 3
  c.loss.name = "ppo_clip"  # other losses derive nothing from the run
  assert losses.run_hparams(c) == {"smooth_from_turn": 3}
