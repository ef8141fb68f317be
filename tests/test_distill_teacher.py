"""Frozen teacher: scoring equals a direct forward, teacher sources and caching, distill config errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import config as config_lib, learner
from jaxrl_llm.config import load_file
from jaxrl_llm.distill import opd, teacher as teacher_lib
from jaxrl_llm.models import ModelConfig, forward, init_params, save_hf
from jaxrl_llm.tasks import tokenizer as tok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, max_seq_len=16)


def opd_tiny():
  c = load_file(os.path.join(ROOT, "configs", "opd_tiny.py"))
  c.log.tensorboard = False
  return c


def _batch(B=3, P=4, N=5, seed=0):
  """Left-padded prompts + completions in the sampler layout, with ragged completion masks."""
  rng = np.random.default_rng(seed)
  seq = rng.integers(1, CFG.vocab_size, (B, P + N))
  plen = np.array([4, 2, 3])[:B]
  nlen = np.array([5, 3, 1])[:B]
  real_P = np.arange(P)[None] >= (P - plen)[:, None]
  mask_BN = (np.arange(N)[None] < nlen[:, None]).astype(np.float32)
  seg = np.concatenate([real_P, mask_BN > 0], 1).astype(np.int32)
  pos = np.concatenate([np.where(real_P, np.arange(P)[None] - (P - plen)[:, None], 0),
                        plen[:, None] + np.arange(N)[None]], 1)
  seq = np.where(seg > 0, seq, 0)
  return jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(seg), jnp.asarray(mask_BN)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_equal_a_direct_forward(temperature):
  params = init_params(CFG, jax.random.key(0))
  seq, pos, seg, mask = _batch()
  K, N = 4, mask.shape[1]
  out = teacher_lib.make_teacher_scorer(CFG, temperature, K, head=True)(params, seq, pos, seg, mask)
  # Reference: full forward, position P-1+j predicts completion token j (numpy from here on).
  logits = np.asarray(forward(params, seq, CFG, positions_BT=pos, segment_ids_BT=seg), np.float64)
  P = seq.shape[1] - N
  z = logits[:, P - 1:-1] / temperature
  lp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
  y = np.asarray(seq)[:, P:]
  m = np.asarray(mask) > 0
  want_logp = np.take_along_axis(lp, y[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out["teacher_logp_BN"])[m], want_logp[m], atol=2e-5)
  assert np.all(np.asarray(out["teacher_logp_BN"])[~m] == 0)
  # Same alignment as the learner's own scorer (what the student's log-probs are compared with).
  same = learner.make_score_fn(CFG, temperature)(params, seq, pos, seg, mask)
  np.testing.assert_allclose(np.asarray(out["teacher_logp_BN"]), np.asarray(same), atol=1e-5)
  head = out["teacher_head"]  # hidden states + lm-head: softmax(h @ w / T) is the same distribution
  zh = np.asarray(head.hidden_BND, np.float64) @ np.asarray(head.w_DV, np.float64) / head.temperature
  lph = zh - np.log(np.exp(zh - zh.max(-1, keepdims=True)).sum(-1, keepdims=True)) - zh.max(-1, keepdims=True)
  np.testing.assert_allclose(lph[m], lp[m], atol=2e-5)
  assert head.temperature == temperature and np.all(np.asarray(head.hidden_BND)[~m] == 0)
  ids = np.asarray(out["teacher_topk_ids_BNk"])
  want_ids = np.argsort(-lp, -1)[..., :K]
  assert np.array_equal(ids[m], want_ids[m])
  np.testing.assert_allclose(np.asarray(out["teacher_topk_logp_BNk"])[m],
                             np.take_along_axis(lp, want_ids, -1)[m], atol=2e-5)
  # The k classes plus the residual class hold all the probability mass.
  total = np.exp(np.asarray(out["teacher_topk_logp_BNk"], np.float64)).sum(-1) + np.exp(
      np.asarray(out["teacher_topk_residual_logp_BN"], np.float64))
  np.testing.assert_allclose(total[m], 1.0, atol=1e-5)
  assert head.hidden_BND.shape == (3, N, CFG.d_model) and ids.shape == (3, N, K)


def test_topk_equal_to_vocab_has_no_residual_and_bad_k_is_rejected():
  params = init_params(CFG, jax.random.key(1))
  seq, pos, seg, mask = _batch()
  out = teacher_lib.make_teacher_scorer(CFG, 1.0, CFG.vocab_size)(params, seq, pos, seg, mask)
  m = np.asarray(mask) > 0
  assert np.all(np.isneginf(np.asarray(out["teacher_topk_residual_logp_BN"])[m]))
  np.testing.assert_allclose(np.exp(np.asarray(out["teacher_topk_logp_BNk"])).sum(-1)[m], 1.0, atol=1e-5)
  with pytest.raises(ValueError, match="distill.topk"):
    teacher_lib.make_teacher_scorer(CFG, 1.0, CFG.vocab_size + 1)


def test_teacher_config_scales_width_and_keeps_head_dim():
  c = opd_tiny()
  c.sft.steps = run_sft_steps = 7  # differs from distill.teacher_sft_steps: a mutation would show
  before = c.to_json_best_effort()
  cfg = teacher_lib.teacher_model_config(c, 16, tok.vocab_size)
  assert (cfg.d_model, cfg.n_layers) == (64, 2) and cfg.layer_unroll in (1, 2)
  assert cfg.d_ff == c.model.d_ff * 2 and cfg.head_dim == c.model.head_dim
  assert (cfg.n_heads, cfg.n_kv_heads) == (2 * c.model.n_heads, 2 * c.model.n_kv_heads)
  assert cfg.max_seq_len == 16 + c.sampler.max_new_tokens and cfg.vocab_size == tok.vocab_size
  schedule = teacher_lib.teacher_schedule(c)
  assert schedule.steps == c.distill.teacher_sft_steps and (schedule.batch_size, schedule.lr) == (c.sft.batch_size, c.sft.lr)
  assert c.sft.steps == run_sft_steps and c.to_json_best_effort() == before  # the run config is untouched


def test_sft_teacher_is_trained_once_and_reused(tmp_path, monkeypatch):
  c = opd_tiny()
  c.distill.teacher_sft_steps = 3
  c.distill.teacher_cache_dir = str(tmp_path)
  from jaxrl_llm import loop
  from jaxrl_llm.tasks import get_task
  from jaxrl_llm.rollout import collect
  task = get_task(c.task.name, **dict(c.task.kwargs))
  P = loop.prompt_width(c, task)
  train = collect.load_split(c.task.name, "train", dict(c.task.kwargs), c.task.source, c.task.data_dir, c.seed)
  cfg, params = teacher_lib.load_teacher(c, P, train, tok.vocab_size)
  assert cfg.d_model == 64 and cfg.n_layers == 2
  assert os.listdir(tmp_path) == [teacher_lib.cache_key(c, P, tok.vocab_size)]
  # The second load must come from the cache: training again would fail here.
  monkeypatch.setattr(teacher_lib, "train_sft_teacher", lambda *a, **k: pytest.fail("teacher retrained"))
  _, params2 = teacher_lib.load_teacher(c, P, train, tok.vocab_size)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, params2))
  # A different size is a different cache entry.
  c.distill.teacher_n_layers = 3
  assert teacher_lib.cache_key(c, P, tok.vocab_size) != os.listdir(tmp_path)[0]


def test_hf_folder_teacher_and_its_errors(tmp_path):
  c = opd_tiny()
  good = ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32)
  params = init_params(good, jax.random.key(3))
  save_hf(str(tmp_path / "t"), good, params)
  c.distill.teacher = str(tmp_path / "t")
  cfg, loaded = teacher_lib.load_teacher(c, 6, [], tok.vocab_size)
  assert cfg.d_model == 16 and cfg.max_seq_len >= 6 + c.sampler.max_new_tokens
  np.testing.assert_array_equal(np.asarray(loaded["embed"]), np.asarray(params["embed"]))
  bad = ModelConfig(vocab_size=tok.vocab_size + 3, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32)
  save_hf(str(tmp_path / "b"), bad, init_params(bad, jax.random.key(3)))
  c.distill.teacher = str(tmp_path / "b")
  with pytest.raises(config_lib.ConfigError, match=r"config\.distill\.teacher=.*vocab_size"):
    teacher_lib.load_teacher(c, 6, [], tok.vocab_size)
  c.distill.teacher = str(tmp_path / "missing")
  with pytest.raises(config_lib.ConfigError, match=r"config\.distill\.teacher="):
    teacher_lib.load_teacher(c, 6, [], tok.vocab_size)


@pytest.mark.parametrize("field", ["teacher_d_model", "teacher_n_layers", "teacher_sft_steps", "topk", "temperature",
                                   "teacher_cache_dir"])
def test_missing_distill_field_is_named(field):
  c = opd_tiny()
  d = c.distill.to_dict()
  del d[field]
  import ml_collections
  c.distill = ml_collections.ConfigDict(d)
  with pytest.raises(config_lib.ConfigError, match=rf"config\.distill\.{field}: missing"):
    opd.validate(c)


def test_invalid_distill_values_are_named():
  c = opd_tiny()
  c.distill.topk = 0
  with pytest.raises(config_lib.ConfigError, match=r"config\.distill\.topk=0"):
    opd.validate(c)
  c = opd_tiny()
  c.distill.teacher_n_layers = -1
  with pytest.raises(config_lib.ConfigError, match=r"config\.distill\.teacher_n_layers=-1"):
    opd.validate(c)
  c = opd_tiny()
  c.distill.teacher = str(ROOT)  # a path teacher needs no size fields, so deleting them is fine
  del c.distill["teacher_d_model"]
  opd.validate(c)


def test_provided_needs_decide_which_losses_start():
  c = opd_tiny()
  for name in ("opd_reverse_kl", "opd_forward_kl", "opd_topk_kl", "opd_reverse_kl_full", "gkd_jsd", "f_opd"):
    c.loss.name = name
    config_lib.validate(c)
  for name, need in (("opd_reverse_kl_mc", "mc"), ("s2d_opd", "teacher_ref_topk"), ("sdcc", "eviction")):
    c.loss.name = name
    with pytest.raises(config_lib.ConfigError, match=rf"config\.loss\.name='{name}'.*{need}"):
      config_lib.validate(c)
  c.loss.name = "opd_forward_kl"
  c.distill.teacher = ""  # no teacher: nothing provides the teacher's logits
  with pytest.raises(config_lib.ConfigError, match="teacher_logits"):
    config_lib.validate(c)


def test_extra_fields_follow_the_loss_needs():
  assert opd.extra_fields("opd_reverse_kl") == ("teacher_logp_BN",)
  assert opd.extra_fields("opd_forward_kl") == ("teacher_head",)  # chunked: hidden states + lm-head, no [B, N, V]
  assert opd.extra_fields("opd_topk_kl") == ("teacher_topk_ids_BNk", "teacher_topk_logp_BNk")
  assert opd.extra_fields("f_opd") == ("sup_drift_B", "teacher_logp_BN")
  assert opd.extra_fields("ppo_clip") == ()
  assert set(opd.PROVIDED_NEEDS) >= {"teacher_logp", "teacher_logits", "teacher_topk", "student_logits", "student_topk"}


def test_scoring_temperature_defaults_to_the_sampler():
  c = opd_tiny()
  c.sampler.temperature = 0.8
  assert opd.scoring_temperature(c) == 0.8
  c.distill.temperature = 0.5
  assert opd.scoring_temperature(c) == 0.5
