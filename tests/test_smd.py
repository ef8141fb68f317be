"""SMD (`losses.smd`): Track 1 PPO-clip on the shadow forward anchored at μ, Track 2 λ·KL(π_dense ‖ sg π_shadow).

Golden values are independent formulas in float64 numpy: the KL from the full [B, N, V] logits, its gradient
q ⊙ (log q − log p − KL) pushed back through h @ w, the on-policy PG identity ∂ℓ/∂log π_shadow = −Â. The
learner's shadow forward (`completion_logprobs(kv_window_B2=...)`) reproduces the window sampler's μ; config
errors name the field.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import learner, losses
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.types import LossInputs
from jaxrl_llm.vocab_chunks import VocabHead
from tests.test_kv_cache import CFG, P, PARAMS, PROMPT_LEN, PROMPTS

B, N, D, V = 2, 5, 6, 11
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
SPEC = losses.get("smd")


def _draw(seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return {"hd": f(B, N, D), "hs": f(B, N, D), "w": f(D, V), "mu": f(B, N) * 0.3 - 1.0, "dense": f(B, N) * 0.3 - 1.0,
          "adv": f(B, N)}


def _inputs(x, shadow_logp, hd=None, hs=None, w=None):
  hd, hs, w = (x["hd"] if hd is None else hd), (x["hs"] if hs is None else hs), (x["w"] if w is None else w)
  return LossInputs(logp_BN=x["dense"], mask_BN=jnp.asarray(MASK), adv_BN=x["adv"], behavior_logp_BN=x["mu"],
                    shadow_logp_BN=shadow_logp, student_head=VocabHead(hidden_BND=hd, w_DV=w),
                    shadow_head=VocabHead(hidden_BND=hs, w_DV=w))


def _log_softmax64(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _kl64(x):
  lq = _log_softmax64(np.asarray(x["hd"], np.float64) @ np.asarray(x["w"], np.float64))
  lp = _log_softmax64(np.asarray(x["hs"], np.float64) @ np.asarray(x["w"], np.float64))
  return lq, lp, (np.exp(lq) * (lq - lp)).sum(-1)


def test_value_is_pg_plus_lambda_kl():
  x = _draw()
  shadow = x["mu"] + 0.05  # ratio e^0.05 inside the clip
  hp = SPEC.Hparams(kl_coef=0.3)
  loss, aux = SPEC.fn(_inputs(x, shadow), hp)
  _, _, kl = _kl64(x)
  want = (-np.asarray(x["adv"], np.float64) * np.exp(0.05) + 0.3 * kl) * MASK
  np.testing.assert_allclose(np.asarray(loss), want, rtol=2e-5, atol=2e-6)
  s, c = aux["smd_kl"]
  np.testing.assert_allclose(float(s / c), (kl * MASK).sum() / MASK.sum(), rtol=1e-5)


def test_on_policy_gradients():
  """shadow = μ: ∂/∂log π_shadow = −Â (PG), nothing reaches the dense log-probs or the shadow's head, and the
  dense hidden states get λ·(q ⊙ (log q − log p − KL)) @ wᵀ (float64 formula)."""
  x = _draw(1)
  lam = 0.2
  hp = SPEC.Hparams(kl_coef=lam)

  def total(shadow_logp, dense_logp, hd, hs):
    inputs = _inputs(x, shadow_logp, hd, hs).replace(logp_BN=dense_logp)
    return SPEC.fn(inputs, hp)[0].sum()

  g_sh, g_dense, g_hd, g_hs = jax.grad(total, argnums=(0, 1, 2, 3))(x["mu"], x["dense"], x["hd"], x["hs"])
  np.testing.assert_allclose(np.asarray(g_sh), -np.asarray(x["adv"]) * MASK, atol=1e-6)
  assert np.all(np.asarray(g_dense) == 0) and np.all(np.asarray(g_hs) == 0)
  lq, lp, kl = _kl64(x)
  dz = np.exp(lq) * (lq - lp - kl[..., None]) * MASK[..., None]
  want = lam * dz @ np.asarray(x["w"], np.float64).T
  np.testing.assert_allclose(np.asarray(g_hd), want, rtol=1e-4, atol=1e-6)


def test_kl_gradient_matches_finite_differences():
  x = _draw(2)
  hp = SPEC.Hparams(kl_coef=1.0)
  adv0 = x["adv"] * 0  # isolate Track 2
  f = lambda hd: SPEC.fn(_inputs({**x, "adv": adv0}, x["mu"], hd=hd), hp)[0].sum()
  g = np.asarray(jax.grad(f)(x["hd"]))
  rng = np.random.default_rng(3)
  for _ in range(3):
    d = jnp.asarray(rng.standard_normal(x["hd"].shape), jnp.float32)
    eps = 1e-2
    fd = (float(f(x["hd"] + eps * d)) - float(f(x["hd"] - eps * d))) / (2 * eps)
    np.testing.assert_allclose(fd, float((g * np.asarray(d)).sum()), rtol=2e-2, atol=1e-4)


def test_clip_stops_track1_gradient():
  x = _draw(4)
  adv = jnp.abs(x["adv"]) + 0.1  # positive: the clip binds above 1 + ε
  f = lambda s: SPEC.fn(_inputs({**x, "adv": adv}, s), SPEC.Hparams(kl_coef=0.0))[0].sum()
  g = np.asarray(jax.grad(f)(x["mu"] + 0.5))  # ratio e^0.5 > 1.2
  assert np.all(g == 0)


def test_learner_shadow_forward_reproduces_window_mu():
  sc = SamplerConfig(max_new_tokens=7, kv_cache="window", kv_sinks=2, kv_window=3)
  out = generate(PARAMS, PROMPTS, PROMPT_LEN, jax.random.key(7), CFG, sc)
  args = (PARAMS, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], 7, CFG, 1.0)
  shadow = learner.completion_logprobs(*args, kv_window_B2=out["kv_window_B2"])["logp_BT"]
  dense = learner.completion_logprobs(*args)["logp_BT"]
  m = np.asarray(out["mask_BN"])
  np.testing.assert_allclose(np.asarray(shadow) * m, np.asarray(out["behavior_logp_BN"]) * m, atol=2e-4)
  assert np.max(np.abs(np.asarray(dense) - np.asarray(out["behavior_logp_BN"])) * m) > 1e-2
  assert out["sequence_BT"].shape[1] == P + 7


def _tiny():
  return config_lib.load_file("configs/kv_window_smd_tiny.py")


@pytest.mark.parametrize("over, field", [
    ({"sampler.kv_cache": "int8"}, "sampler.kv_cache"),
    ({"sampler.kv_cache": "full"}, "sampler.kv_cache"),
    ({"sampler.kv_cache": "zip"}, "sampler.kv_cache"),
    ({"sampler.kv_window": 0}, "sampler.kv_window"),
    ({"sampler.kv_sinks": -2}, "sampler.kv_sinks"),
])
def test_config_errors_name_the_field(over, field):
  c = _tiny()
  for k, v in over.items():
    sec, name = k.split(".")
    c[sec][name] = v
  with pytest.raises(config_lib.ConfigError, match=field):
    config_lib.validate(c)


def test_config_and_sampler_agree_on_kv_caches():
  from jaxrl_llm.sampling import config as sampler_config
  assert config_lib.KV_CACHES == sampler_config.KV_CACHES


def test_config_window_with_other_losses_is_valid():
  c = _tiny()
  config_lib.validate(c)
  c.loss.name = "tis"
  config_lib.validate(c)
  c.sampler.kv_cache = "int8"
  config_lib.validate(c)


def test_smd_on_episodes_trains_the_shadow_of_every_turn(tmp_path):
  """configs/agent_tiny.py's episodes with a sinks + window cache and loss smd, one learner step: the episode record
  carries each row's window, and the learner's shadow forward under it reproduces μ of every policy token of every
  turn (ratio 1 up to fp32), while the dense forward does not. With eviction the pair is refused, naming the loss."""
  from jaxrl_llm import loop
  from jaxrl_llm.metrics import read_jsonl
  c = config_lib.load_file("configs/agent_tiny.py")
  c.num_steps, c.log.progress, c.log.tensorboard, c.checkpoint.every, c.eval.every = 1, False, False, 0, 0
  c.sampler.kv_cache, c.sampler.kv_sinks, c.sampler.kv_window, c.loss.name = "window", 1, 4, "smd"
  loop.run(c, str(tmp_path))
  (m,) = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert m["kv_window"] == 5.0 and m["env_turns"] > m["env_episodes"]  # later turns decoded from the window
  assert abs(m["shadow_ratio_max"] - 1) < 1e-5 and abs(m["shadow_ratio_mean"] - 1) < 1e-6, m
  assert m["mismatch_abs_max"] > 1e-2  # the dense forward is another policy
  c.env.evict, c.env.context_budget = "drop_oldest", 8
  with pytest.raises(config_lib.ConfigError, match="loss.name='smd'"):
    config_lib.validate(c)
