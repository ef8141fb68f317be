"""LoRA policies (models/lora.py): zero-B adapters are the base exactly, the merge is W + scale·(BA)ᵀ, gradients
reach the adapters only (and are the LoRA chain rule of the base model's weight gradient), the sampler computes
with the adapters the learner just published, resume is exact, QLoRA trains, and bad fields are one-line errors."""

import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import learner, loop
from jaxrl_llm.config import load_file
from jaxrl_llm.metrics import read_jsonl
from jaxrl_llm.models import ModelConfig, forward, forward_with_cache, hf, init_cache, init_params, lora
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.sampling import SamplerConfig, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24, max_seq_len=16)
ALL = tuple(lora.TARGETS)
P, N, B = 4, 3, 4


def adapted(targets=ALL, rank=3, alpha=6.0, b_std=0.0, seed=0):
  """(base, policy): random base and its adapters (B drawn with std `b_std`, 0 = PEFT's zero init)."""
  base = init_params(CFG, jax.random.key(seed))
  ad = lora.init_adapters(CFG, lora.LoraConfig(rank, alpha, targets), jax.random.key(seed + 1))
  if b_std:
    keys = iter(jax.random.split(jax.random.key(seed + 2), len(ad.weights)))
    ad = ad.replace(weights={w: {**ab, "lora_B": b_std * jax.random.normal(next(keys), ab["lora_B"].shape)}
                             for w, ab in ad.weights.items()})
  return base, lora.attach(base, ad)


def tokens(seed=3, T=7):
  return jax.random.randint(jax.random.key(seed), (2, T), 0, CFG.vocab_size)


def test_zero_b_equals_the_base_exactly():
  base, policy = adapted()
  assert all(float(jnp.abs(ab["lora_A"]).max()) > 0 for ab in policy["lora"].weights.values())  # A is not zero
  np.testing.assert_array_equal(np.asarray(forward(policy, tokens(), CFG)), np.asarray(forward(base, tokens(), CFG)))


def test_adapter_layout_and_init_follow_peft():
  _, policy = adapted(rank=3)
  shapes = {w: (ab["lora_A"].shape, ab["lora_B"].shape) for w, ab in policy["lora"].weights.items()}
  D, H, K, hd, F, L = 16, 2, 1, 8, 24, 2
  assert shapes == {"wq": ((L, 3, D), (L, H * hd, 3)), "wk": ((L, 3, D), (L, K * hd, 3)),
                    "wv": ((L, 3, D), (L, K * hd, 3)), "wo": ((L, 3, H * hd), (L, D, 3)),
                    "w_gate": ((L, 3, D), (L, F, 3)), "w_up": ((L, 3, D), (L, F, 3)), "w_down": ((L, 3, F), (L, D, 3))}
  a = np.asarray(policy["lora"].weights["w_down"]["lora_A"])  # kaiming-uniform(a=√5): U(±1/√fan_in), fan_in = F
  assert np.abs(a).max() <= 1 / np.sqrt(F) and np.abs(a).max() > 0.8 / np.sqrt(F)
  assert policy["lora"].scale == 2.0


