"""The jitted train step: on-policy PPO equals PG, non-finite updates are skipped bitwise."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import learner
from jaxrl_llm.models import ModelConfig, init_params

CFG = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, max_seq_len=16)
P, N, B = 4, 3, 4


def make_batch(params, adv=1.0):
  key = jax.random.key(0)
  seq = jax.random.randint(key, (B, P + N), 3, 16)
  pos = jnp.broadcast_to(jnp.arange(P + N), (B, P + N))
  seg = jnp.ones((B, P + N), jnp.int32)
  mask = jnp.ones((B, N)).at[0, 2].set(0.0)
  logp = learner.make_score_fn(CFG, 1.0)(params, seq, pos, seg, mask)
  adv_BN = jnp.broadcast_to(jnp.array([1.0, -1.0, 0.5, 2.0])[:, None] * adv, (B, N)) * mask
  return learner.Batch(sequence_BT=seq, positions_BT=pos, segment_ids_BT=seg, mask_BN=mask, adv_BN=adv_BN,
                       behavior_logp_BN=logp, versions_BN=jnp.zeros((B, N), jnp.int32),
                       lag_B=jnp.zeros((B,), jnp.int32), prox_logp_BN=logp)


def copy(t):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), t)


def test_on_policy_ppo_update_equals_pg_update():
  params = init_params(CFG, jax.random.key(1))
  batch = make_batch(params)
  tx = learner.make_optimizer(1e-2, grad_clip=0.0)
  outs = {}
  for name in ("pg", "ppo_clip"):
    step = learner.make_train_step(CFG, tx, name, agg_mode="token-mean")
    state, m = step(learner.init_state(copy(params), tx), batch, jax.random.key(0))
    outs[name] = (state.params, m)
  for a, b in zip(jax.tree.leaves(outs["pg"][0]), jax.tree.leaves(outs["ppo_clip"][0])):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert float(outs["ppo_clip"][1]["grad_norm"]) > 0
  np.testing.assert_allclose(outs["pg"][1]["grad_norm"], outs["ppo_clip"][1]["grad_norm"], rtol=1e-5)


@pytest.mark.parametrize("name", ["ppo_clip", "cispo", "tis"])
def test_prox_none_means_current_policy(name):
  """prox_logp_BN=None (π_old := sg(log π_θ), no scoring pass) equals passing the current log-probs,
  and the in-step mismatch metric |π_old − μ| is measured against μ either way."""
  params = init_params(CFG, jax.random.key(5))
  batch = make_batch(params)
  behav = batch.behavior_logp_BN + 0.01 * batch.mask_BN  # μ differs from π_θ by exactly 0.01
  batch = batch.replace(behavior_logp_BN=behav)
  tx = learner.make_optimizer(1e-2, grad_clip=0.0)
  step = learner.make_train_step(CFG, tx, name, agg_mode="token-mean")
  outs = [step(learner.init_state(copy(params), tx), b, jax.random.key(0))
          for b in (batch, batch.replace(prox_logp_BN=None))]
  for a, b in zip(jax.tree.leaves(outs[0][0].params), jax.tree.leaves(outs[1][0].params)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  for m in (outs[0][1], outs[1][1]):
    np.testing.assert_allclose(m["mismatch_abs_mean"], 0.01, rtol=1e-3)
    np.testing.assert_allclose(m["mismatch_abs_max"], 0.01, rtol=1e-3)
  np.testing.assert_allclose(outs[0][1]["loss"], outs[1][1]["loss"], rtol=1e-5)


def test_fuse_reference_equals_scoring_first():
  """`fuse_reference` (reference scored inside the step) gives the update and metrics of scoring the
  reference first and passing `ref_logp_BN` in the batch; the reference it scores is `ref_params`."""
  params = init_params(CFG, jax.random.key(6))
  ref_params = init_params(CFG, jax.random.key(7))  # differs from the policy: the KL term is not 0
  batch = make_batch(params)
  tx = learner.make_optimizer(1e-2, grad_clip=0.0)
  score = learner.make_score_fn(CFG, 1.0)
  step = learner.make_train_step(CFG, tx, "ppo_clip", agg_mode="token-mean", kl_coef=0.5)
  ref_logp = score(ref_params, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT, batch.mask_BN)
  want = step(learner.init_state(copy(params), tx), batch.replace(ref_logp_BN=ref_logp), jax.random.key(0))
  fused = learner.fuse_reference(step, score)
  got = fused(learner.init_state(copy(params), tx), batch, jax.random.key(0), ref_params)
  # atol: 1e-4 of the learning rate. AdamW's first step is lr·g/(|g| + eps) per element, so where |g| is near eps
  # the last bits of g (the reference scored in another program) move the update by more than g's own rounding.
  for a, b in zip(jax.tree.leaves(want[0].params), jax.tree.leaves(got[0].params)):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
  for k in ("loss", "grad_norm", "kl_ref"):
    np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, err_msg=k)
  assert float(got[1]["kl_ref"]) > 1e-4
  # Scoring the policy itself as the reference gives KL 0: the fused step really reads `ref_params`.
  same = fused(learner.init_state(copy(params), tx), batch, jax.random.key(0), copy(params))
  np.testing.assert_allclose(same[1]["kl_ref"], 0.0, atol=1e-6)


def test_non_finite_loss_skips_update_bitwise():
  params = init_params(CFG, jax.random.key(2))
  batch = make_batch(params, adv=jnp.nan)
  tx = learner.make_optimizer(1e-2)
  step = learner.make_train_step(CFG, tx, "pg")
  state0 = learner.init_state(copy(params), tx)
  ref_params, ref_opt = copy(state0.params), copy(state0.opt_state)
  state, m = step(state0, batch, jax.random.key(0))
  assert int(m["update_skipped"]) == 1 and int(state.version) == 0 and int(state.step) == 1
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(ref_opt)):
    np.testing.assert_array_equal(a, b)
  state, m = step(state, batch, jax.random.key(0))
  assert int(m["skipped_consecutive"]) == 2
  good = make_batch(params)
  state, m = step(state, good, jax.random.key(0))
  assert int(m["update_skipped"]) == 0 and int(state.version) == 1 and int(m["skipped_consecutive"]) == 0


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_by_global_norm_is_optax_s(max_norm):
  """The clip as one scale factor (`learner.clip_by_global_norm`, for XLA's memory) against optax's own: the same
  updates up to rounding, clipped (norm 13.9 > 0.5) and not (< 100)."""
  g = {"a": jnp.arange(12.0).reshape(3, 4) - 5.0, "b": jnp.array([3.0, -4.0, 0.25])}
  ours, _ = learner.clip_by_global_norm(max_norm).update(g, ())
  theirs, _ = optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())
  for k in g:
    np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6)
  assert np.isclose(float(optax.global_norm(ours)), min(max_norm, float(optax.global_norm(g))), rtol=1e-6)


def test_train_step_compiles_once():
  params = init_params(CFG, jax.random.key(3))
  tx = learner.make_optimizer(1e-3)
  step = learner.make_train_step(CFG, tx, "ppo_clip")
  state = learner.init_state(params, tx)
  for i in range(3):
    state, _ = step(state, make_batch(state.params), jax.random.key(i))
  assert step._cache_size() == 1
  # the builders return one jitted function per static configuration: a second run in the process reuses it
  assert learner.make_train_step(CFG, tx, "ppo_clip") is step
  assert learner.make_train_step(CFG, tx, "ppo_clip", entropy_coef=0.01) is not step


def test_unknown_loss_and_bad_hparam():
  tx = learner.make_optimizer(1e-3)
  with pytest.raises(KeyError, match="valid names"):
    learner.make_train_step(CFG, tx, "nope")
  with pytest.raises(ValueError, match="loss.hparams.eps"):
    learner.make_train_step(CFG, tx, "ppo_clip", {"eps": 0.1})


def test_alp_trains_log_sigma_with_perturbed_numerator():
  params = init_params(CFG, jax.random.key(4))
  batch = make_batch(params)
  tx = learner.make_optimizer(1e-3, grad_clip=0.0)
  hook, joint = learner.perturb_hook("alp", CFG, tx, {"perturb_std": 0.05})
  np.testing.assert_allclose(np.exp(hook["log_sigma_L"]), [0.05], rtol=1e-6)
  step = learner.make_train_step(CFG, joint, "alp")
  hook0 = copy(hook)
  state = learner.init_state(copy(params), joint, hook_params=hook)
  s1, m1 = step(state, batch, jax.random.key(0))
  assert int(m1["update_skipped"]) == 0
  assert float(s1.hook_params["log_sigma_L"][0]) != float(np.log(0.05))  # σ received a gradient
  # Deterministic given the key; a different key draws different noise.
  s2, m2 = step(learner.init_state(copy(params), joint, hook_params=copy(hook0)), batch, jax.random.key(0))
  np.testing.assert_array_equal(m1["loss"], m2["loss"])
  _, m3 = step(learner.init_state(copy(params), joint, hook_params=copy(hook0)), batch, jax.random.key(1))
  assert float(m3["loss"]) != float(m1["loss"])
  assert learner.perturb_hook("ppo_clip", CFG, tx)[0] is None
