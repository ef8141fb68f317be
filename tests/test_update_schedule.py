"""optim.minibatches / optim.epochs: several optimiser updates per rollout batch with π_old fixed.

n = E = 1 is today's step; n minibatches equal n sequential single-batch steps on the same data; the
PPO ratio leaves 1 after the first minibatch; one compile; the config keeps GRPO groups whole.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import learner
from jaxrl_llm.config import ConfigError, validate
from jaxrl_llm.models import ModelConfig, init_params

CFG = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, max_seq_len=16)
P, N, B = 3, 4, 8
TX = optax.adam(1e-2)
SCORE = learner.make_score_fn(CFG, 1.0)


def make_batch(params, prox=True):
  seq = jax.random.randint(jax.random.key(0), (B, P + N), 3, 16)
  pos = jnp.broadcast_to(jnp.arange(P + N), (B, P + N))
  seg = jnp.ones((B, P + N), jnp.int32)
  lengths = jnp.array([4, 1, 3, 2, 4, 4, 2, 3])
  mask = (jnp.arange(N)[None, :] < lengths[:, None]).astype(jnp.float32)
  logp = SCORE(params, seq, pos, seg, mask)
  adv = jnp.linspace(-1.0, 1.5, B)[:, None] * mask
  return learner.Batch(sequence_BT=seq, positions_BT=pos, segment_ids_BT=seg, mask_BN=mask, adv_BN=adv,
                       behavior_logp_BN=logp - 0.05 * mask, versions_BN=jnp.zeros((B, N), jnp.int32),
                       lag_B=jnp.zeros((B,), jnp.int32), prox_logp_BN=logp if prox else None)


def fresh(params):
  return learner.init_state(jax.tree.map(lambda x: jnp.array(x, copy=True), params), TX)


def rows(batch, lo, hi):
  return jax.tree.map(lambda x: x[lo:hi], batch)


def assert_trees_close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def test_one_minibatch_one_epoch_is_todays_step():
  params = init_params(CFG, jax.random.key(1))
  batch = make_batch(params, prox=False)
  key = jax.random.key(3)
  s0, m0 = learner.make_train_step(CFG, TX, "decoupled_ppo")(fresh(params), batch, key)
  s1, m1 = learner.make_train_step(CFG, TX, "decoupled_ppo", minibatches=1, epochs=1)(fresh(params), batch, key)
  for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert m0.keys() == m1.keys()
  for k in m0:
    np.testing.assert_array_equal(np.asarray(m0[k]), np.asarray(m1[k]))
  # π_old = the current parameters: the PPO ratio is exactly 1 (no extra scoring pass).
  assert float(m1["ratio_old_abs_dev"]) == 0.0 and float(m1["ratio_max"]) == 1.0
  assert int(s1.version) == 1 and int(m1["updates_applied"]) == 1


@pytest.mark.parametrize("n,epochs,given_prox", [(2, 1, True), (4, 1, False), (2, 2, False)])
def test_minibatches_equal_sequential_single_batch_steps(n, epochs, given_prox):
  params = init_params(CFG, jax.random.key(1))
  batch = make_batch(params, prox=given_prox)
  key = jax.random.key(3)
  multi = learner.make_train_step(CFG, TX, "decoupled_ppo", minibatches=n, epochs=epochs)
  sm, mm = multi(fresh(params), batch, key)
  # Reference: n·E plain steps, each on one minibatch, π_old = the step-start parameters throughout.
  ref_batch = batch if given_prox else batch.replace(prox_logp_BN=SCORE(params, batch.sequence_BT, batch.positions_BT,
                                                                         batch.segment_ids_BT, batch.mask_BN))
  single = learner.make_train_step(CFG, TX, "decoupled_ppo")
  st, losses_ = fresh(params), []
  for e in range(epochs):
    for j in range(n):
      st, m = single(st, rows(ref_batch, j * B // n, (j + 1) * B // n), jax.random.fold_in(key, e * n + j))
      losses_.append(float(m["loss"]))
  assert_trees_close(sm.params, st.params, rtol=2e-5, atol=1e-6)
  assert_trees_close(sm.opt_state, st.opt_state, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(float(mm["loss"]), np.mean(losses_), rtol=1e-5, atol=1e-7)
  # One learner step, one published version, n·E optimiser updates.
  assert int(sm.step) == 1 and int(sm.version) == 1 and int(st.version) == n * epochs
  assert int(mm["updates_applied"]) == n * epochs and int(mm["update_skipped"]) == 0


def test_ppo_ratio_departs_from_one_after_the_first_minibatch():
  params = init_params(CFG, jax.random.key(1))
  batch = make_batch(params, prox=False)  # π_old = the step-start parameters (sync / step_start)
  key = jax.random.key(3)
  _, m1 = learner.make_train_step(CFG, TX, "decoupled_ppo")(fresh(params), batch, key)
  _, m2 = learner.make_train_step(CFG, TX, "decoupled_ppo", minibatches=2)(fresh(params), batch, key)
  assert float(m1["ratio_old_abs_dev_last"]) == 0.0 and float(m1["ratio_max"]) == 1.0
  assert float(m2["ratio_old_abs_dev_last"]) > 1e-4  # the second minibatch sees the moved policy
  assert float(m2["ratio_max"]) > 1.0 + 1e-4


def test_compiles_once_and_argument_checks():
  params = init_params(CFG, jax.random.key(1))
  traces = []
  step = learner.make_train_step(CFG, TX, "decoupled_ppo", minibatches=2, epochs=2, on_trace=lambda: traces.append(1))
  st = fresh(params)
  for t in range(2):
    st, _ = step(st, make_batch(params), jax.random.key(t))
  assert len(traces) == 1 and int(st.version) == 2
  with pytest.raises(ValueError, match="optim.minibatches"):
    learner.make_train_step(CFG, TX, "pg", minibatches=0)
  with pytest.raises(ValueError, match="optim.epochs"):
    learner.make_train_step(CFG, TX, "pg", epochs=0)
  with pytest.raises(ValueError, match="optim.minibatches=3 must divide the batch size"):
    learner.make_train_step(CFG, TX, "pg", minibatches=3)(fresh(params), make_batch(params), jax.random.key(0))


def test_non_finite_minibatch_is_skipped_alone():
  params = init_params(CFG, jax.random.key(1))
  batch = make_batch(params)
  bad = batch.replace(adv_BN=batch.adv_BN.at[B - 1, 0].set(jnp.nan))  # poisons the second minibatch only
  step = learner.make_train_step(CFG, TX, "decoupled_ppo", minibatches=2)
  s, m = step(fresh(params), bad, jax.random.key(0))
  assert int(m["updates_applied"]) == 1 and int(m["update_skipped"]) == 0 and int(s.version) == 1
  assert int(m["skipped_consecutive"]) == 1
  ref, _ = learner.make_train_step(CFG, TX, "decoupled_ppo")(fresh(params), rows(batch, 0, B // 2), jax.random.fold_in(jax.random.key(0), 0))
  assert_trees_close(s.params, ref.params, rtol=1e-6, atol=1e-7)


def test_config_keeps_groups_whole():
  from jaxrl_llm.config import load_file
  import os
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = load_file(os.path.join(root, "configs", "tiny.py"))
  c.optim.minibatches = c.rollout.prompts_per_step + 1
  with pytest.raises(ConfigError, match="optim.minibatches"):
    validate(c)
  c.optim.minibatches = 1
  c.optim.epochs = 0
  with pytest.raises(ConfigError, match="optim.epochs"):
    validate(c)
