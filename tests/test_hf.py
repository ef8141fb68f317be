"""HF checkpoint import/export: parity with `transformers` on tiny random Llama/Qwen2/Qwen3 models.

Every model is built locally (no hub), with all weights (norms and biases too) randomised so a
swapped or mis-transposed tensor changes the logits.
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from jaxrl_llm.models import ModelConfig, forward, init_params, param_shapes  # noqa: E402
from jaxrl_llm.models import load_hf, save_hf  # noqa: E402  (the public, lazily imported path)
from jaxrl_llm.models.tokenizer import check_vocab, load_checkpoint_tokenizer  # noqa: E402

torch.set_num_threads(1)

_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=64, rms_norm_eps=1e-5)
# name -> (family, transformers config class, extra config kwargs)
CASES = {
    "llama": ("llama", "LlamaConfig", dict(tie_word_embeddings=False, rope_theta=5e5)),
    "llama_tied": ("llama", "LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", "Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen2_tied": ("qwen2", "Qwen2Config", dict(tie_word_embeddings=True)),
    # head_dim 16 != hidden / heads = 8: Qwen3 sets it explicitly.
    "qwen3": ("qwen3", "Qwen3Config", dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e6)),
    "qwen3_tied": ("qwen3", "Qwen3Config", dict(tie_word_embeddings=True, head_dim=16)),
}


def _randomise_torch(model, seed):
  """Replace every parameter: norms near 1, biases and weights O(0.1-1), so logits are O(1)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1.0 + 0.2 * noise if "norm" in name else (noise if "embed" in name else 0.2 * noise))


def _torch_logits(model, tokens_BT):
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(tokens_BT)).long()).logits.numpy()


def _tokens(seed, shape=(2, 9)):
  return np.random.default_rng(seed).integers(0, 64, shape).astype(np.int32)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """name -> folder of a saved, randomised transformers model."""
  dirs = {}
  for seed, (name, (_, config_cls, extra)) in enumerate(CASES.items()):
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**_SMALL, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomise_torch(model, seed)
    dirs[name] = tmp_path_factory.mktemp(name)
    model.save_pretrained(dirs[name], safe_serialization=True)
  return dirs


def _load_torch(path):
  return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", list(CASES))
def test_load_matches_transformers_logits(hf_dirs, name):
  cfg, params = load_hf(hf_dirs[name])
  _, _, extra = CASES[name]
  assert cfg.tie_embeddings == extra["tie_word_embeddings"]
  assert cfg.rope_theta == extra.get("rope_theta", 10000.0)
  assert cfg.head_dim == extra.get("head_dim", 8)
  assert (cfg.attn_bias, cfg.qk_norm) == (name.startswith("qwen2"), name.startswith("qwen3"))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(
      lambda a: (a.shape, a.dtype), param_shapes(cfg))

  tokens_BT = _tokens(1)
  want_BTV = _torch_logits(_load_torch(hf_dirs[name]), tokens_BT)
  got_BTV = np.asarray(forward(params, jnp.asarray(tokens_BT), cfg))
  assert want_BTV.std() > 0.5  # the comparison is not between near-zero logits
  np.testing.assert_allclose(got_BTV, want_BTV, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3"])
def test_export_import_roundtrip_is_bitwise(hf_dirs, tmp_path, name):
  cfg, params = load_hf(hf_dirs[name])
  save_hf(tmp_path, cfg, params, family=CASES[name][0])
  cfg2, params2 = load_hf(tmp_path)
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)


def _random_jax_model(family, tie, param_dtype="float32", seed=0, head_dim=None):
  """A jaxrl_llm config + params with every leaf random (norms near 1, biases nonzero)."""
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=head_dim or (16 if family == "qwen3" else 8), d_ff=64, rope_theta=20000.0,
                    rms_eps=1e-5, tie_embeddings=tie, qk_norm=family == "qwen3",
                    attn_bias=family == "qwen2", param_dtype=param_dtype, init_std=0.2)
  params = init_params(cfg, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  # Shift every leaf by noise so norms (ones) and biases (zeros) are not at their defaults.
  leaves = [(x + 0.2 * jax.random.normal(k, x.shape)).astype(x.dtype) for x, k in zip(leaves, keys)]
  return cfg, jax.tree.unflatten(treedef, leaves)


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen2", False),
                                        ("qwen3", True)])
def test_export_loads_in_transformers(tmp_path, family, tie):
  cfg, params = _random_jax_model(family, tie)
  save_hf(tmp_path, cfg, params, family=family)
  model = _load_torch(tmp_path)
  want_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
  assert type(model).__name__ == want_class[family]
  assert model.config.tie_word_embeddings == tie

  tokens_BT = _tokens(2)
  want_BTV = _torch_logits(model, tokens_BT)
  got_BTV = np.asarray(forward(params, jnp.asarray(tokens_BT), cfg))
  assert want_BTV.std() > 0.1
  np.testing.assert_allclose(got_BTV, want_BTV, atol=1e-4, rtol=0)


def test_bfloat16_roundtrip_keeps_dtype_and_bits(tmp_path):
  cfg, params = _random_jax_model("qwen2", tie=False, param_dtype="bfloat16")
  save_hf(tmp_path, cfg, params, family="qwen2")
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  cfg2, params2 = load_hf(tmp_path)
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)
  # An explicit param_dtype upcasts exactly.
  cfg32, params32 = load_hf(tmp_path, param_dtype="float32")
  assert cfg32.param_dtype == "float32"
  _assert_trees_equal(params32, jax.tree.map(lambda x: x.astype(jnp.float32), params))