def test_merge_is_the_peft_update_and_equals_unmerged_application():
  base, policy = adapted(b_std=0.1)
  merged = lora.merge(base, policy["lora"])
  s = policy["lora"].scale
  for name in ("wq", "wo", "w_down"):
    ab = policy["lora"].weights[name]
    for l in range(CFG.n_layers):
      A, Bm = np.asarray(ab["lora_A"][l], np.float64), np.asarray(ab["lora_B"][l], np.float64)
      w_io = np.asarray(base["layers"][name][l], np.float64).reshape(A.shape[1], -1)
      w_hf = w_io.T + s * Bm @ A  # PEFT: W_hf [out, in] + scale · B A
      np.testing.assert_allclose(np.asarray(merged["layers"][name][l]).reshape(w_io.shape), w_hf.T, atol=1e-6)
      x = np.asarray(jax.random.normal(jax.random.key(9), (5, A.shape[1])), np.float64)  # unmerged: xW + s(xAᵀ)Bᵀ
      np.testing.assert_allclose(x @ np.asarray(merged["layers"][name][l]).reshape(w_io.shape),
                                 x @ w_io + s * (x @ A.T) @ Bm.T, atol=1e-5)
  for k in ("embed", "lm_head", "final_norm"):
    np.testing.assert_array_equal(np.asarray(merged[k]), np.asarray(base[k]))
  np.testing.assert_allclose(np.asarray(forward(policy, tokens(), CFG)), np.asarray(forward(merged, tokens(), CFG)),
                             atol=1e-6)
  # every forward path takes the policy with its adapters: scored with a shared prompt (GRPO groups), cached
  seq = jnp.concatenate([jnp.repeat(tokens(T=4)[:1], 4, 0), jax.random.randint(jax.random.key(8), (4, 3), 0, 16)], 1)
  pos, seg, mask = jnp.broadcast_to(jnp.arange(7), (4, 7)), jnp.ones((4, 7), jnp.int32), jnp.ones((4, 3))
  grouped = learner.make_score_fn(CFG, 1.0, group_size=2)
  np.testing.assert_allclose(grouped(policy, seq, pos, seg, mask), grouped(merged, seq, pos, seg, mask), atol=1e-5)
  cached = lambda p: forward_with_cache(p, seq, init_cache(CFG, 4, 8), CFG, positions_BT=pos)[0]
  np.testing.assert_allclose(cached(policy), cached(merged), atol=1e-5)


def test_gradient_is_the_lora_chain_rule_of_the_weight_gradient():
  """dL/dB = scale · G Aᵀ and dL/dA = scale · Bᵀ G, G the base model's gradient w.r.t. the merged HF weight."""
  base, policy = adapted(targets=("q_proj", "down_proj"), b_std=0.1)
  cot = jax.random.normal(jax.random.key(4), (2, 7, CFG.vocab_size))
  loss = lambda params: jnp.sum(forward(params, tokens(), CFG) * cot)
  g_ad = jax.grad(lambda ad: loss(lora.attach(base, ad)))(policy["lora"])
  g_w = jax.grad(loss)(lora.merge(base, policy["lora"]))["layers"]  # plain model: G w.r.t. W_eff
  s = policy["lora"].scale
  for name in ("wq", "w_down"):
    ab = policy["lora"].weights[name]
    for l in range(CFG.n_layers):
      A, Bm = np.asarray(ab["lora_A"][l], np.float64), np.asarray(ab["lora_B"][l], np.float64)
      G = np.asarray(g_w[name][l], np.float64).reshape(A.shape[1], -1).T  # [out, in]
      np.testing.assert_allclose(g_ad.weights[name]["lora_B"][l], s * G @ A.T, rtol=2e-4, atol=1e-6)
      np.testing.assert_allclose(g_ad.weights[name]["lora_A"][l], s * Bm.T @ G, rtol=2e-4, atol=1e-6)
  assert set(g_ad.weights) == {"wq", "w_down"}


def batch_for(params):
  seq = jax.random.randint(jax.random.key(0), (B, P + N), 3, 16)
  pos = jnp.broadcast_to(jnp.arange(P + N), (B, P + N))
  seg = jnp.ones((B, P + N), jnp.int32)
  mask = jnp.ones((B, N))
  logp = learner.make_score_fn(CFG, 1.0)(params, seq, pos, seg, mask)
  adv = jnp.broadcast_to(jnp.array([1.0, -1.0, 0.5, 2.0])[:, None], (B, N))
  return learner.Batch(sequence_BT=seq, positions_BT=pos, segment_ids_BT=seg, mask_BN=mask, adv_BN=adv,
                       behavior_logp_BN=logp, versions_BN=jnp.zeros((B, N), jnp.int32),
                       lag_B=jnp.zeros((B,), jnp.int32), prox_logp_BN=logp)


