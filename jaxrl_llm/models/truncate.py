"""A layer-truncated copy of a Hugging Face checkpoint: a smaller student that shares the teacher's tokenizer.

  python -m jaxrl_llm.models.truncate --layers 8            # SmolLM2-135M-Instruct -> its first 8 layers
  python -m jaxrl_llm.models.truncate --src DIR --layers 8 --out DIR2

The copy keeps the embedding, the final norm, the (tied) head and the first `n_layers` decoder layers;
config.json is the source's with `num_hidden_layers` changed, and every tokenizer file is copied, so
`distill.teacher=<source>` accepts the copy as its student (`model.init_from=<copy>`). Like the GGUF
import, the folder is written into a temporary sibling and renamed into place; a complete copy is reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys

from jaxrl_llm.models import gguf

_DONE = "truncated_from.json"  # written last: its presence marks a complete copy


def default_out(src, n_layers: int) -> pathlib.Path:
  """`<src>-first<n_layers>`, next to the source folder."""
  src = pathlib.Path(src)
  return src.parent / f"{src.name}-first{n_layers}"


def truncate_checkpoint(src, n_layers: int, out=None) -> pathlib.Path:
  """Writes (or reuses) the first `n_layers` decoder layers of the checkpoint `src` as a folder.

  Args:
    src: a Hugging Face checkpoint folder (config.json, safetensors, tokenizer files).
    n_layers: layers kept, 1 <= n_layers < the source's layer count.
    out: destination folder; default `default_out(src, n_layers)`.
  Returns:
    The destination folder.
  Raises:
    FileNotFoundError: `src` has no config.json. ValueError: `n_layers` out of range.
  """
  from jaxrl_llm.models.hf import family_of, load_hf, save_hf  # local: safetensors on first use
  from jaxrl_llm.models.tokenizer import TOKENIZER_FILES
  src = pathlib.Path(src)
  out = pathlib.Path(out) if out else default_out(src, n_layers)
  if (out / _DONE).is_file():
    return out
  if out.exists():
    raise FileExistsError(f"{out} exists but is not a completed truncated copy (no {_DONE}); remove it")
  if not (src / "config.json").is_file():
    raise FileNotFoundError(f"{src}: not a Hugging Face checkpoint folder (no config.json)")
  hf_config = json.loads((src / "config.json").read_text())
  depth = hf_config.get("num_hidden_layers")
  if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers < depth:
    raise ValueError(f"n_layers={n_layers!r} must be an int in [1, {depth - 1}] for {src} ({depth} layers)")
  cfg, params = load_hf(src)  # after the checks: the weights are the slow part
  params = {**params, "layers": {k: v[:n_layers] for k, v in params["layers"].items()}}
  cfg = dataclasses.replace(cfg, n_layers=n_layers)
  with gguf.staged_folder(out, _DONE) as tmp:
    save_hf(tmp, cfg, params, family=family_of(hf_config).name)
    # The source's config.json (every field it has) with the new depth, in place of save_hf's rendering.
    (tmp / "config.json").write_text(json.dumps({**hf_config, "num_hidden_layers": n_layers}, indent=2) + "\n")
    for name in TOKENIZER_FILES:
      if (src / name).is_file():
        shutil.copyfile(src / name, tmp / name)
    (tmp / _DONE).write_text(json.dumps({"source": str(src), "n_layers": n_layers}) + "\n")
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxrl_llm.models.truncate", description=__doc__.splitlines()[0])
  p.add_argument("--src", default=None, help="checkpoint folder (default: the SmolLM2 import, see `make smollm2`)")
  p.add_argument("--layers", type=int, required=True, help="decoder layers kept (the first ones)")
  p.add_argument("--out", default=None, help="output folder (default: <src>-first<layers>)")
  args = p.parse_args(argv)
  try:
    print(truncate_checkpoint(args.src or gguf.default_cache_dir(), args.layers, args.out))
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
