"""Hugging Face tokenizers (`tokenizer.json`) and the vocabulary check against a model config.

Only "fast" tokenizers are supported: a checkpoint folder must hold `tokenizer.json`, which the
`tokenizers` library reads without transformers. Special-token names come from
`tokenizer_config.json` when present.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Optional, Sequence

import tokenizers

from jaxrl_llm.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
  """Text <-> token ids through a `tokenizers.Tokenizer`; immutable once loaded.

  Attributes:
    tokenizer: the underlying `tokenizers.Tokenizer`.
    vocab_size: one past the largest id the tokenizer can emit (added tokens included).
    bos_id, eos_id, pad_id: special-token ids, None when the checkpoint names none.
  """

  tokenizer: tokenizers.Tokenizer
  vocab_size: int
  bos_id: Optional[int] = None
  eos_id: Optional[int] = None
  pad_id: Optional[int] = None

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text` (no BOS/EOS unless `add_special_tokens`)."""
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """Text of `ids` (a list or a 1-D int array)."""
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _special_id(tok: tokenizers.Tokenizer, entry) -> Optional[int]:
  """Id of a tokenizer_config.json special-token entry: a string or {"content": ...}."""
  content = entry.get("content") if isinstance(entry, dict) else entry
  return tok.token_to_id(content) if content else None


def load_tokenizer(path) -> HFTokenizer:
  """Load `tokenizer.json` (and special tokens from `tokenizer_config.json`) from a folder.

  Args:
    path: a checkpoint folder, or the `tokenizer.json` file itself.
  Raises:
    FileNotFoundError: no tokenizer.json (slow sentencepiece-only tokenizers are not supported).
  """
  path = pathlib.Path(path)
  file = path if path.is_file() else path / "tokenizer.json"
  if not file.is_file():
    raise FileNotFoundError(
        f"no tokenizer.json at {path}; only Hugging Face 'fast' tokenizers (tokenizer.json) are supported"
    )
  tok = tokenizers.Tokenizer.from_file(str(file))
  config_file = file.parent / "tokenizer_config.json"
  special = json.loads(config_file.read_text()) if config_file.is_file() else {}
  return HFTokenizer(
      tokenizer=tok,
      vocab_size=max(tok.get_vocab(with_added_tokens=True).values()) + 1,
      bos_id=_special_id(tok, special.get("bos_token")),
      eos_id=_special_id(tok, special.get("eos_token")),
      pad_id=_special_id(tok, special.get("pad_token")),
  )


def check_vocab(cfg: ModelConfig, tokenizer: HFTokenizer) -> None:
  """Raise if the tokenizer can emit ids the model has no embedding row for.

  A model vocabulary larger than the tokenizer's is fine (checkpoints often pad V to a multiple of
  64 or 128); a smaller one would silently index out of bounds (JAX clamps gather indices).
  """
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(
        f"vocabulary mismatch: the tokenizer emits ids up to {tokenizer.vocab_size - 1} but the model "
        f"config has vocab_size={cfg.vocab_size}; use the tokenizer saved with this checkpoint"
    )