def copy(t):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), t)


def test_train_step_updates_the_adapters_only():
  base, policy = adapted()
  want_base = jax.tree.map(np.asarray, base)
  tx = learner.make_optimizer(1e-2, grad_clip=1.0)
  state = learner.init_state(copy(policy), tx)
  # the optimiser's moments cover the adapters only
  assert jax.tree.structure(state.opt_state[1][0].mu) == jax.tree.structure(policy["lora"])
  step = learner.make_train_step(CFG, tx, "ppo_clip", agg_mode="token-mean")
  new, m = step(state, batch_for(policy), jax.random.key(0))
  assert float(m["grad_norm"]) > 0 and not int(m["update_skipped"])
  new_base, new_ad = lora.split(new.params)
  for got, want in zip(jax.tree.leaves(new_base), jax.tree.leaves(want_base)):
    np.testing.assert_array_equal(np.asarray(got), want)  # the frozen base, bitwise
  moved = [float(jnp.abs(ab["lora_B"]).max()) for ab in new_ad.weights.values()]
  assert min(moved) > 0  # every B left zero (its gradient is scale · G Aᵀ, non-zero)


def test_publish_gives_the_sampler_the_adapters_just_trained():
  """After a train step and a publish, the sampler's behaviour log-probs are the learner's log-probs of the same
  tokens (no stale adapter); the previous version's would differ."""
  _, policy = adapted(b_std=0.05)
  tx = learner.make_optimizer(5e-2, grad_clip=0.0)
  store = ParamStore(keep_last=2, keep_learner_copy=True, weight_sync="sparse")
  dense = ParamStore(keep_last=1)  # full sync of the same adapters
  state = learner.init_state(copy(policy), tx)
  store.publish(state.params)
  dense.publish(state.params)
  step = learner.make_train_step(CFG, tx, "ppo_clip", agg_mode="token-mean")
  state, _ = step(state, batch_for(policy), jax.random.key(0))
  v = store.publish(state.params)
  dense.publish(state.params)
  for a, b in zip(jax.tree.leaves(store.acquire(v).params), jax.tree.leaves(dense.acquire().params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the sparse adapter delta rebuilds the same weights
  snap = store.acquire(v)
  assert not lora.has_adapters(snap.params)  # the sampler runs merged weights
  scfg = SamplerConfig(max_new_tokens=N, stop_ids=(), pad_id=0, temperature=1.0)
  prompts = jax.random.randint(jax.random.key(1), (B, P), 3, 16)
  out = generate(snap.params, prompts, jnp.full((B,), P), jax.random.key(2), CFG, scfg)
  score = learner.make_score_fn(CFG, 1.0)
  args = (out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], out["mask_BN"])
  np.testing.assert_allclose(out["behavior_logp_BN"], score(state.params, *args), atol=1e-5)
  np.testing.assert_allclose(out["behavior_logp_BN"], score(snap.learner_params, *args), atol=1e-5)
  old = store.acquire(v - 1)
  assert float(jnp.abs(out["behavior_logp_BN"] - score(old.params, *args)).max()) > 1e-3  # stale would differ
  # the payload is the adapters' change, measured against the full model
  full = sum(x.size * 4 for x in jax.tree.leaves(snap.params))
  ratio = store.sync_metrics()["sync_payload_ratio"]
  assert 0 < ratio <= lora.nbytes(state.params["lora"]) / full < 1
  assert 0 < dense.sync_metrics()["sync_payload_ratio"] == lora.nbytes(state.params["lora"]) / full


def lora_cfg(**over):
  c = load_file(os.path.join(ROOT, "configs", "lora_tiny.py"))
  c.log.tensorboard = False
  for k, v in over.items():
    *path, key = k.split("__")
    node = c  # "a__b__c" sets c.a.b.c
    for p in path:
      node = node[p]
    node[key] = v
  return c


@pytest.mark.parametrize("field,value,match", [
    ("rank", 17, r"^config\.model\.lora\.rank=17: is larger than q_proj's smaller dimension \(32 in x 32 out\)$"),
    ("targets", "q_proj,qkv", r"^config\.model\.lora\.targets='q_proj,qkv': unknown module 'qkv'"),
    ("alpha", 0.0, r"^config\.model\.lora\.alpha=0\.0: must be > 0"),
    ("alpha", -1.0, r"^config\.model\.lora\.alpha=-1\.0: must be > 0"),
    ("rank", -1, r"^config\.model\.lora\.rank=-1: must be an int >= 0"),
    ("dropout", 0.1, r"^config\.model\.lora\.dropout=0\.1: must be 0"),
    ("base_quantize", "nf4", r"^config\.model\.lora\.base_quantize='nf4': must be one of"),
])
def test_bad_lora_fields_are_one_line_errors_naming_the_field(field, value, match):
  c = lora_cfg(**{f"model__lora__{field}": value, "model__d_ff": 64})
  if field == "rank" and value == 17:
    c.model.lora.targets = "q_proj"  # D = 32 and H·hd = 32: rank 17 exceeds half of neither, 32 is the bound
    c.model.lora.rank = 33
    match = match.replace("17", "33")
  with pytest.raises(config_lib.ConfigError, match=match) as e:
    config_lib.validate(c)
  assert "\n" not in str(e.value)


def test_rank_is_checked_against_a_checkpoints_shapes(tmp_path):
  import tiny_hf
  ck = tiny_hf.make_checkpoint(tmp_path / "ck", d_model=32)  # d_ff 64, K·hd = 16
  c = lora_cfg(model__init_from=str(ck), model__lora__rank=20, model__lora__targets="k_proj",
               task__name="arithmetic_chat", task__held_out=8)
  config_lib.validate(c)  # the architecture comes from the checkpoint: known only at setup
  with pytest.raises(config_lib.ConfigError, match=r"^config\.model\.lora\.rank=20: is larger than k_proj's"):
    loop.setup(c)


def test_lora_validates_with_a_warm_start_and_with_ewma():
  config_lib.validate(lora_cfg(sft__steps=150))
  config_lib.validate(lora_cfg(loss__name="ppo_ewma", rollout__old_logp="ewma"))
  config_lib.validate(lora_cfg(model__lora__rank=0, sft__steps=150))  # LoRA off: the full fine-tuning config


def test_ewma_copy_of_a_lora_policy_averages_the_effective_weights():
  """β·E + (1-β)·(W + scale·(BA)ᵀ): the average of the policy's weights, not of A and B (bilinear in them)."""
  from jaxrl_llm.rollout.ewma import ewma_init, ewma_update
  base, p0 = adapted(b_std=0.3, seed=0)
  _, p1 = adapted(b_std=0.3, seed=5)
  p1 = lora.attach(base, p1["lora"])  # same base, other adapters
  e = ewma_init(p0)
  assert not lora.has_adapters(e)
  beta = 0.75
  out = ewma_update(e, p1, beta)
  w0 = np.asarray(base["layers"]["wq"]) + np.asarray(lora.delta(base["layers"]["wq"], p0["lora"].weights["wq"],
                                                                 p0["lora"].scale))
  w1 = np.asarray(base["layers"]["wq"]) + np.asarray(lora.delta(base["layers"]["wq"], p1["lora"].weights["wq"],
                                                                 p1["lora"].scale))
  np.testing.assert_allclose(np.asarray(out["layers"]["wq"]), beta * w0 + (1 - beta) * w1, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(out["embed"]), np.asarray(base["embed"]))


def test_lora_ppo_ewma_runs_anchored_to_the_average(tmp_path):
  """PPO-EWMA with adapters, on-policy so only the anchor moves the ratio (as tests/test_ewma.py without LoRA)."""
  c = lora_cfg(loss__name="ppo_ewma", rollout__old_logp="ewma", rollout__ewma_beta=0.9, num_steps=3,
               eval__every=0, checkpoint__every=0, rollout__mode="sync", sft__steps=150)  # warm: rewards vary
  rows = loop.run(c, str(tmp_path))
  dev = [max(abs(r["ratio_max"] - 1.0), 1.0 - r["ratio_ess"]) for r in rows]
  assert dev[0] < 1e-5 and min(dev[1:]) > 1e-4, dev
  assert all(r["grad_norm"] > 0 for r in rows)


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
  """The tiny model after its SFT warm start, exported: a base on which LoRA RL earns rewards from step 0."""
  d = tmp_path_factory.mktemp("base")
  c = load_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.num_steps, c.eval.every, c.log.tensorboard = 0, 0, False
  c.sft.save_to = str(d / "hf")
  loop.run(c, str(d / "run"))
  return str(d / "hf")


def resume_cfg(base, **over):
  return lora_cfg(**{"model__init_from": base, "rollout__mode": "fixed_lag", "rollout__lag": 2,
                     "checkpoint__every": 1, "num_steps": 6, "eval__every": 3, **over})


@pytest.mark.slow
def test_resume_equals_uninterrupted_in_fixed_lag(tmp_path, sft_base):
  """With a KL term to the reference (the frozen base, rebuilt on resume rather than checkpointed)."""
  resume_cfg_kl = lambda **over: resume_cfg(sft_base, loss__kl_coef=0.05, **over)
  ref = loop.run(resume_cfg_kl(), str(tmp_path / "ref"))
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]
  assert all(r["grad_norm"] > 0 for r in ref) and any(r["reward_mean"] > 0 for r in ref)
  assert all(r["mismatch_abs_max"] < 1e-5 for r in ref)  # the sampler always ran the published adapters
  assert all(0 < r["sync_payload_ratio"] < 0.5 for r in ref)
  assert ref[0]["kl_ref"] == 0 and ref[-1]["kl_ref"] > 0  # the reference is the initial policy (B = 0)
  d = str(tmp_path / "cut")
  loop.run(resume_cfg_kl(num_steps=3), d)
  loop.run(resume_cfg_kl(), d)
  assert json.load(open(os.path.join(d, "run_info.json")))["resumed_from_step"] == 3
  assert strip(read_jsonl(os.path.join(d, "metrics.jsonl"))) == strip(ref)
  # the checkpoint holds the adapters, their optimiser state and the base's checksum, not the base
  ck = os.path.join(d, "checkpoints", "6")
  keys = json.load(open(os.path.join(ck, "state", "_METADATA")))["tree_metadata"]
  arrays = [k for k in keys if k.startswith(("('train', 'params'", "('snap',"))]
  assert arrays and all(k.endswith(("'lora_A')", "'lora_B')")) for k in arrays), arrays
  assert not any(name in k for k in keys for name in ("embed", "attn_norm", "lm_head", "final_norm"))
  assert any("'mu'" in k and "lora_B" in k for k in keys)
  assert json.load(open(os.path.join(ck, "meta", "metadata")))["lora_base"]["init_from_sha256"]


