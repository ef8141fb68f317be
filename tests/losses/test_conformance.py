"""Conformance suite: every registered loss obeys the library contract (losses/registry.py).

Parametrised over `losses.names()`, so a new loss file is covered the moment it registers itself.
Checks: jit == no-jit; finite values, metrics, state and gradients under -inf padding, empty masks,
zero-length sequences and extreme log-ratios (|log r| up to 50); exactly zero gradient on masked
tokens; on-policy gradient relation to vanilla PG (`ON_POLICY_COEF`); metadata (frozen Hparams,
"On-policy" in the docstring); registry errors.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses
from jaxrl_llm.losses import registry
from jaxrl_llm.types import LossInputs

B, N, k = 3, 5, 3
NAMES = losses.names()

# Mask: right padding, full, left padding (row layouts seen in practice).
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], np.float32)
ADV_B = np.array([1.5, -0.7, 0.4], np.float32)


def _rand_logp(rng, shape, lo=-3.0, hi=-0.05):
  return rng.uniform(lo, hi, size=shape).astype(np.float32)


def _add_opd_fields(f, needs, rng, mask, pad, on_policy, extreme, B, N, k, V=11, J=4):
  if "student_logits" in needs:
    f["student_logits_BNV"] = np.where(mask[..., None] > 0, rng.normal(0, 30 if extreme else 1, (B, N, V)), np.nan).astype(np.float32)
  if "teacher_logits" in needs:
    zt = rng.normal(0, 30 if extreme else 1, (B, N, V)).astype(np.float32)
    zt[..., 0] = -np.inf  # teacher zero entries
    f["teacher_logits_BNV"] = np.where(mask[..., None] > 0, zt, -np.inf).astype(np.float32)
  def padk(x):
    return np.where(mask[..., None] > 0, x, -np.inf).astype(np.float32)
  if "student_topk" in needs:
    f["student_topk_logp_BNk"] = padk(np.log(rng.dirichlet(np.ones(k + 1), (B, N))[..., :k]) * (5 if extreme else 1))
  if "teacher_ref_topk" in needs:
    f["teacher_ref_topk_logp_BNk"] = padk(np.log(rng.dirichlet(np.ones(k + 1), (B, N))[..., :k]))
  if "mc" in needs:
    f["mc_ids_BNJ"] = rng.integers(0, 11, (B, N, J)).astype(np.int32)
    lq = np.log(rng.uniform(0.01, 0.9, (B, N, J)))
    f["mc_logp_BNJ"] = padk(lq)
    f["mc_behavior_logp_BNJ"] = padk(lq if on_policy else lq + rng.normal(0, 30 if extreme else 0.3, (B, N, J)))
    f["mc_teacher_logp_BNJ"] = padk(np.log(rng.uniform(0.01, 0.9, (B, N, J))))
  if "sup_drift" in needs:
    f["sup_drift_B"] = np.zeros(B, np.float32) if on_policy else rng.uniform(0, 0.5, B).astype(np.float32)
  if "eviction" in needs:
    f["eviction_mask_BN"] = (rng.random((B, N)) < 0.5).astype(np.float32)
  if "shadow" in needs:  # SMD: the shadow forward's log-probs (μ itself on-policy) and both forwards' heads
    from jaxrl_llm.vocab_chunks import VocabHead
    mu = f["behavior_logp_BN"]
    f["shadow_logp_BN"] = mu.copy() if on_policy else pad(np.where(mask > 0, mu, -1.0) + rng.normal(
        0, 30 if extreme else 0.3, (B, N)).astype(np.float32))
    D = 6
    hid = lambda: jnp.asarray(np.where(mask[..., None] > 0, rng.normal(0, 10 if extreme else 1, (B, N, D)), np.nan),
                              jnp.float32)
    w = jnp.asarray(rng.normal(0, 1, (D, V)), jnp.float32)
    f["student_head"], f["shadow_head"] = VocabHead(hidden_BND=hid(), w_DV=w), VocabHead(hidden_BND=hid(), w_DV=w)


def make_inputs(name, mask=MASK, *, seed=0, on_policy=False, extreme=False, pad_inf=True, hp=None):
  """Valid LossInputs for every need of `name` (fields it does not need stay None).

  on_policy: prox = behavior = current logp (same values), versions = current, lag 0, π_θ top-k = μ top-k.
  extreme:   anchors drawn so that |logp - anchor| reaches ~50 (beyond the ±20 clamp).
  pad_inf:   every log-prob field holds -inf outside the mask.
  """
  spec = losses.get(name)
  hp = spec.Hparams() if hp is None else hp
  rng = np.random.default_rng(seed)
  mask = np.asarray(mask, np.float32)
  logp = _rand_logp(rng, (B, N))
  if extreme:
    logp = np.where(rng.random((B, N)) < 0.5, -0.01, -50.0).astype(np.float32)

  def anchor():
    if on_policy:
      return logp.copy()
    if extreme:
      return np.where(logp > -1.0, -50.0, -0.02).astype(np.float32)  # |log r| ≈ 50 on every token
    return logp + rng.normal(0.0, 0.3, size=(B, N)).astype(np.float32)

  def pad(x):
    return np.where(mask > 0, x, -np.inf).astype(np.float32) if pad_inf else x

  # Â is broadcast over padding too, so a loss that forgets the mask leaks gradient there and fails.
  adv = np.broadcast_to(ADV_B[:, None], (B, N)).astype(np.float32)
  f = {"logp_BN": pad(logp), "mask_BN": mask, "adv_BN": adv}
  needs = spec.needs
  if "prox_logp" in needs:
    f["prox_logp_BN"] = pad(anchor())
  if "behavior_logp" in needs:
    f["behavior_logp_BN"] = pad(anchor())
  if "ref_logp" in needs:
    f["ref_logp_BN"] = pad(anchor())
  if "entropy" in needs:
    f["entropy_BN"] = np.where(mask > 0, rng.uniform(0.1, 2.0, (B, N)), 0.0).astype(np.float32)
  if "versions" in needs:
    cur = 7
    stale = np.zeros((B, N), np.int32) if on_policy else rng.integers(0, 4, (B, N)).astype(np.int32)
    f["versions_BN"] = (cur - stale).astype(np.int32)
    f["current_version"] = np.asarray(cur, np.int32)
  if "lag" in needs:
    f["lag_B"] = np.zeros(B, np.int32) if on_policy else rng.integers(0, 4, B).astype(np.int32)
  if "behavior_topk" in needs:
    f["behavior_topk_ids_BNk"] = rng.integers(0, 11, (B, N, k)).astype(np.int32)
    mu = np.log(np.sort(rng.dirichlet(np.ones(k + 1), (B, N))[..., :k], -1)[..., ::-1]).astype(np.float32)
    f["behavior_topk_logp_BNk"] = pad(mu.transpose(2, 0, 1)).transpose(1, 2, 0)
    if on_policy:
      f["topk_logp_BNk"] = f["behavior_topk_logp_BNk"].copy()
    else:
      shift = rng.normal(0.0, 30.0 if extreme else 0.3, (B, N, k)).astype(np.float32)
      f["topk_logp_BNk"] = pad((np.minimum(mu + shift, -1e-3)).transpose(2, 0, 1)).transpose(1, 2, 0)
  if "turn" in needs:
    f["turn_BN"] = np.minimum(np.arange(N)[None, :] // 2, 3).repeat(B, 0).astype(np.int32)
  if "teacher_logp" in needs:
    f["teacher_logp_BN"] = pad(anchor())
  if "teacher_topk" in needs:
    f["teacher_topk_ids_BNk"] = rng.integers(0, 11, (B, N, k)).astype(np.int32)
    tk = np.log(rng.dirichlet(np.ones(k + 1), (B, N))[..., :k]).astype(np.float32)
    f["teacher_topk_logp_BNk"] = pad(tk.transpose(2, 0, 1)).transpose(1, 2, 0)
  _add_opd_fields(f, needs, rng, mask, pad, on_policy, extreme, B, N, k)
  if "state" in needs:
    f["state"] = spec.init_state(hp)
  inputs = LossInputs(**{k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in f.items()})
  losses.check_needs(spec, inputs)
  return spec, hp, inputs


def loss_and_grad(spec, hp, inputs, mode="token-mean", jit=False):
  """(reduced loss, loss_BN, aux, d loss / d logp_BN) for one aggregation mode."""
  def total(lp):
    loss_BN, aux = spec.fn(inputs.replace(logp_BN=lp), hp)
    return losses.reduce(loss_BN, inputs.mask_BN, mode), (loss_BN, aux)

  f = jax.value_and_grad(total, has_aux=True)
  if jit:
    f = jax.jit(f)
  (val, (loss_BN, aux)), g = f(inputs.logp_BN)
  return val, loss_BN, aux, g


MODES_CHECKED = ("token-mean", "seq-mean-token-mean")


@functools.lru_cache(maxsize=None)
def jitted(name):
  """One compiled function per loss (default Hparams), reused by every case: fixtures share shapes."""
  spec = losses.get(name)
  hp = spec.Hparams()

  def run(inputs):
    # One forward and one VJP for all modes: `reduce` is linear in loss_BN, so the gradient for a
    # mode is the VJP of the loss applied to that mode's d reduce / d loss_BN.
    (loss_BN, aux), vjp = jax.vjp(lambda lp: spec.fn(inputs.replace(logp_BN=lp), hp), inputs.logp_BN)
    out = {}
    for mode in MODES_CHECKED:
      val, ct = jax.value_and_grad(lambda l: losses.reduce(l, inputs.mask_BN, mode))(loss_BN)
      ct_aux = jax.tree_util.tree_map(jnp.zeros_like, aux)
      (g,) = vjp((ct, ct_aux))
      out[mode] = ((val, (loss_BN, aux)), g)
    return out

  return jax.jit(run)


def _metric_leaves(aux):
  return {k: v for k, v in aux.items() if k not in ("keep_BN", "state")}


def assert_all_finite(val, loss_BN, aux, g, label):
  assert np.isfinite(np.asarray(val)), f"{label}: loss not finite"
  assert np.all(np.isfinite(np.asarray(loss_BN))), f"{label}: loss_BN not finite"
  assert np.all(np.isfinite(np.asarray(g))), f"{label}: gradient not finite: {np.asarray(g)}"
  for k, v in _metric_leaves(aux).items():
    assert isinstance(v, tuple) and len(v) == 2, f"{label}: metric {k!r} must be a (sum, count) pair"
    assert np.all(np.isfinite(np.asarray(v[0]))) and np.all(np.isfinite(np.asarray(v[1]))), f"{label}: metric {k} {v}"
  for leaf in jax.tree_util.tree_leaves(aux.get("state")):
    assert np.all(np.isfinite(np.asarray(leaf))), f"{label}: state not finite"
  if "keep_BN" in aux:
    keep = np.asarray(aux["keep_BN"])
    assert keep.shape == (B, N) and set(np.unique(keep)) <= {0.0, 1.0}, f"{label}: keep_BN must be float {{0,1}} [B,N]"


def assert_masked_grad_zero(g, mask, label):
  g = np.asarray(g)
  assert np.all(g[np.asarray(mask) == 0] == 0.0), f"{label}: masked tokens got gradient {g[np.asarray(mask) == 0]}"


@pytest.mark.parametrize("name", NAMES)
def test_jit_equals_nojit(name):
  spec, hp, inputs = make_inputs(name, seed=1)
  v0, l0, a0, g0 = loss_and_grad(spec, hp, inputs, "token-mean", jit=False)
  (v1, (l1, a1)), g1 = jitted(name)(inputs)["token-mean"]
  np.testing.assert_allclose(np.asarray(v1), np.asarray(v0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-5, atol=1e-6)
  assert set(a0) == set(a1)
  for x, y in zip(jax.tree_util.tree_leaves(a0), jax.tree_util.tree_leaves(a1)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)


CASES = {
    "pad_inf": dict(mask=MASK),
    "empty_mask": dict(mask=np.zeros((B, N), np.float32)),
    "zero_length_row": dict(mask=np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]], np.float32)),
    "extreme_ratios": dict(mask=MASK, extreme=True),
    "on_policy": dict(mask=MASK, on_policy=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", NAMES)
def test_finite_and_masked_tokens_get_zero_grad(name, case):
  _, _, inputs = make_inputs(name, seed=2, **CASES[case])
  out = jitted(name)(inputs)
  for mode in MODES_CHECKED:
    (val, (loss_BN, aux)), g = out[mode]
    label = f"{name}/{case}/{mode}"
    assert_all_finite(val, loss_BN, aux, g, label)
    assert_masked_grad_zero(g, inputs.mask_BN, label)
    lb = np.asarray(loss_BN)
    if lb.ndim == 2:
      assert np.all(lb[np.asarray(inputs.mask_BN) == 0] == 0.0), f"{label}: loss_BN nonzero outside the mask"
    if case == "empty_mask":
      np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trips(name):
  spec = losses.get(name)
  if "state" not in spec.needs:
    return
  spec, hp, inputs = make_inputs(name, seed=3)
  _, aux = spec.fn(inputs, hp)
  assert "state" in aux, f"{name} needs state but returns no aux['state']"
  s0, s1 = spec.init_state(hp), aux["state"]
  assert jax.tree_util.tree_structure(s0) == jax.tree_util.tree_structure(s1)
  for a, b in zip(jax.tree_util.tree_leaves(s0), jax.tree_util.tree_leaves(s1)):
    assert jnp.shape(a) == jnp.shape(b)


# ---------------------------------------------------------------------------------------------
# On-policy: behaviour = prox = current (same values), lag 0, versions = current. Under `reduce` the
# gradient of every importance-corrected loss must be -c_BN·m/N (token-mean) and -c_BN·m/(L_b·B')
# (seq-mean-token-mean) with c_BN = Â, the vanilla PG coefficient. This table lists the losses whose
# on-policy coefficient is *not* Â, with the exact expected formula; every loss not listed must equal PG.
#   delightful_pg: gated PG, c = σ(Â·(−log π)/η)·Â (addendum §6; no ratio, so "on-policy" changes nothing).
#   r2vpo: r ≡ 1 so Var(r) = 0 and ∂Var/∂r_i = 2(r_i − r̄)/N = 0: equals PG (listed for the record).
#   epo:   PPO part equals PG; the entropy terms read `entropy_BN`, not a function of logp_BN here,
#          so d/d logp is PG (listed for the record; the entropy gradient is tested in test_epo.py).
# Checked to equal PG at default Hparams, with the reason their docstrings give: gspo (s = 1 and the
# GSPO-token form carries ∇log π per token, so token-mean too, despite ε = 3e-4), drpo (r = 1: the
# penalty's gradient μ(r−1)/ε vanishes), vespo (log W = 0, φ(1) = 1), dppo/dppo_topk (D = 0, weight 1),
# m2po (M2 = 0), mu_grpo (no trigger), sat/sat_gspo (d = 0), hispo, alp, a3po, ppo_ewma, tis, mis,
# icepop, minirl, decoupled_ppo, cispo, ppo_clip (all ratios 1, nothing clipped or masked).


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


ON_POLICY_COEF = {
    "delightful_pg": lambda inp, hp: _sigmoid(np.asarray(inp.adv_BN) * -np.nan_to_num(
        np.where(np.asarray(inp.mask_BN) > 0, np.asarray(inp.logp_BN), 0.0)) / hp.eta) * np.asarray(inp.adv_BN),
    "r2vpo": lambda inp, hp: np.asarray(inp.adv_BN),
    "epo": lambda inp, hp: np.asarray(inp.adv_BN),
    # Distillation losses have no advantage term: on-policy here means teacher = reference = student
    # on the sampled tokens, so the sampled-token losses' signal (teacher − student) is 0, and the
    # full-vocabulary / top-k / Monte-Carlo losses differentiate other fields (student logits, top-k
    # or MC log-probs), not `logp_BN`. Their gradients are tested in their own files.
    **{n: (lambda inp, hp: np.zeros_like(np.asarray(inp.adv_BN)))
       for n in ("opd_reverse_kl", "opd_reverse_kl_full", "opd_forward_kl", "opd_topk_kl", "gkd_jsd",
                 "opd_reverse_kl_mc", "s2d_opd", "f_opd", "mopd_refresh")},
    # SMD's policy gradient flows into the shadow forward (`shadow_logp_BN`), its KL into the dense head; the dense
    # `logp_BN` only feeds a metric (tests/test_smd.py checks both gradients).
    "smd": lambda inp, hp: np.zeros_like(np.asarray(inp.adv_BN)),
}


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_gradient_relation_to_pg(name):
  spec, hp, inputs = make_inputs(name, seed=4, on_policy=True)
  out = jitted(name)(inputs)
  _, g = out["token-mean"]
  mask = np.asarray(inputs.mask_BN)
  coef = ON_POLICY_COEF.get(name, lambda inp, hp: np.asarray(inp.adv_BN))(inputs, hp)
  coef = np.where(mask > 0, coef, 0.0)
  want = np.where(mask > 0, -coef / mask.sum(), 0.0)
  np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-7, err_msg=name)
  _, g_seq = out["seq-mean-token-mean"]
  L = mask.sum(-1, keepdims=True)
  want_seq = np.where(mask > 0, -coef / np.maximum(L, 1.0), 0.0) / (L > 0).sum()
  np.testing.assert_allclose(np.asarray(g_seq), want_seq, rtol=1e-5, atol=1e-7, err_msg=name)
  # The reference itself: pg's gradient is exactly -Â·m/N.
  _, _, pin = make_inputs("pg", seed=4, on_policy=True)
  _, gpg = jitted("pg")(pin)["token-mean"]
  np.testing.assert_allclose(np.asarray(gpg), np.where(mask > 0, -np.asarray(pin.adv_BN) / mask.sum(), 0.0), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Metadata and registry behaviour.


@pytest.mark.parametrize("name", NAMES)
def test_metadata(name):
  spec = losses.get(name)
  assert spec.name == name
  assert dataclasses.is_dataclass(spec.Hparams) and spec.Hparams.__dataclass_params__.frozen, name
  hp = spec.Hparams()  # every field has a default (the paper's)
  fields = dataclasses.fields(hp)
  if fields:
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(hp, fields[0].name, getattr(hp, fields[0].name))
  assert "On-policy" in spec.doc, f"{name}: docstring must say what the loss reduces to On-policy"
  assert set(spec.needs) <= set(registry.NEED_FIELDS)
  assert ("state" in spec.needs) == (spec.init_state is not None)


def test_unknown_name_lists_valid_names():
  with pytest.raises(KeyError) as e:
    losses.get("definitely_not_a_loss")
  for n in NAMES:
    assert n in str(e.value)


def test_duplicate_registration_raises_and_unregister():
  spec = losses.get("pg")
  with pytest.raises(ValueError, match="already registered"):
    losses.register("pg", spec.fn, spec.Hparams)
  assert losses.get("pg") is spec  # the failed registration changed nothing
  losses.register("_conformance_tmp", spec.fn, spec.Hparams)
  try:
    assert "_conformance_tmp" in losses.names()
  finally:
    losses.unregister("_conformance_tmp")
  assert "_conformance_tmp" not in losses.names()


def test_register_rejects_bad_declarations():
  spec = losses.get("pg")
  with pytest.raises(ValueError, match="unknown needs"):
    losses.register("_bad_needs", spec.fn, spec.Hparams, needs=("nonsense",))
  with pytest.raises(ValueError, match="init_state"):
    losses.register("_bad_state", spec.fn, spec.Hparams, needs=("state",))
  with pytest.raises(TypeError):
    losses.register("_bad_hp", spec.fn, dict)
  assert not {"_bad_needs", "_bad_state", "_bad_hp"} & set(losses.names())


@pytest.mark.parametrize("name", [n for n in NAMES if losses.get(n).needs])
def test_check_needs_names_the_missing_field(name):
  spec, hp, inputs = make_inputs(name)
  for need in sorted(n for n in spec.needs if registry.NEED_FIELDS[n]):  # "perturb" is a learner hook, no field
    field = registry.NEED_FIELDS[need][0]
    with pytest.raises(ValueError) as e:
      losses.check_needs(spec, inputs.replace(**{field: None}))
    assert field in str(e.value) and need in str(e.value)
