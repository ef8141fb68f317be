"""MoE layer and routing replay (R3): numpy golden values for dispatch/capacity and the load-balancing
loss, router gradients under replay, sampler/learner agreement with replay, measured bf16 mismatch."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import learner, packing
from jaxrl_llm.config import load_file
from jaxrl_llm.models import ModelConfig, hidden_with_routing, init_params, moe, token_logprobs
from jaxrl_llm.sampling import SamplerConfig, generate

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32,
                  num_experts=4, experts_per_token=2, max_seq_len=32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(cfg, scale=5.0):
  """Init scaled up (norms excepted) so routing and next-token distributions are far from uniform."""
  f = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else scale * x
  return jax.tree_util.tree_map_with_path(f, init_params(cfg, jax.random.key(0)))


# ------------------------------------------------------------------------------- layer vs numpy

def np_moe(x_BTD, router, wg, wu, wd, k, X):
  """Loop reference: top-k, renormalised gates, choice-major capacity, SwiGLU experts."""
  B, T, _ = x_BTD.shape
  y = np.zeros_like(x_BTD)
  silu = lambda z: z / (1 + np.exp(-z))
  for b in range(B):
    logits = x_BTD[b] @ router
    ids = np.argsort(-logits, axis=-1)[:, :k]
    g = np.exp(np.take_along_axis(logits, ids, -1))
    g /= g.sum(-1, keepdims=True)
    load = np.zeros(router.shape[1], int)
    for j in range(k):
      for t in range(T):
        e = ids[t, j]
        if load[e] < X:
          y[b, t] += g[t, j] * ((silu(x_BTD[b, t] @ wg[e]) * (x_BTD[b, t] @ wu[e])) @ wd[e])
        load[e] += 1
  return y


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_moe_mlp_matches_numpy_loop(capacity_factor):
  B, T, D, E, F, k = 2, 6, 8, 4, 5, 2
  ks = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(ks[0], (B, T, D))
  p = {"router": jax.random.normal(ks[1], (D, E)), "w_gate": 0.3 * jax.random.normal(ks[2], (E, D, F)),
       "w_up": 0.3 * jax.random.normal(ks[3], (E, D, F)), "w_down": 0.3 * jax.random.normal(ks[4], (E, F, D))}
  y, ids, _ = moe.moe_mlp(x, p, k=k, capacity_factor=capacity_factor)
  X = moe.capacity(T, k, E, capacity_factor)
  assert X == (T if capacity_factor == 0 else 2)  # ceil(0.5 * 6 * 2 / 4) = 2: some assignments dropped
  ref = np_moe(*(np.asarray(a, np.float64) for a in (x, p["router"], p["w_gate"], p["w_up"], p["w_down"])), k, X)
  np.testing.assert_allclose(y, ref, atol=1e-5)
  if capacity_factor:
    dropless, _, _ = moe.moe_mlp(x, p, k=k)
    assert float(jnp.max(jnp.abs(dropless - y))) > 1e-3  # the capacity really dropped something


def test_load_balance_loss_golden():
  # Uniform router probabilities and perfectly balanced assignments: aux = 1.
  logits = jnp.zeros((1, 4, 4))
  ids = jnp.array([[[0, 1], [2, 3], [0, 1], [2, 3]]])
  assert float(moe.load_balance_loss(*moe.load_balance_stats(logits, ids, jnp.ones((1, 4))), 2)) == pytest.approx(1.0)
  # Hand example, E=2, k=1, 3 real tokens + 1 padding: f = (2/3, 1/3), P = mean softmax rows.
  logits = jnp.array([[[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [9.0, -9.0]]])
  ids = jnp.array([[[0], [0], [1], [1]]])
  real = jnp.array([[1, 1, 1, 0]])
  sm = np.exp([[0, 0], [1, 0], [0, 2]]) / np.exp([[0, 0], [1, 0], [0, 2]]).sum(-1, keepdims=True)
  expect = 2 * np.sum(np.array([2 / 3, 1 / 3]) * sm.mean(0))
  got = moe.load_balance_loss(*moe.load_balance_stats(logits, ids, real), 1)
  assert float(got) == pytest.approx(expect, rel=1e-6)


def test_replay_uses_recorded_ids_and_router_still_gets_gradients():
  B, T, D, E, F, k = 1, 5, 8, 4, 5, 2
  ks = jax.random.split(jax.random.key(1), 5)
  x = jax.random.normal(ks[0], (B, T, D))
  p = {"router": jax.random.normal(ks[1], (D, E)), "w_gate": jax.random.normal(ks[2], (E, D, F)),
       "w_up": jax.random.normal(ks[3], (E, D, F)), "w_down": jax.random.normal(ks[4], (E, F, D))}
  y_native, ids, _ = moe.moe_mlp(x, p, k=k)
  y_same, ids_same, _ = moe.moe_mlp(x, p, k=k, forced_ids_BTk=ids)
  np.testing.assert_array_equal(y_same, y_native)
  np.testing.assert_array_equal(ids_same, ids)
  forced = (ids + 1) % E  # other experts
  y_forced, ids_forced, _ = moe.moe_mlp(x, p, k=k, forced_ids_BTk=forced)
  np.testing.assert_array_equal(ids_forced, forced)
  assert float(jnp.max(jnp.abs(y_forced - y_native))) > 1e-2
  # Gates are softmax(logits at the forced ids): the router gradient is non-zero.
  g = jax.grad(lambda r: jnp.sum(moe.moe_mlp(x, {**p, "router": r}, k=k, forced_ids_BTk=forced)[0] ** 2))(p["router"])
  assert float(jnp.max(jnp.abs(g))) > 1e-3
  # ... and exactly the gradient of the explicit formula.
  def manual(r):
    logits = jnp.einsum("btd,de->bte", x, r)
    gates = jax.nn.softmax(jnp.take_along_axis(logits, forced, -1), -1)
    expert = lambda e: jnp.einsum("btf,fd->btd", jax.nn.silu(x @ p["w_gate"][e]) * (x @ p["w_up"][e]), p["w_down"][e])
    outs = jnp.stack([expert(e) for e in range(E)], 2)  # [B, T, E, D]
    y = jnp.sum(gates[..., None] * jnp.take_along_axis(outs, forced[..., None], 2), 2)
    return jnp.sum(y ** 2)
  np.testing.assert_allclose(g, jax.grad(manual)(p["router"]), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------- model-level

def test_model_routes_replay_and_remat_policies():
  params = random_params(CFG)
  tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, 32)
  h, routing = hidden_with_routing(params, tokens, CFG)
  assert routing["routes_BTLk"].shape == (2, 7, CFG.n_layers, 2) and routing["router_aux_loss"].shape == ()
  h2, routing2 = hidden_with_routing(params, tokens, CFG, routes_BTLk=routing["routes_BTLk"])
  np.testing.assert_array_equal(h, h2)
  np.testing.assert_array_equal(routing2["routes_BTLk"], routing["routes_BTLk"])

  def loss(p, routes, cfg):
    out = token_logprobs(p, tokens[:, :-1], tokens[:, 1:], cfg, routes_BTLk=routes)
    return out["logp_BT"].sum() + out["router_aux_loss"]

  routes = routing["routes_BTLk"][:, :-1]
  ref_v, ref_g = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=CFG)))(params, routes)
  assert float(jnp.max(jnp.abs(ref_g["layers"]["router"]))) > 0
  for remat in (True, "dots"):
    cfg = dataclasses.replace(CFG, remat=remat)
    v, g = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=cfg)))(params, routes)
    np.testing.assert_allclose(v, ref_v, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="model.remat"):
    dataclasses.replace(CFG, remat="sometimes")
  with pytest.raises(ValueError, match="model.experts_per_token"):
    dataclasses.replace(CFG, experts_per_token=5)


def _sample(params, sampler_cfg_model, B=8):
  P = 5
  prompts = jax.random.randint(jax.random.key(3), (B, P), 4, 32)
  plen = jnp.tile(jnp.array([5, 2, 3, 5, 1, 4, 5, 3]), B // 8)
  sc = SamplerConfig(max_new_tokens=6, stop_ids=(3,), temperature=1.0)
  return generate(params, prompts, plen, jax.random.key(4), sampler_cfg_model, sc)


def _learner_logp(params, out, routes, cfg=CFG):
  score = learner.make_score_fn(cfg, 1.0)
  return score(params, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], out["mask_BN"], routes)


def _mismatch(a, b, mask):
  return float(jnp.sum(jnp.abs(a - b) * mask) / jnp.sum(mask))


def test_sampler_routes_replayed_by_the_learner_give_equal_logprobs():
  params = random_params(CFG)
  out = _sample(params, CFG)
  routes = out["routes_BTLk"]
  B, T = out["sequence_BT"].shape
  assert routes.shape == (B, T, CFG.n_layers, 2) and routes.dtype == jnp.int32
  mask = out["mask_BN"]
  replay = _learner_logp(params, out, routes)
  np.testing.assert_allclose(replay * mask, out["behavior_logp_BN"] * mask, atol=2e-5)
  # The recorded routes are what a full forward routes natively (fp32 both sides) on real tokens.
  _, routing = hidden_with_routing(params, out["sequence_BT"][:, :-1], CFG, positions_BT=out["positions_BT"][:, :-1],
                                   segment_ids_BT=out["segment_ids_BT"][:, :-1])
  real = np.asarray(out["segment_ids_BT"][:, :-1] > 0)
  np.testing.assert_array_equal(np.asarray(routing["routes_BTLk"])[real], np.asarray(routes[:, :-1])[real])


def test_bf16_sampler_mismatch_with_and_without_replay():
  """Measured (printed with -s): routing replay removes the routing part of the train/infer gap.

  16 experts, top-4: more near-tied router logits than 4 experts, so bf16 flips some decisions.
  """
  cfg = dataclasses.replace(CFG, num_experts=16, experts_per_token=4)
  params = random_params(cfg)
  out = _sample(params, dataclasses.replace(cfg, dtype="bfloat16"), B=32)
  mask = out["mask_BN"]
  native = _learner_logp(params, out, None, cfg)
  replay = _learner_logp(params, out, out["routes_BTLk"], cfg)
  _, routing = hidden_with_routing(params, out["sequence_BT"][:, :-1], cfg, positions_BT=out["positions_BT"][:, :-1],
                                   segment_ids_BT=out["segment_ids_BT"][:, :-1])
  real = np.asarray(out["segment_ids_BT"][:, :-1] > 0)
  differ = np.any(np.sort(np.asarray(routing["routes_BTLk"]), -1) != np.sort(np.asarray(out["routes_BTLk"][:, :-1]), -1), -1)
  frac_layer = float(differ[real].mean())
  frac_token = float(differ.any(-1)[real].mean())
  m_native, m_replay = _mismatch(native, out["behavior_logp_BN"], mask), _mismatch(replay, out["behavior_logp_BN"], mask)
  print(f"\nbf16 sampler vs fp32 learner: routes differ on {frac_layer:.3f} of (token, layer), {frac_token:.3f} of "
        f"tokens; mean |Δlogp| without replay {m_native:.5f}, with replay {m_replay:.5f}")
  assert frac_layer > 0  # bf16 really flips some routing decisions
  assert m_replay < m_native


def test_learner_step_with_replayed_routes_is_on_policy_at_step_zero():
  params = random_params(CFG)
  out = _sample(params, CFG)
  mask = out["mask_BN"]
  logp = _learner_logp(params, out, out["routes_BTLk"])
  B = mask.shape[0]
  batch = learner.Batch(sequence_BT=out["sequence_BT"], positions_BT=out["positions_BT"],
                        segment_ids_BT=out["segment_ids_BT"], mask_BN=mask,
                        adv_BN=jnp.linspace(-1, 1, B)[:, None] * mask, behavior_logp_BN=out["behavior_logp_BN"],
                        versions_BN=jnp.zeros(mask.shape, jnp.int32), lag_B=jnp.zeros((B,), jnp.int32),
                        prox_logp_BN=logp, routes_BTLk=out["routes_BTLk"])
  tx = learner.make_optimizer(1e-3)
  step = learner.make_train_step(CFG, tx, "ppo_clip", router_aux_coef=0.01)
  state, m = step(learner.init_state(jax.tree.map(jnp.copy, params), tx), batch, jax.random.key(0))  # step donates
  assert m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
  assert float(m["kl_mu_k1"]) == pytest.approx(0.0, abs=1e-5)
  assert 1.0 <= float(m["router_aux_loss"]) < CFG.num_experts and int(m["update_skipped"]) == 0
  assert float(jnp.max(jnp.abs(state.params["layers"]["router"] - params["layers"]["router"]))) > 0


def test_r2_replays_the_step_start_routes_in_every_update():
  """R2 (`old_policy_routes`): a step of 2 minibatches × 2 epochs routes the step-start forward natively and every
  update replays those ids, so it equals the R3 step given the routes of `hidden_with_routing` at the step-start
  parameters as if a sampler had recorded them; with a large learning rate the first update moves some routes, so
  it differs from routing afresh in every update."""
  params = random_params(CFG)
  out = _sample(params, CFG)
  mask, B = out["mask_BN"], out["mask_BN"].shape[0]
  _, routing = hidden_with_routing(params, out["sequence_BT"][:, :-1], CFG, positions_BT=out["positions_BT"][:, :-1],
                                   segment_ids_BT=out["segment_ids_BT"][:, :-1])
  start = jnp.pad(routing["routes_BTLk"], ((0, 0), (0, 1), (0, 0), (0, 0)))
  batch = learner.Batch(sequence_BT=out["sequence_BT"], positions_BT=out["positions_BT"],
                        segment_ids_BT=out["segment_ids_BT"], mask_BN=mask,
                        adv_BN=jnp.linspace(-1, 1, B)[:, None] * mask, behavior_logp_BN=out["behavior_logp_BN"],
                        versions_BN=jnp.zeros(mask.shape, jnp.int32), lag_B=jnp.zeros((B,), jnp.int32))
  tx = learner.make_optimizer(0.05)
  # no load-balancing loss: over packed rows its value differs (`packing` docstring), and Adam would amplify that
  kw = dict(router_aux_coef=0.0, minibatches=2, epochs=2)

  def run(routes, r2, pack=None):
    step = learner.make_train_step(CFG, tx, "ppo_clip", old_policy_routes=r2, **kw)
    st, m = step(learner.init_state(jax.tree.map(jnp.copy, params), tx),
                 batch.replace(routes_BTLk=routes, pack=pack), jax.random.key(0))
    return st.params, m

  r2, m2 = run(None, True)
  r3, m3 = run(start, False)
  fresh, _ = run(None, False)
  T = out["sequence_BT"].shape[1]  # the packed learner: each minibatch's rows packed on their own, same R2 routes
  pk = packing.pack(*(np.asarray(out[k]) for k in ("sequence_BT", "positions_BT", "segment_ids_BT")), 2 * T, 2)
  r2_packed, _ = run(None, True, jax.tree.map(jnp.asarray, pk))
  assert int(m2["updates_applied"]) == 4
  gap = lambda x, y: max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
  # Adam's 4 updates at lr 0.05 turn rounding (replayed vs computed gates) into ~5e-5; fresh routing moves ~0.25
  assert gap(r2, r3) < 1e-3 and gap(r2, fresh) > 100 * gap(r2, r3), (gap(r2, r3), gap(r2, fresh))
  assert gap(r2, r2_packed) < 1e-3
  np.testing.assert_allclose(float(m2["loss"]), float(m3["loss"]), rtol=1e-5)
  _, moved = hidden_with_routing(r2, out["sequence_BT"][:, :-1], CFG, positions_BT=out["positions_BT"][:, :-1],
                                 segment_ids_BT=out["segment_ids_BT"][:, :-1])
  assert (np.asarray(moved["routes_BTLk"]) != np.asarray(routing["routes_BTLk"])).any()  # the updates moved routes


def test_routing_replay_modes():
  """`model.routing_replay`: True / "R3" the sampler records routes for the learner; "R2" it does not and the
  learner replays its own step-start routes; False neither; a dense model: off; anything else names the field."""
  from jaxrl_llm import config as config_lib, wiring  # noqa: PLC0415
  c = _moe_tiny()
  for value, mode in ((True, "R3"), ("R3", "R3"), ("R2", "R2"), (False, "off")):
    c.model.routing_replay = value
    config_lib.validate(c)
    assert config_lib.routing_replay_mode(c) == mode
    assert wiring.rollout_settings(c).routing_replay == (mode == "R3")
  c.model.num_experts = 0
  c.model.routing_replay = "R2"
  assert config_lib.routing_replay_mode(c) == "off"
  c.model.routing_replay = "R1"
  with pytest.raises(config_lib.ConfigError, match="model.routing_replay"):
    config_lib.validate(c)


# -------------------------------------------------------------------------------- config / CLI

def _moe_tiny():
  return load_file(os.path.join(ROOT, "configs", "moe_tiny.py"))


def test_moe_tiny_config_is_a_valid_moe_delta():
  from jaxrl_llm import config as config_lib
  c = _moe_tiny()
  config_lib.validate(c)
  assert c.model.num_experts > 0 and c.model.routing_replay and c.model.n_layers == 1
  ModelConfig(vocab_size=32, d_model=c.model.d_model, n_layers=c.model.n_layers, n_heads=c.model.n_heads,
              n_kv_heads=c.model.n_kv_heads, head_dim=c.model.head_dim, d_ff=c.model.d_ff,
              num_experts=c.model.num_experts, experts_per_token=c.model.experts_per_token,
              capacity_factor=c.model.capacity_factor)


def _loop_wired_for_moe() -> bool:
  from jaxrl_llm import policy_init
  c = _moe_tiny()
  return getattr(policy_init.model_config(c, 8), "num_experts", 0) == c.model.num_experts


@pytest.mark.slow
@pytest.mark.skipif(not _loop_wired_for_moe(), reason="policy_init.model_config does not pass model.num_experts yet")
def test_moe_tiny_runs_end_to_end(tmp_path):
  from jaxrl_llm import loop
  c = _moe_tiny()
  c.log.tensorboard = False
  c.num_steps = 2
  c.eval.every = 0
  rows = loop.run(c, str(tmp_path))
  assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
  assert "router_aux_loss" in rows[0]