@pytest.mark.slow
def test_lora_after_an_sft_warm_start_trains_and_resumes_exactly(tmp_path):
  """LoRA adapters over the run's own SFT warm start (no export / init_from): the warm-started base earns rewards
  from step 0, is hashed into the checkpoint, and is warm-started again on resume (the same base: exact resume)."""
  cfg = lambda **o: lora_cfg(**{"sft__steps": 150, "rollout__mode": "fixed_lag", "rollout__lag": 1,
                                "checkpoint__every": 1, "num_steps": 3, "eval__every": 0, **o})
  ref = loop.run(cfg(), str(tmp_path / "ref"))
  assert ref[0]["reward_mean"] > 0 and all(r["grad_norm"] > 0 for r in ref)
  d = str(tmp_path / "cut")
  loop.run(cfg(num_steps=1), d)
  loop.run(cfg(), d)
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]
  assert strip(read_jsonl(os.path.join(d, "metrics.jsonl"))) == strip(ref)
  base_id = json.load(open(os.path.join(d, "checkpoints", "3", "meta", "metadata")))["lora_base"]
  assert set(base_id) == {"seed", "sft_sha256"}


def test_resume_refuses_a_different_base(tmp_path, sft_base):
  import shutil
  other = str(tmp_path / "other")
  shutil.copytree(sft_base, other)
  d = str(tmp_path / "run")
  loop.run(resume_cfg(other, num_steps=1, eval__every=0), d)
  from jaxrl_llm.models import load_hf, save_hf
  cfg, params = load_hf(other, param_dtype="float32")
  save_hf(other, cfg, jax.tree.map(lambda x: x * 1.01, params))  # same path and config, other weights
  with pytest.raises(loop.RunError, match="LoRA adapters were trained on the base"):
    loop.run(resume_cfg(other, num_steps=2, eval__every=0), d)


