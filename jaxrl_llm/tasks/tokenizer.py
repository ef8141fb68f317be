"""Character tokenizer for the built-in tasks: a fixed 64-symbol vocabulary, no state.

Ids:
  0 pad, 1 bos, 2 eos, 3 unk,
  4..13  digits ``0``..``9``,
  14..20 ``+ - * = ( ) ,``, 21 space,
  22..47 letters ``a``..``z`` (lower case only),
  48..63 ``. : ; ! ? < > / _ ^ % # $ \\ { }``.

Any other character (upper case, newline, unicode) encodes to ``unk_id``; ``decode`` renders
``unk_id`` and any out-of-range id as U+FFFD. Neither function ever raises on its input.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

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


def pad_left(seqs: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads id sequences with ``pad_id`` to ``[B, width]`` int32; returns ``(tokens_BP, len_B)``.

  Raises ValueError when a sequence is longer than ``width`` (truncating a prompt silently
  would change the task).
  """
  tokens_BP = np.full((len(seqs), width), pad_id, dtype=np.int32)
  len_B = np.zeros((len(seqs),), dtype=np.int32)
  for b, s in enumerate(seqs):
    if len(s) > width:
      raise ValueError(f"sequence {b} has {len(s)} tokens, more than width {width}")
    if len(s):
      tokens_BP[b, width - len(s):] = s
    len_B[b] = len(s)
  return tokens_BP, len_B


def pad_right(seqs: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads id sequences with ``pad_id`` to ``[B, width]`` int32.

  Returns ``(tokens_BA, len_B)``; raises ValueError when a sequence is longer than ``width``.
  """
  tokens_BA = np.full((len(seqs), width), pad_id, dtype=np.int32)
  len_B = np.zeros((len(seqs),), dtype=np.int32)
  for b, s in enumerate(seqs):
    if len(s) > width:
      raise ValueError(f"sequence {b} has {len(s)} tokens, more than width {width}")
    tokens_BA[b, :len(s)] = s
    len_B[b] = len(s)
  return tokens_BA, len_B


class Tokenizer(NamedTuple):
  """The tokenizer interface other modules take (a tuple of functions and ids, no state)."""
  encode: Callable[..., list[int]]
  decode: Callable[[Sequence[int]], str]
  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int
  unk_id: int


CHAR_TOKENIZER = Tokenizer(encode=encode, decode=decode, vocab_size=vocab_size, pad_id=pad_id,
                           bos_id=bos_id, eos_id=eos_id, unk_id=unk_id)
