"""PR2 (`jaxrl_llm.route_predictor`): the routers the sampler routes with, predicted from the optimiser's moments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import learner, route_predictor
from jaxrl_llm.config import ConfigError, load_file, validate
from jaxrl_llm.rollout.param_store import ParamStore


def _params(key=0):
  k = jax.random.split(jax.random.key(key), 3)
  return {"embed": jax.random.normal(k[0], (5, 4)),
          "layers": {"router": jax.random.normal(k[1], (2, 4, 3)), "w_up": jax.random.normal(k[2], (2, 3, 4, 6))}}


def test_adamw_prediction_is_the_next_zero_gradient_update_numpy_golden():
  """After one AdamW update with gradient g, the predicted next update of the router is AdamW's formula with a zero
  gradient (m' = b1·m, v' = b2·v, bias-corrected at count 2, plus weight decay), times the horizon; nothing else
  moves."""
  lr, b1, b2, wd, h = 0.05, 0.9, 0.98, 0.1, 4
  tx = learner.make_optimizer(lr, weight_decay=wd, b1=b1, b2=b2)
  params = _params()
  g = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
  updates, opt_state = tx.update(g, tx.init(params), params)
  params = jax.tree.map(lambda p, u: p + u, params, updates)
  pred, rel = route_predictor.predict_routers(tx, h, params, opt_state)

  W, G = np.asarray(params["layers"]["router"], np.float64), np.asarray(g["layers"]["router"], np.float64)
  m, v = b1 * (1 - b1) * G, b2 * (1 - b2) * G ** 2
  u = -lr * ((m / (1 - b1 ** 2)) / (np.sqrt(v / (1 - b2 ** 2)) + 1e-8) + wd * W)
  np.testing.assert_allclose(np.asarray(pred["layers"]["router"]), W + h * u, rtol=1e-5, atol=1e-6)
  assert float(rel) == pytest.approx(np.linalg.norm(h * u) / np.linalg.norm(W), rel=1e-4)
  for path in (("embed",), ("layers", "w_up")):
    a, b = pred, params
    for p in path:
      a, b = a[p], b[p]
    assert a is b  # every other weight is the learner's own array


def test_fresh_optimizer_predicts_no_move_and_dense_or_lora_policies_pass_through():
  tx = learner.make_optimizer(0.05)
  params = _params()
  pred, rel = route_predictor.predict_routers(tx, 3, params, tx.init(params))
  np.testing.assert_array_equal(np.asarray(pred["layers"]["router"]), np.asarray(params["layers"]["router"]))
  assert float(rel) == 0.0
  dense = {"embed": params["embed"], "layers": {"w_up": params["layers"]["w_up"]}}
  assert route_predictor.predict_routers(tx, 3, dense, tx.init(dense))[0] is dense
  with_lora = {**params, "lora": {"a": jnp.ones((2, 2))}}  # the router is in the frozen base
  assert route_predictor.predict_routers(tx, 3, with_lora, tx.init(with_lora["lora"]))[0] is with_lora


def test_store_serves_the_sampler_params_and_keeps_the_learner_copy():
  store = ParamStore(keep_last=2, keep_learner_copy=True)
  params = _params()
  shifted = {**params, "layers": {**params["layers"], "router": params["layers"]["router"] + 1.0}}
  v = store.publish(params, sampler_params=shifted)
  snap = store.acquire(v)
  np.testing.assert_array_equal(np.asarray(snap.params["layers"]["router"]), np.asarray(shifted["layers"]["router"]))
  np.testing.assert_array_equal(np.asarray(snap.learner_params["layers"]["router"]),
                                np.asarray(params["layers"]["router"]))
  store.release(snap)


def test_pr2_horizon_is_validated():
  c = load_file("configs/moe_tiny.py")
  c.model.routing_replay = "PR2"
  validate(c)
  c.model.pr2_horizon = 0
  with pytest.raises(ConfigError, match="model.pr2_horizon"):
    validate(c)


@pytest.mark.slow
def test_pr2_run_samples_with_the_predicted_routers_and_scores_with_the_learner(tmp_path):
  """moe_tiny with PR2 at a long horizon: version 0 (no moments yet) samples with the learner's routers (μ equals
  π_old to float noise); later versions sample with routers moved by `pr2_router_shift`, so μ departs from the
  learner's π_old (scored from its own copy with the recorded routes replayed)."""
  from jaxrl_llm import loop
  c = load_file("configs/moe_tiny.py")
  c.log.tensorboard, c.log.progress, c.num_steps, c.eval.every = False, False, 2, 0
  c.model.routing_replay, c.model.pr2_horizon = "PR2", 1000
  rows = loop.run(c, str(tmp_path))
  assert all(r["pr2_router_shift"] > 0.01 for r in rows), rows
  assert rows[0]["mismatch_abs_max"] < 1e-5 < rows[1]["mismatch_abs_mean"], rows
