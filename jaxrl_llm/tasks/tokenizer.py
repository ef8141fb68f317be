"""Character tokenizer for the built-in tasks: a fixed 64-symbol vocabulary, no state.

Ids:
  0 pad, 1 bos, 2 eos, 3 unk,
  4..13  digits ``0``..``9``,
  14..20 ``+ - * = ( ) ,``, 21 space,
  22..47 letters ``a``..``z`` (lower case only),
  48..63 ``. : ; ! ? < > / _ ^ % # $ \\ { }``.

Any other character (upper case, newline, unicode) encodes to ``unk_id``; ``decode`` renders
``unk_id`` and any out-of-range id as U+FFFD. Neither function ever raises on its input.

Also the ``Tokenizer`` protocol every tokenizer follows (this one as ``CHAR_TOKENIZER``; a
checkpoint's own in ``jaxrl_llm.models.tokenizer``) and ``completion_text`` (a completion's text up
to its first stop id).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

pad_id = 0
bos_id = 1
eos_id = 2
unk_id = 3

_SPECIALS = 4
_CHARS = "0123456789" + "+-*=()," + " " + "abcdefghijklmnopqrstuvwxyz" + ".:;!?<>/_^%#$\\{}"
_CHAR_TO_ID = {c: i + _SPECIALS for i, c in enumerate(_CHARS)}
_REPLACEMENT = "\ufffd"

vocab_size = _SPECIALS + len(_CHARS)
assert vocab_size <= 64 and len(_CHAR_TO_ID) == len(_CHARS)


def encode(text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
  """Encodes ``text`` one id per character; unknown characters become ``unk_id``."""
  ids = [_CHAR_TO_ID.get(c, unk_id) for c in text]
  return ([bos_id] if add_bos else []) + ids + ([eos_id] if add_eos else [])


def _id_to_char(i: int) -> str:
  if _SPECIALS <= i < vocab_size:
    return _CHARS[i - _SPECIALS]
  return _REPLACEMENT


def decode(ids: Sequence[int] | np.ndarray) -> str:
  """Decodes ids to text: stops at the first ``eos_id``, skips pad and bos.

  Accepts lists, numpy or jax integer arrays (flattened). ``unk_id`` and out-of-range ids become
  U+FFFD, so decoding never raises on model output.
  """
  chars = []
  for i in np.asarray(ids).reshape(-1).tolist():
    if i == eos_id:
      break
    if i in (pad_id, bos_id):
      continue
    chars.append(_id_to_char(int(i)))
  return "".join(chars)


def pad_left(seqs: Sequence[Sequence[int]], width: int, pad: int = pad_id) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads id sequences with ``pad`` to ``[B, width]`` int32; returns ``(tokens_BP, len_B)``.

  Raises ValueError when a sequence is longer than ``width`` (truncating a prompt silently
  would change the task).
  """
  tokens_BP = np.full((len(seqs), width), pad, dtype=np.int32)
  len_B = np.zeros((len(seqs),), dtype=np.int32)
  for b, s in enumerate(seqs):
    if len(s) > width:
      raise ValueError(f"sequence {b} has {len(s)} tokens, more than width {width}")
    if len(s):
      tokens_BP[b, width - len(s):] = s
    len_B[b] = len(s)
  return tokens_BP, len_B


def pad_right(seqs: Sequence[Sequence[int]], width: int, pad: int = pad_id) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads id sequences with ``pad`` to ``[B, width]`` int32.

  Returns ``(tokens_BA, len_B)``; raises ValueError when a sequence is longer than ``width``.
  """
  tokens_BA = np.full((len(seqs), width), pad, dtype=np.int32)
  len_B = np.zeros((len(seqs),), dtype=np.int32)
  for b, s in enumerate(seqs):
    if len(s) > width:
      raise ValueError(f"sequence {b} has {len(s)} tokens, more than width {width}")
    tokens_BA[b, :len(s)] = s
    len_B[b] = len(s)
  return tokens_BA, len_B


@runtime_checkable
class Tokenizer(Protocol):
  """What the rest of the library needs from a tokenizer (the char tokenizer or a checkpoint's own).

  Attributes:
    vocab_size: one past the largest id `encode` or the template can emit (the model may have more rows).
    bos_id: beginning-of-sequence id, None when the tokenizer has none.
    eos_id: end-of-sequence id.
    pad_id: id written where no token is (prompt left-padding, after a completion's stop).
    stop_ids: every id that ends a completion (sorted): EOS, and for chat checkpoints the template's
      end-of-turn id (e.g. `<|im_end|>`) and the ids of `generation_config.json`.
    end_of_turn_id: the id that closes an assistant turn in the chat template (None: no template,
      or it ends turns with EOS); SFT targets of chat prompts end with it.
    chat_template: the jinja chat template, None when the tokenizer has none.
  Methods:
    encode(text, add_special_tokens=False) -> ids; with `add_special_tokens` the tokenizer's own
      BOS/EOS rules for a raw prompt (the char tokenizer adds BOS).
    decode(ids) -> text, special tokens (pad, BOS, EOS, ...) dropped.
    chat_ids(messages, *, tools=None, add_generation_prompt=True) -> the ids `apply_chat_template(messages,
      tools=tools, add_generation_prompt=..., tokenize=True)` gives (ValueError when there is no template
      or it raises on these messages/tools, naming the template's source).
    chat_prompt_ids(messages) -> `chat_ids(messages)`: a prompt with the generation prompt, no tools.
    save(folder): writes what `policy_init.tokenizer_for_checkpoint(folder)` needs to load it back.
  """
  vocab_size: int
  bos_id: int | None
  eos_id: int
  pad_id: int
  stop_ids: tuple[int, ...]
  end_of_turn_id: int | None
  chat_template: str | None

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

  def chat_ids(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = True) -> list[int]: ...

  def chat_prompt_ids(self, messages: Sequence[dict]) -> list[int]: ...

  def save(self, folder: str | os.PathLike) -> None: ...


CHAR_TOKENIZER_FILE = "char_tokenizer.json"
"""Marker file of a checkpoint folder whose model uses the character tokenizer (written by `save`)."""


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """The character tokenizer of this module behind the `Tokenizer` protocol (stateless)."""
  vocab_size: int = vocab_size
  bos_id: int = bos_id
  eos_id: int = eos_id
  pad_id: int = pad_id
  stop_ids: tuple[int, ...] = (eos_id,)
  end_of_turn_id: None = None
  chat_template: None = None
  unk_id: int = unk_id

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """One id per character; `add_special_tokens` prepends BOS (a raw prompt)."""
    return encode(text, add_bos=add_special_tokens)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    return decode(ids)

  def chat_ids(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
    raise ValueError("the character tokenizer has no chat template (use task.chat_template='none')")

  def chat_prompt_ids(self, messages: Sequence[dict]) -> list[int]:
    return self.chat_ids(messages)

  def save(self, folder: str | os.PathLike) -> None:
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / CHAR_TOKENIZER_FILE).write_text(json.dumps({"tokenizer": "jaxrl_llm.char", "vocab_size": vocab_size}))


CHAR_TOKENIZER = CharTokenizer()


def completion_text(tokenizer: Tokenizer, ids: Sequence[int] | np.ndarray) -> str:
  """The text of a sampled completion: its ids up to (without) the first stop id, decoded."""
  ids = np.asarray(ids, np.int64).reshape(-1)
  hits = np.flatnonzero(np.isin(ids, tokenizer.stop_ids))
  return tokenizer.decode(ids[:hits[0]] if hits.size else ids)
