"""EWMA parameter copy: golden values, limits, geometric convergence, no recompilation, no aliasing."""

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.rollout.ewma import ewma_init, ewma_update


def test_golden_step():
  e = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(4.0)}
  p = {"w": jnp.array([3.0, 2.0]), "b": jnp.array(0.0)}
  out = ewma_update(e, p, 0.75)
  np.testing.assert_allclose(out["w"], [0.75 * 1 + 0.25 * 3, 0.75 * -2 + 0.25 * 2])  # [1.5, -1.0]
  np.testing.assert_allclose(out["b"], 3.0)


def test_limits_and_geometric_convergence():
  e0 = {"w": jnp.array([2.0, -1.0])}
  p = {"w": jnp.array([0.0, 1.0])}
  np.testing.assert_array_equal(ewma_update(e0, p, 0.0)["w"], p["w"])
  np.testing.assert_array_equal(ewma_update(e0, p, 1.0)["w"], e0["w"])
  beta, e = 0.9, e0
  for _ in range(5):
    e = ewma_update(e, p, beta)
  # Constant params: ewma_k = β^k·e0 + (1 − β^k)·p.
  np.testing.assert_allclose(e["w"], beta ** 5 * e0["w"] + (1 - beta ** 5) * p["w"], rtol=1e-6)



def test_beta_is_traced(caplog):
  # Count compilations from JAX's compile log (the jit cache size is not a counter: other tests'
  # threads and garbage-collected entries can change it while this test runs).
  e0, p = {"w": jnp.array([2.0, -1.0, 0.5])}, {"w": jnp.array([0.0, 1.0, 0.5])}  # a shape no other test uses
  count = lambda: sum("Compiling" in r.getMessage() and "ewma_update" in r.getMessage() for r in caplog.records)
  with caplog.at_level(logging.WARNING), jax.log_compiles():
    ewma_update(e0, p, 0.3)
    assert count() == 1
    ewma_update(e0, p, 0.5)
    assert count() == 1  # a new beta: no recompilation


def test_dtype_kept_and_init_is_a_copy():
  p = {"w": jnp.ones(3, jnp.bfloat16), "step": jnp.array(3, jnp.int32)}
  e = ewma_init(p)
  out = ewma_update(e, {"w": jnp.zeros(3, jnp.bfloat16), "step": jnp.array(4, jnp.int32)}, 0.5)
  assert out["w"].dtype == jnp.bfloat16 and int(out["step"]) == 4
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32), 0.5)
  donate = jax.jit(lambda x: jax.tree.map(lambda a: a * 0 - 1, x), donate_argnums=0)
  donate(p)  # the learner step donates its params: the EWMA copy must survive
  np.testing.assert_array_equal(np.asarray(e["w"], np.float32), 1.0)


def test_ppo_ewma_run_anchors_to_the_ewma_copy(tmp_path):
  """configs/ppo_ewma_tiny.py through the loop, made on-policy (sync) so that only the anchor can move the ratio:
  π_prox is the EWMA copy, so r = π_θ/π_EWMA is exactly 1 at step 0 (the copy starts at θ) and leaves 1 once θ
  has moved away from the average (a recomputed π_old would keep r = 1 at every sync step)."""
  import os

  from jaxrl_llm import loop
  from jaxrl_llm.config import load_file
  c = load_file(os.path.join(os.path.dirname(__file__), "..", "configs", "ppo_ewma_tiny.py"))
  assert (c.loss.name, c.rollout.old_logp) == ("ppo_ewma", "ewma")
  c.rollout.mode, c.rollout.lag = "sync", 0
  c.num_steps, c.eval.every, c.checkpoint.every, c.log.tensorboard = 3, 0, 0, False
  c.optim.lr, c.optim.warmup_steps = 1e-2, 0
  rows = loop.run(c, str(tmp_path))
  dev = [max(abs(r["ratio_max"] - 1.0), 1.0 - r["ratio_ess"]) for r in rows]  # 0 when every ratio is 1
  assert dev[0] < 1e-5, dev  # the copy's scoring pass and the learner's forward: the same weights, rounding apart
  assert all(r["grad_norm"] > 0 for r in rows)
  assert min(dev[1:]) > 1e-3, dev
