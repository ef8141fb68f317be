"""experiments/export_policy: a run's latest checkpoint becomes a Hugging Face folder that loads back."""

import os

import jax
import numpy as np
import pytest

from experiments import export_policy
from jaxrl_llm import loop
from jaxrl_llm.config import load_file
from jaxrl_llm.models import load_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny():
  c = load_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.num_steps, c.eval.every, c.log.tensorboard = 2, 2, False
  return c


@pytest.mark.slow
def test_export_loads_back_with_the_trained_weights_and_tokenizer(tmp_path):
  c = tiny()
  published = {}

  def on_step(row, store):  # the policy the run published last (fp32: the sampler copy is the learner's)
    snap = store.acquire(store.latest_version)
    published["params"] = jax.tree.map(np.asarray, snap.params)
    store.release(snap)

  rows = loop.run(c, str(tmp_path / "run"), on_step=on_step)
  assert rows[-1]["grad_norm"] > 0  # the exported policy moved away from its start
  step = export_policy.export(tiny(), str(tmp_path / "run"), str(tmp_path / "hf"))
  assert step == 2
  cfg, params = load_hf(str(tmp_path / "hf"), param_dtype="float32")
  assert jax.tree.structure(params) == jax.tree.structure(published["params"])
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(published["params"])):
    np.testing.assert_array_equal(np.asarray(got), want)  # stored and read back, not recomputed
  # The folder is a starting point like any checkpoint: its tokenizer and weights drive a run, and its
  # greedy held-out accuracy is the run's last evaluation (same prompts, same weights, same key).
  c2 = tiny()
  c2.model.init_from = str(tmp_path / "hf")
  c2.sft.steps = 0
  r = loop.setup(c2)
  acc = loop.evaluate(params, r.model_cfg, c2, r.test, r.task, r.k_eval, r.encoder.tokenizer)
  assert acc == pytest.approx(rows[-1]["eval_accuracy"])


def test_export_without_a_checkpoint_is_an_error(tmp_path):
  with pytest.raises(SystemExit, match="no valid checkpoint"):
    export_policy.export(tiny(), str(tmp_path / "empty"), str(tmp_path / "hf"))
