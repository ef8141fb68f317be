"""Layer-truncated checkpoint copies (`jaxrl_llm.models.truncate`): the OPD student of configs/smollm2_opd.py."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tiny_hf
from jaxrl_llm.models import load_hf
from jaxrl_llm.models import truncate as tr
from jaxrl_llm.policy_init import tokenizer_for_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  return tiny_hf.make_checkpoint(tmp_path_factory.mktemp("t") / "src", seed=3, n_layers=3, generation_eos=[0, 2])


def test_truncated_copy_keeps_the_first_layers_and_everything_else(src, tmp_path):
  out = tr.truncate_checkpoint(src, 2, tmp_path / "student")
  assert out == tmp_path / "student"
  cfg_s, p_s = load_hf(src)
  cfg_t, p_t = load_hf(out)
  assert cfg_t.n_layers == 2 and cfg_t == cfg_s.__class__(**{**cfg_s.__dict__, "n_layers": 2})
  for k in p_s["layers"]:
    np.testing.assert_array_equal(np.asarray(p_t["layers"][k]), np.asarray(p_s["layers"][k])[:2])
  for k in set(p_s) - {"layers"}:
    np.testing.assert_array_equal(np.asarray(p_t[k]), np.asarray(p_s[k]))
  hf_s = json.loads((src / "config.json").read_text())
  hf_t = json.loads((out / "config.json").read_text())
  assert hf_t == {**hf_s, "num_hidden_layers": 2}
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert (out / name).read_bytes() == (src / name).read_bytes()
  tok_s, tok_t = tokenizer_for_checkpoint(src), tokenizer_for_checkpoint(out)
  assert tok_t.hf.get_vocab() == tok_s.hf.get_vocab() and tok_t.stop_ids == tok_s.stop_ids


def test_complete_copy_is_reused_and_default_location(src):
  out = tr.truncate_checkpoint(src, 1)
  assert out == src.parent / "src-first1"
  stamp = (out / "model.safetensors").stat().st_mtime_ns
  assert tr.truncate_checkpoint(src, 1) == out
  assert (out / "model.safetensors").stat().st_mtime_ns == stamp
  assert not [p for p in src.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


@pytest.mark.parametrize("n", [0, 3, 4, -1, 1.5, True])
def test_bad_layer_count_is_named(src, tmp_path, n):
  with pytest.raises(ValueError, match=r"n_layers=.* must be an int in \[1, 2\]"):
    tr.truncate_checkpoint(src, n, tmp_path / "bad")
  assert not (tmp_path / "bad").exists()


def test_missing_source_and_incomplete_destination(src, tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    tr.truncate_checkpoint(tmp_path / "nope", 1)
  (tmp_path / "half").mkdir()
  with pytest.raises(FileExistsError, match="not a completed truncated copy"):
    tr.truncate_checkpoint(src, 1, tmp_path / "half")


def test_cli(src, tmp_path):
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  run = lambda *a: subprocess.run([sys.executable, "-m", "jaxrl_llm.models.truncate", *a], env=env,
                                  capture_output=True, text=True, timeout=300)
  ok = run("--src", str(src), "--layers", "2", "--out", str(tmp_path / "cli"))
  assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "cli"), ok.stderr
  bad = run("--src", str(src), "--layers", "9", "--out", str(tmp_path / "cli9"))
  assert bad.returncode == 1 and bad.stderr.startswith("error: n_layers=9")