def test_qlora_int8_base_runs_two_steps(tmp_path, sft_base):
  c = lora_cfg(model__init_from=sft_base, model__lora__base_quantize="int8", num_steps=2, eval__every=0)
  rows = loop.run(c, str(tmp_path / "q"))
  assert len(rows) == 2 and all(r["grad_norm"] > 0 and not r["update_skipped"] for r in rows)
  assert all(r["mismatch_abs_max"] < 1e-5 for r in rows)  # the sampler's base is the same int8 base


def test_qlora_base_is_the_int8_round_trip_of_the_initial_weights():
  from jaxrl_llm import wiring
  c = lora_cfg(model__lora__base_quantize="int8")
  base = init_params(CFG, jax.random.key(0))
  policy = wiring.lora_policy(c, CFG, base, jax.random.key(1))
  w, q = np.asarray(base["layers"]["wq"][0]).reshape(16, -1), np.asarray(policy["layers"]["wq"][0]).reshape(16, -1)
  step = np.abs(w).max(axis=0, keepdims=True) / 127  # per output channel, over the inputs
  np.testing.assert_allclose(q / step, np.round(w / step), atol=1e-3)  # on the int8 grid, the nearest point
  assert not np.array_equal(q, w)
  np.testing.assert_array_equal(np.asarray(policy["embed"]), np.asarray(base["embed"]))  # embeddings stay
  assert lora.has_adapters(policy) and not lora.has_adapters(wiring.lora_policy(lora_cfg(model__lora__rank=0), CFG,
                                                                                 base, jax.random.key(1)))


