"""PR2 (Predictive Routing Replay, arXiv 2606.00395): the sampler routes with each MoE router as it is predicted to be
a few updates ahead; the learner replays those routes (R3's replay of the sampler's recorded expert ids).

The paper gives each router "a lightweight evolution predictor that learns to anticipate short-horizon router
evolution"; its inputs, targets and loss were not recovered (methods-rl §8). [GUESS] The predictor here is the one
the optimiser already learns: AdamW's moments estimate where each router weight is going, and the update they make
with no new gradient (`tx.update` of zeros: the momentum term plus weight decay, at the next step's learning rate)
is the predicted next change. The router the sampler routes with is W + h·u (linear extrapolation over
`model.pr2_horizon` = h updates; h = the expected staleness of a sample when it is trained on). Only the routers
move: every other weight the sampler reads is the learner's, and gates at the chosen ids come from the same
predicted router (the sampler's μ is that model's; π_old is recomputed from the learner's own copy, replaying the
routes). Nothing is carried: the prediction is a pure function of the train state, so resume is exact. A LoRA
policy's router is frozen (no moment), so its prediction is the router itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.models import lora


def predicted_update(tx, params, opt_state, hook_params=None):
  """The update `tx` would apply at its next step with a zero gradient, for the policy's trainable params (the
  adapters of a LoRA policy, with the hook's params when `hook_params` is given, as the learner's step holds them)."""
  own = lora.trainable(params)
  trainable = own if hook_params is None else (own, hook_params)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, trainable), opt_state, trainable)
  return updates if hook_params is None else updates[0]


def predict_routers(tx, horizon: float, params, opt_state, hook_params=None):
  """(params with every MoE router replaced by its prediction W + horizon · u, relative size of the change
  ‖horizon · u‖ / ‖W‖). Params without a router, or whose router is not trainable (LoRA), come back as they are."""
  layers = params.get("layers", {}) if isinstance(params, dict) else {}
  if "router" not in layers or lora.has_adapters(params):
    return params, jnp.zeros((), jnp.float32)
  u = predicted_update(tx, params, opt_state, hook_params)["layers"]["router"]
  w = layers["router"]
  delta = (horizon * u).astype(w.dtype)
  rel = jnp.linalg.norm(delta.astype(jnp.float32)) / jnp.maximum(jnp.linalg.norm(w.astype(jnp.float32)), 1e-12)
  return {**params, "layers": {**layers, "router": w + delta}}, rel


def make_predictor(tx, horizon: float):
  """A jitted `state -> (sampler params, relative router change)` over a `learner.TrainState`."""
  f = jax.jit(functools.partial(predict_routers, tx, float(horizon)))
  return lambda state: f(state.params, state.opt_state, state.hook_params)
