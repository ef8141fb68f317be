"""`jaxrl_llm.sft_cache`: a stored warm start is bitwise the one the steps produce, and any changed input misses."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import loop, sft, sft_cache
from jaxrl_llm.config import load_file
from jaxrl_llm.models import ModelConfig, init_params

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, max_seq_len=32)


def _schedule(**kw):
  return sft.SftSchedule(**{"steps": 6, "batch_size": 4, "lr": 1e-2, "max_new_tokens": 4, "seed": 0, **kw})


def _train():
  return [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20)]


def _warm(schedule, params, cache_dir, monkeypatch):
  monkeypatch.setenv(sft_cache.ENV, str(cache_dir))
  copy = jax.tree.map(jnp.copy, params)  # the SFT step donates its input
  return sft.sft_warm_start(schedule, CFG, copy, _train(), 8)


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_hit_is_bitwise_the_trained_result_and_skips_training(tmp_path, monkeypatch):
  params = init_params(CFG, jax.random.key(0))
  p_off, loss_off = _warm(_schedule(), params, "", monkeypatch)  # no cache: plain training
  p1, loss1 = _warm(_schedule(), params, tmp_path, monkeypatch)  # a miss: trains and stores
  assert len(list(tmp_path.iterdir())) == 1
  calls = []
  monkeypatch.setattr(sft.learner, "make_sft_step", lambda *a: calls.append(a))  # a hit must not train
  p2, loss2 = _warm(_schedule(), params, tmp_path, monkeypatch)
  assert calls == [] and loss2 == loss1 == loss_off
  assert _same(p2, p1) and _same(p1, p_off)
  assert not _same(p2, params)  # the warm start moved the weights


@pytest.mark.parametrize("change", ["steps", "lr", "seed", "params", "model"])
def test_any_changed_input_misses(change, tmp_path, monkeypatch):
  params = init_params(CFG, jax.random.key(0))
  _warm(_schedule(), params, tmp_path, monkeypatch)
  sched = {"steps": _schedule(steps=7), "lr": _schedule(lr=2e-2), "seed": _schedule(seed=1)}.get(change, _schedule())
  if change == "params":
    params = init_params(CFG, jax.random.key(1))
  key = lambda s, p, cfg: sft_cache.digest(sft_cache.settings_of(cfg, s), p, [])
  cfg = dataclasses.replace(CFG, rope_theta=500.0) if change == "model" else CFG
  assert key(sched, params, cfg) != key(_schedule(), init_params(CFG, jax.random.key(0)), CFG)
  if change != "model":
    _warm(sched, params, tmp_path, monkeypatch)
    assert len(list(tmp_path.iterdir())) == 2


def test_changed_batches_miss_and_a_corrupt_entry_retrains(tmp_path, monkeypatch):
  params = init_params(CFG, jax.random.key(0))
  settings = sft_cache.settings_of(CFG, _schedule())
  b = [(np.zeros((2, 3), np.int32),)]
  assert sft_cache.digest(settings, params, b) != sft_cache.digest(settings, params, [(np.ones((2, 3), np.int32),)])
  p1, _ = _warm(_schedule(), params, tmp_path, monkeypatch)
  (entry,) = tmp_path.iterdir()
  (entry / "params.npz").write_bytes(b"not an npz")
  p2, _ = _warm(_schedule(), params, tmp_path, monkeypatch)  # unreadable: trained again, same result
  assert _same(p1, p2)


def test_a_tiny_run_reads_the_warm_start_of_an_earlier_run(tmp_path, monkeypatch):
  """Two runs of configs/tiny.py with the cache: the second trains no SFT step and reports the same loss."""
  monkeypatch.setenv(sft_cache.ENV, str(tmp_path / "cache"))
  c = load_file(pathlib.Path(__file__).parents[1] / "configs" / "tiny.py")
  c.num_steps, c.eval.every = 1, 0
  rows_a = loop.run(c, str(tmp_path / "a"))
  calls = []
  monkeypatch.setattr(sft.learner, "make_sft_step", lambda *a: calls.append(a))
  rows_b = loop.run(c, str(tmp_path / "b"))
  assert calls == []
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]
  assert strip(rows_a) == strip(rows_b)