@pytest.mark.slow
def test_peft_export_round_trips_through_peft_and_transformers(tmp_path, sft_base):
  """A LoRA run's adapter exported as a PEFT folder, loaded by `peft` over the base with `transformers`, gives our
  policy's logits; the merged export gives them too."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  import transformers
  from experiments import export_policy
  from jaxrl_llm import run_state, wiring
  from jaxrl_llm.rollout import sources
  c = lora_cfg(model__init_from=sft_base, num_steps=2, eval__every=0)
  loop.run(c, str(tmp_path / "run"))
  assert export_policy.export(c, str(tmp_path / "run"), str(tmp_path / "peft"), "peft") == 2
  export_policy.export(c, str(tmp_path / "run"), str(tmp_path / "merged"))
  files = sorted(os.listdir(tmp_path / "peft"))
  assert "adapter_config.json" in files and "adapter_model.safetensors" in files
  from safetensors.numpy import load_file
  names = set(load_file(str(tmp_path / "peft" / "adapter_model.safetensors")))
  assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
  assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in names

  r = wiring.setup(c)  # our policy, restored from the same checkpoint
  ckpt = run_state.open_checkpointer(c, str(tmp_path / "run"))
  try:
    state = run_state.restore(ckpt, r, loop.new_store(r), sources.retention(r.ctx.settings),
                              json.loads(c.to_json_best_effort()))[1]
  finally:
    ckpt.close()
  assert float(max(jnp.abs(ab["lora_B"]).max() for ab in state.params["lora"].weights.values())) > 0
  ids = np.array(jax.random.randint(jax.random.key(0), (2, 9), 1, r.model_cfg.vocab_size))  # writable, for torch
  ours = np.asarray(forward(state.params, jnp.asarray(ids), r.model_cfg))
  base_pt = transformers.AutoModelForCausalLM.from_pretrained(sft_base, torch_dtype=torch.float32)
  with torch.no_grad():
    plain = base_pt(torch.as_tensor(ids)).logits.numpy()
    model = peft.PeftModel.from_pretrained(base_pt, str(tmp_path / "peft"))
    theirs = model(torch.as_tensor(ids)).logits.numpy()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), torch_dtype=torch.float32)
    theirs_merged = merged(torch.as_tensor(ids)).logits.numpy()
  assert np.abs(plain - ours).max() > 1e-4  # the adapter changes the logits
  np.testing.assert_allclose(theirs, ours, atol=2e-4)
  np.testing.assert_allclose(theirs_merged, ours, atol=2e-4)


def test_moe_experts_take_one_adapter_pair_each():
  """MoE: each expert's gate/up/down weight gets its own PEFT pair (lora_A [L, E, r, in], lora_B [L, E, out, r]);
  the merged expert e of layer l is W_e + scale · (B_e A_e)ᵀ, computed here per expert, and the scan-merged forward
  equals the merged model's; PEFT export names the missing MoE export."""
  moe = dataclasses.replace(CFG, num_experts=3, experts_per_token=2)
  base = init_params(moe, jax.random.key(0))
  ad = lora.init_adapters(moe, lora.LoraConfig(3, 6.0, ALL), jax.random.key(1))
  assert ad.weights["w_up"]["lora_A"].shape == (2, 3, 3, 16) and ad.weights["w_up"]["lora_B"].shape == (2, 3, 24, 3)
  assert ad.weights["wq"]["lora_A"].shape == (2, 3, 16)  # attention stays dense
  ad = ad.replace(weights=jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape),
                                       ad.weights))
  policy, merged = lora.attach(base, ad), lora.merge(base, ad)
  for name in ("w_gate", "w_down"):
    ab = ad.weights[name]
    for l, e in itertools.product(range(2), range(3)):
      A, Bm = np.asarray(ab["lora_A"][l, e], np.float64), np.asarray(ab["lora_B"][l, e], np.float64)
      w = np.asarray(base["layers"][name][l, e], np.float64)
      np.testing.assert_allclose(np.asarray(merged["layers"][name][l, e]), w + ad.scale * (Bm @ A).T, atol=1e-5)
  np.testing.assert_allclose(np.asarray(forward(policy, tokens(), moe)), np.asarray(forward(merged, tokens(), moe)),
                             atol=1e-5)
  with pytest.raises(ValueError, match="MoE experts"):
    hf.save_peft("/nonexistent", ad)


def test_lora_on_an_moe_model_adapts_the_experts(tmp_path):
  """MoE with LoRA on every projection (the experts included) and QLoRA's int8 base: the run trains the adapters
  with routing replay and the sampler computes with them (μ equals the learner's); adapters are what is published."""
  c = load_file(os.path.join(ROOT, "configs", "moe_tiny.py"))
  c.log.tensorboard, c.checkpoint.every, c.eval.every, c.num_steps, c.sft.steps = False, 0, 0, 2, 0
  c.model.lora.rank, c.model.lora.alpha, c.model.lora.base_quantize = 4, 8.0, "int8"
  c.loss.entropy_coef, c.optim.lr, c.optim.warmup_steps = 0.01, 1e-2, 0
  rows = loop.run(c, str(tmp_path))
  assert all(r["grad_norm"] > 0 and r["mismatch_abs_max"] < 1e-5 for r in rows)
  assert 0 < rows[0]["sync_payload_ratio"] < 0.2
