"""End-to-end runs of the tiny config: repeatability, lags per mode, mismatch from a bf16 sampler."""

import json
import os

import numpy as np
import pytest

from jaxrl_llm import loop, policy_init
from jaxrl_llm.config import load_file
from jaxrl_llm.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**over):
  c = load_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.log.tensorboard = False
  for k, v in over.items():
    sec, key = k.split("__")
    c[sec][key] = v
  return c


def fresh_run(c):
  """(run, train state, extra copies, ParamStore with version 0 published) of config `c`, without SFT:
  what a test needs to call the loop's pieces (`sync_rollout`, `make_batch`, ...) directly."""
  r = loop.setup(c)
  state, extra = loop.fresh_state(r, policy_init.initial_policy(c, r.model_cfg, r.k_init)[1])
  store = loop.new_store(r)
  store.publish(state.params)
  return r, state, extra, store


def strip(rows):
  return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def assert_learns(rows):
  """Equality tests compare runs that learn: every compared step updates (non-zero gradient) and rewards are earned."""
  assert all(r["grad_norm"] > 0 and not r["update_skipped"] for r in rows), [r["grad_norm"] for r in rows]
  assert any(r["reward_mean"] > 0 for r in rows), [r["reward_mean"] for r in rows]


@pytest.mark.slow
def test_fixed_lag_is_bitwise_repeatable_and_lags_are_exact(tmp_path):
  c = tiny(rollout__mode="fixed_lag", rollout__lag=2, optim__lr=1e-2, optim__warmup_steps=0)
  c.loss.entropy_coef = 0.01  # a gradient even when every reward of the untrained policy is 0
  c.num_steps = 5
  a = loop.run(c, str(tmp_path / "a"))
  b = loop.run(c, str(tmp_path / "b"))
  assert_learns(a)
  assert strip(a) == strip(b)
  assert strip(read_jsonl(str(tmp_path / "a" / "metrics.jsonl"))) == strip(a)
  assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["5"]  # checkpoint.final (every=50 never falls)
  assert [r["behavior_version"] for r in a] == [0, 0, 0, 1, 2]
  assert all(r["entropy"] > 0 for r in a)  # logged every step
  assert [r["lag_max"] for r in a] == [0, 1, 2, 2, 2]
  # Stale rollouts: recomputed π_old differs from π_θ, so ratios leave 1 once lag > 0.
  assert a[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)
  assert max(r["ratio_max"] for r in a[2:]) > 1.0 + 1e-4


@pytest.mark.slow
def test_staged_mode_and_bf16_sampler_mismatch(tmp_path):
  c = tiny(rollout__mode="staged", rollout__lag=3, sampler__dtype="bfloat16", loss__name="pg")
  c.num_steps = 4
  c.eval.every = 0
  c.checkpoint.final = False  # metrics only
  rows = loop.run(c, str(tmp_path / "s"))
  assert not os.path.exists(tmp_path / "s" / "checkpoints") or os.listdir(tmp_path / "s" / "checkpoints") == []
  assert [r["behavior_version"] for r in rows] == [0, 0, 0, 3]
  assert [r["lag_max"] for r in rows] == [0, 1, 2, 0]
  # bf16 sampler vs fp32 learner: a real, measured mismatch at lag 0.
  assert rows[0]["mismatch_abs_mean"] > 1e-4
  assert np.isfinite(rows[0]["mismatch_abs_max"])


@pytest.mark.slow
def test_sft_export_then_init_from_reproduces_the_policy(tmp_path):
  c = tiny()
  c.num_steps = 1
  c.sft.save_to = str(tmp_path / "sft")
  a = loop.run(c, str(tmp_path / "a"))
  c2 = tiny()
  c2.num_steps = 1
  c2.sft.steps = 0
  c2.model.init_from = str(tmp_path / "sft")
  b = loop.run(c2, str(tmp_path / "b"))
  assert_learns(a)
  assert strip(a) == strip(b)


def test_init_from_with_wrong_vocab_names_the_field(tmp_path):
  import jax
  from jaxrl_llm.models import ModelConfig, init_params, save_hf
  cfg = ModelConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
  save_hf(str(tmp_path / "m"), cfg, init_params(cfg, jax.random.key(0)))
  c = tiny()
  c.model.init_from = str(tmp_path / "m")
  with pytest.raises(ValueError, match="config.model.init_from=.*vocab_size=100"):
    loop.run(c, str(tmp_path / "run"))


def test_dapo_filter_entropy_and_throughput_fields(tmp_path):
  c = tiny()
  c.task.kwargs.partial_credit = False  # exact-match rewards: the barely trained policy scores 0 everywhere
  c.sft.steps = 10
  c.rollout.dynamic_sampling = True
  c.num_steps, c.eval.every = 2, 0
  rows = loop.run(c, str(tmp_path))
  for r in rows:
    # The untrained tiny policy scores 0 everywhere: every group has zero reward variance.
    assert r["dapo_filtered_frac"] == 1.0 and r["loss"] == 0.0 and r["grad_norm"] == 0.0
    assert r["entropy"] == 0.0  # logged over counted tokens, and none is left
    assert r["time_learner_tokens_per_s"] > 0 and r["time_sampler_tokens_per_s"] > 0


def test_kl_to_reference_is_scored_inside_the_step(tmp_path):
  """`loss.kl_coef > 0`: the train step scores the frozen reference itself (`learner.fuse_reference`).
  KL is 0 while the policy still equals the reference, grows once it moves, and the step compiles once."""
  c = tiny(loss__kl_coef=0.1, loss__entropy_coef=0.05, optim__lr=0.02, optim__warmup_steps=0)
  c.num_steps, c.eval.every, c.sft.steps = 3, 0, 0
  rows = loop.run(c, str(tmp_path))
  assert rows[0]["kl_ref"] < 1e-7  # step 0: the reference is the initial policy
  assert rows[1]["kl_ref"] > 1e-6 and rows[2]["kl_ref"] > rows[1]["kl_ref"]
  info = json.load(open(os.path.join(str(tmp_path), "run_info.json")))
  assert info["compiles_train_step"] == 1


def test_async_with_worker_scored_prox(tmp_path):
  """`rollout.prox_in_worker`: workers attach π_old to their groups; the learner trains on it (mismatch to μ
  stays at fp32 noise with an fp32 sampler), and the option is refused outside async + recompute;
  `rollout.score_at_switch` (the interruption route, `tests/test_async_engine.py`) reaches the sources' settings
  and needs partial rollouts."""
  c = tiny(rollout__mode="async", rollout__lag=1, rollout__prox_in_worker=True)
  c.num_steps, c.eval.every, c.sft.steps = 4, 0, 0
  rows = loop.run(c, str(tmp_path))
  assert len(rows) == 4 and all(r["lag_max"] <= 1 for r in rows)
  assert all(r["mismatch_abs_max"] < 1e-4 for r in rows)
  from jaxrl_llm import config as config_lib
  with pytest.raises(config_lib.ConfigError, match=r"config\.rollout\.prox_in_worker="):
    config_lib.validate(tiny(rollout__mode="sync", rollout__prox_in_worker=True))
  with pytest.raises(config_lib.ConfigError, match=r"config\.rollout\.score_at_switch=True: .*partial_chunk"):
    config_lib.validate(tiny(rollout__mode="async", rollout__prox_in_worker=True, rollout__score_at_switch=True))
  from jaxrl_llm import wiring
  c = tiny(rollout__mode="async", rollout__prox_in_worker=True, rollout__partial_chunk=2, rollout__score_at_switch=True)
  config_lib.validate(c)
  assert wiring.rollout_settings(c).score_at_switch