def test_sharded_checkpoint_loads_like_single_file(hf_dirs, tmp_path):
  model = _load_torch(hf_dirs["qwen3"])
  model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  _assert_trees_equal(load_hf(tmp_path)[1], load_hf(hf_dirs["qwen3"])[1])


def _copy_with_config(src, dst, **changes):
  shutil.copytree(src, dst)
  hf = json.loads((dst / "config.json").read_text())
  (dst / "config.json").write_text(json.dumps({**hf, **changes}))
  return dst


@pytest.mark.parametrize("changes,match", [
    (dict(architectures=["GPT2LMHeadModel"]), r"architectures=\['GPT2LMHeadModel'\]"),
    (dict(architectures=None), r"architectures=\[\]"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}), "llama3"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_hidden_layers=3), "model.layers.2"),  # config promises a layer the file lacks
    (dict(vocab_size=65), "embed_tokens"),  # shape mismatch names the tensor
])
def test_load_rejects_what_it_cannot_represent(hf_dirs, tmp_path, changes, match):
  path = _copy_with_config(hf_dirs["llama"], tmp_path / "ckpt", **changes)
  with pytest.raises(ValueError, match=match):
    load_hf(path)


def test_load_rejects_unused_tensors(hf_dirs, tmp_path):
  # A Qwen2 checkpoint relabelled as Llama: the q/k/v biases would otherwise be dropped silently.
  path = _copy_with_config(hf_dirs["qwen2"], tmp_path / "ckpt", architectures=["LlamaForCausalLM"],
                           model_type="llama")
  with pytest.raises(ValueError, match="q_proj.bias"):
    load_hf(path)


def test_load_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(tmp_path)


@pytest.mark.parametrize("family,cfg_family,head_dim,match", [
    ("llama", "qwen2", None, "attn_bias"),  # q/k/v biases have no place in a Llama
    ("llama", "qwen3", None, "qk_norm"),
    ("qwen2", "qwen2", 16, "head_dim"),  # Qwen2 derives head_dim = hidden / heads = 8
    ("gemma", "llama", None, "unknown family"),
])
def test_save_rejects_mismatched_family(tmp_path, family, cfg_family, head_dim, match):
  cfg, params = _random_jax_model(cfg_family, tie=False, head_dim=head_dim)
  with pytest.raises(ValueError, match=match):
    save_hf(tmp_path, cfg, params, family=family)
  assert not (tmp_path / "config.json").exists()


def test_save_rejects_params_not_matching_config(tmp_path):
  cfg, params = _random_jax_model("llama", tie=False)
  with pytest.raises(ValueError, match="do not match"):
    save_hf(tmp_path, dataclasses.replace(cfg, tie_embeddings=True), params, family="llama")


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  """A word-level tokenizer.json with 8 ids (0..7) and special tokens named in tokenizer_config."""
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "cat": 4, "sat": 5, "on": 6, "mat": 7}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
  tok.add_special_tokens(["<s>", "</s>"])
  path = tmp_path_factory.mktemp("tok")
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
       "pad_token": None}))
  return path


def test_tokenizer_encode_decode(tokenizer_dir):
  tok = load_checkpoint_tokenizer(tokenizer_dir)
  assert tok.encode("the cat sat on the mat") == [3, 4, 5, 6, 3, 7]
  assert tok.encode("the dog") == [3, 0]
  assert tok.decode(np.array([3, 4, 5])) == "the cat sat"
  assert tok.decode([1, 3, 4, 2]) == "the cat"  # special tokens dropped
  # No pad token named: pad = EOS (pad positions are masked everywhere).
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (8, 1, 2, 2, (2,))


def test_check_vocab(tokenizer_dir):
  tok = load_checkpoint_tokenizer(tokenizer_dir)
  base = ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
  check_vocab(base, tok)  # exact fit
  check_vocab(dataclasses.replace(base, vocab_size=64), tok)  # padded embedding is fine
  with pytest.raises(ValueError, match="vocab_size=7"):
    check_vocab(dataclasses.replace(base, vocab_size=7), tok)


def test_tokenizer_missing(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    load_checkpoint_tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3"])
def test_save_without_family_keeps_the_loaded_family(hf_dirs, tmp_path, name):
  """The family is a field of the loaded config (issue 32): a Qwen2 checkpoint, whose config has q/k/v
  biases and no q/k norms, is saved back as Qwen2 (the old guess "qwen3 if qk_norm else llama" failed)."""
  cfg, params = load_hf(hf_dirs[name])
  assert cfg.family == CASES[name][0]
  save_hf(tmp_path, dataclasses.replace(cfg, dtype="bfloat16"), params)  # derived configs keep it
  assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
      {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[CASES[name][0]]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_family_for_a_config_built_from_fields(family):
  from jaxrl_llm.models.hf import family_for
  cfg, _ = _random_jax_model(family, tie=False)
  assert cfg.family is None and family_for(cfg) == family
  assert dataclasses.replace(cfg, family="qwen2") == cfg  # not compared: it changes no computation
