"""ParamStore: versions, refcounts, retention, and copies that a donated learner step cannot corrupt."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.rollout.param_store import ParamStore


def test_versions_and_retention():
  s = ParamStore(keep_last=2)
  assert s.publish({"w": jnp.zeros(3)}) == 0
  assert s.publish({"w": jnp.ones(3)}) == 1
  assert s.publish({"w": 2 * jnp.ones(3)}) == 2
  assert s.held_versions() == [1, 2]  # version 0 fell out of the window
  with pytest.raises(KeyError, match="version 0 is not held"):
    s.acquire(0)
  assert float(s.acquire().params["w"][0]) == 2.0  # default: newest


def test_pinned_snapshot_outlives_window_until_released():
  s = ParamStore(keep_last=1)
  s.publish({"w": jnp.zeros(2)})
  snap = s.acquire(0)
  s.publish({"w": jnp.ones(2)})
  s.publish({"w": jnp.ones(2)})
  assert s.held_versions() == [0, 2]
  s.release(snap)
  assert s.held_versions() == [2]
  with pytest.raises(ValueError):
    s.release(snap)


def test_donated_step_cannot_corrupt_snapshot():
  params = {"w": jnp.arange(4.0)}
  s = ParamStore(keep_last=2)
  s.publish(params)
  step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0 - 7.0, p), donate_argnums=0)
  new = step(params)  # donates `params`' buffers
  snap = s.acquire(0)
  np.testing.assert_array_equal(np.asarray(snap.params["w"]), np.arange(4.0))
  assert float(new["w"][0]) == -7.0


def test_sampler_dtype_and_learner_copy():
  s = ParamStore(keep_last=1, sampler_dtype=jnp.bfloat16, keep_learner_copy=True)
  s.publish({"w": jnp.full((2,), 1.0 + 2 ** -12), "i": jnp.arange(2)})
  snap = s.acquire()
  assert snap.params["w"].dtype == jnp.bfloat16 and snap.params["i"].dtype == jnp.int32
  assert snap.learner_params["w"].dtype == jnp.float32
  assert float(snap.learner_params["w"][0]) != float(snap.params["w"][0])  # a real precision mismatch
