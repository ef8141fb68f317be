"""Golden values and gradients for the sampled-token OPD reverse KL (advantage and direct forms)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import opd_reverse_kl as mod
from jaxrl_llm.types import LossInputs

SPEC = losses.get("opd_reverse_kl")


def _case():
  """Row 0: ratios inside the clip; row 1: r = e^0.5 with A>0 (clipped at 1.2) and r = e^-0.5 with A<0
  (clipped at 0.8), w = π_prox/μ = e^2 > 5 on token 2; row 2: -inf padding on the last two tokens."""
  logp = np.array([[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.1, -0.7, -2.5], [-0.9, -1.4, 0.0, 0.0]], np.float32)
  lr = np.array([[0.05, -0.1, 0.0, 0.1], [0.5, -0.5, 0.1, -0.05], [0.15, -0.02, 0.0, 0.0]])  # log π_θ/π_prox
  lw = np.array([[0.0, 0.3, -0.5, 0.2], [0.1, -0.2, 2.0, 0.0], [0.1, 0.4, 0.0, 0.0]])  # log π_prox/μ
  teacher = np.array([[-0.5, -0.9, -1.0, -3.0], [-0.1, -2.5, -0.2, -1.0], [-1.5, -0.2, 0.0, 0.0]], np.float32)
  mask = np.ones((3, 4), np.float32)
  mask[2, 2:] = 0
  prox = (logp - lr).astype(np.float32)
  behav = (prox - lw).astype(np.float32)
  for x in (logp, prox, behav, teacher):
    x[2, 2:] = -np.inf
  return logp, prox, behav, teacher, mask


def _inputs(logp, prox, behav, teacher, mask):
  return LossInputs(logp_BN=jnp.asarray(logp), mask_BN=jnp.asarray(mask), adv_BN=jnp.zeros(mask.shape),
                    prox_logp_BN=jnp.asarray(prox), behavior_logp_BN=jnp.asarray(behav),
                    teacher_logp_BN=jnp.asarray(teacher))


def _grad(inputs, hp, mode="token-mean"):
  f = lambda lp: losses.reduce(SPEC.fn(inputs.replace(logp_BN=lp), hp)[0], inputs.mask_BN, mode)
  return np.asarray(jax.grad(f)(inputs.logp_BN))


def _golden(logp, prox, behav, teacher, mask, hp):
  m = mask > 0
  z = lambda x: np.where(m, x.astype(np.float64), 0.0)
  lq, lpx, lmu, lp = z(logp), z(prox), z(behav), z(teacher)
  if hp.form == "direct":
    d = lq - lp
    val, dval = {"k1": (d, np.ones_like(d)), "k2": (0.5 * d * d, d),
                 "k3": (np.exp(-d) + d - 1, 1 - np.exp(-d))}[hp.estimator]
  else:
    A = lp - (lq if hp.online_advantage else lmu)
    if hp.importance_sampling:
      r = np.exp(lq - lpx)
      unc, clp = -A * r, -A * np.clip(r, 1 - hp.eps_low, 1 + hp.eps_high)
      use = clp > unc
      val, dval = np.where(use, clp, unc), np.where(use, 0.0, -A * r)
    else:
      val, dval = -A * lq, -A
    if hp.decoupled:
      w = np.exp(lpx - lmu)
      w = np.where(w > hp.behave_weight_cap, 0.0, w)
      val, dval = w * val, w * dval
  return np.where(m, val, 0.0), np.where(m, dval, 0.0) / mask.sum()


HPS = [
    mod.Hparams(),
    mod.Hparams(online_advantage=True),
    mod.Hparams(decoupled=True),
    mod.Hparams(importance_sampling=False),
    mod.Hparams(eps_low=1e6, eps_high=1e6),
    mod.Hparams(form="direct", estimator="k1"),
    mod.Hparams(form="direct", estimator="k2"),
    mod.Hparams(form="direct", estimator="k3"),
]


@pytest.mark.parametrize("hp", HPS, ids=lambda h: f"{h.form}-{h.estimator}-on{h.online_advantage}-dec{h.decoupled}-is{h.importance_sampling}-eps{h.eps_low}")
def test_golden_values_and_gradients(hp):
  case = _case()
  inputs = _inputs(*case)
  loss_BN, aux = SPEC.fn(inputs, hp)
  val, grad = _golden(*case, hp)
  np.testing.assert_allclose(np.asarray(loss_BN), val, rtol=1e-5, atol=1e-6)
  g = _grad(inputs, hp)
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
  assert np.all(np.isfinite(g)) and np.all(g[case[4] == 0] == 0)
  if hp.decoupled:
    np.testing.assert_array_equal(np.asarray(aux["keep_BN"])[1], [1, 1, 0, 1])


def test_clip_triggers_where_expected():
  case = _case()
  _, aux = SPEC.fn(_inputs(*case), mod.Hparams())
  s, c = aux["clip_frac"]
  assert float(s) == 2.0 and float(c) == 10.0  # row 1, tokens 0 and 1


def test_on_policy_advantage_equals_k2_direct_and_pg():
  """μ = prox = π_θ: gradient = −(log p − log π_θ)·m/N, the k2 direct loss has the same gradient."""
  logp, _, _, teacher, mask = _case()
  inputs = _inputs(logp, logp, logp, teacher, mask)
  m = mask > 0
  want = np.where(m, -(np.where(m, teacher, 0) - np.where(m, logp, 0)), 0.0) / mask.sum()
  for hp in (mod.Hparams(), mod.Hparams(online_advantage=True), mod.Hparams(form="direct", estimator="k2")):
    np.testing.assert_allclose(_grad(inputs, hp), want, rtol=1e-5, atol=1e-7)


def test_sampled_gradient_matches_dense_reverse_kl_in_expectation():
  """Exact expectation over y ~ π_θ (V = 6): Σ_y q(y)·∂ℓ(y)/∂logits = ∇KL(q‖p) for the advantage form and k2,
  and ∇KL(p‖q) for k3 (checked with the dense losses' logits gradients)."""
  rng = np.random.default_rng(0)
  V = 6
  zs, zt = rng.normal(0, 1, V).astype(np.float32), rng.normal(0, 1, V).astype(np.float32)
  lq_all, lp_all = jax.nn.log_softmax(jnp.asarray(zs)), jax.nn.log_softmax(jnp.asarray(zt))
  mask = jnp.ones((1, 1))

  def expected_grad(hp):
    def per_token(z, y):
      lq = jax.nn.log_softmax(z)[y].reshape(1, 1)
      inp = LossInputs(logp_BN=lq, mask_BN=mask, adv_BN=jnp.zeros((1, 1)), prox_logp_BN=jax.lax.stop_gradient(lq),
                       behavior_logp_BN=jax.lax.stop_gradient(lq), teacher_logp_BN=lp_all[y].reshape(1, 1))
      return losses.reduce(SPEC.fn(inp, hp)[0], mask)
    gs = [jax.grad(per_token)(jnp.asarray(zs), y) for y in range(V)]
    return np.sum([np.exp(float(lq_all[y])) * np.asarray(g) for y, g in enumerate(gs)], axis=0)

  dense = lambda name: np.asarray(jax.grad(lambda z: losses.get(name).fn(LossInputs(
      logp_BN=jnp.zeros((1, 1)), mask_BN=mask, adv_BN=jnp.zeros((1, 1)), student_logits_BNV=z.reshape(1, 1, V),
      teacher_logits_BNV=jnp.asarray(zt).reshape(1, 1, V)), losses.get(name).Hparams())[0].sum())(jnp.asarray(zs)))
  rev, fwd = dense("opd_reverse_kl_full"), dense("opd_forward_kl")
  np.testing.assert_allclose(expected_grad(mod.Hparams()), rev, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(expected_grad(mod.Hparams(form="direct", estimator="k2")), rev, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(expected_grad(mod.Hparams(form="direct", estimator="k3")), fwd, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(expected_grad(mod.Hparams(form="direct", estimator="k1")), 0.0, atol=1e-6)


def test_empty_mask_and_bad_form():
  logp, prox, behav, teacher, mask = _case()
  inputs = _inputs(logp, prox, behav, teacher, np.zeros_like(mask))
  np.testing.assert_array_equal(_grad(inputs, mod.Hparams()), 0.0)
  with pytest.raises(ValueError, match="form"):
    SPEC.fn(inputs, mod.Hparams(form="nope"))


def test_advantage_is_not_clamped():
  """A teacher 34 nats below μ on the sampled token gives advantage −34, not the ±20 log-ratio clamp's −20 (async-opd
  clamps no advantage; a clamp biased the gradient, experiments/opd_claims.py): on-policy the gradient is −A = 34."""
  logp = np.full((1, 1), -1.0, np.float32)
  teacher = np.full((1, 1), -35.0, np.float32)
  inputs = _inputs(logp, logp, logp, teacher, np.ones((1, 1), np.float32))
  np.testing.assert_allclose(_grad(inputs, mod.Hparams()), [[34.0]], rtol=1e-6)
  np.testing.assert_allclose(_grad(inputs, mod.Hparams(online_advantage=True)), [[34.0]], rtol=1e-6)
