"""Hugging Face checkpoint tokenizers (`tokenizer.json`) and the vocabulary check against a model config.

`load_checkpoint_tokenizer` -> `CheckpointTokenizer`: the `Tokenizer` protocol (`jaxrl_llm.tasks.tokenizer`)
the training loop uses for `model.init_from`, through `transformers.AutoTokenizer` (no torch needed):
its special tokens, BOS rules and chat template (`chat_template` in tokenizer_config.json or a
`chat_template.jinja` file) are the library's, so rendered prompts are token for token what
`apply_chat_template` gives.

Only "fast" tokenizers are supported: a checkpoint folder must hold `tokenizer.json`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import pathlib
import shutil
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from jaxrl_llm.models.config import ModelConfig


def check_vocab(cfg: ModelConfig, tokenizer) -> None:
  """Raise if the tokenizer (any `Tokenizer`, e.g. a `CheckpointTokenizer`) can emit ids the model has no
  embedding row for.

  A model vocabulary larger than the tokenizer's is fine (checkpoints often pad V to a multiple of
  64 or 128); a smaller one would silently index out of bounds (JAX clamps gather indices).
  """
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(
        f"vocabulary mismatch: the tokenizer emits ids up to {tokenizer.vocab_size - 1} but the model "
        f"config has vocab_size={cfg.vocab_size}; use the tokenizer saved with this checkpoint"
    )


# A chat template is code from the checkpoint folder, run at start-up and for every prompt. The Jinja
# sandbox blocks attribute access, not compute: nested `range(100000)` loops spin for hours. So every
# rendering runs under this time limit (seconds; a sane template takes milliseconds).
RENDER_TIMEOUT_S = 10.0


class TemplateTimeout(ValueError):
  """A chat template did not finish rendering within `RENDER_TIMEOUT_S`."""


class _Overtime(TemplateTimeout):
  """Raised inside a rendering that ran past its deadline (asynchronously, by the watchdog)."""

  def __init__(self, *args):
    super().__init__(*(args or ("chat template rendering past its time limit",)))


class _Renderer:
  """Runs each rendering on the calling thread under a deadline that a watchdog thread enforces.

  Past the deadline the watchdog raises `_Overtime` in the rendering thread
  (`PyThreadState_SetAsyncExc`): Jinja templates compile to Python code, so a spinning loop stops at
  its next bytecode and the caller gets TemplateTimeout. Nothing is handed to another thread per call
  (a render takes well under a millisecond), and nothing keeps spinning after a timeout.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._active: dict[int, list] = {}  # thread id -> [deadline, fired]
    self._watchdog: threading.Thread | None = None

  def _watch(self) -> None:
    while True:
      time.sleep(0.1)
      now = time.monotonic()
      with self._lock:
        for tid, entry in self._active.items():
          if now > entry[0] and not entry[1]:
            entry[1] = True
            _async_raise(tid, _Overtime)

  def run(self, fn, describe):
    tid = threading.get_ident()
    with self._lock:
      if tid in self._active:  # a rendering inside a rendering: the outer deadline covers it
        return fn()
      entry = self._active[tid] = [time.monotonic() + RENDER_TIMEOUT_S, False]
      if self._watchdog is None:
        self._watchdog = threading.Thread(target=self._watch, name="chat-template-watchdog", daemon=True)
        self._watchdog.start()
    try:
      return fn()
    except _Overtime:
      raise TemplateTimeout(f"{describe()} did not finish rendering within {RENDER_TIMEOUT_S:g} s (a loop too "
                            "large?); fix or remove the template") from None
    finally:
      with self._lock:
        del self._active[tid]
        if entry[1]:  # fired as the rendering returned: clear what may still be pending
          _async_raise(tid, None)


def _async_raise(tid: int, exc) -> None:
  """Schedules `exc` (a class; None clears) in thread `tid` at its next Python bytecode."""
  ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)


_RENDERER = _Renderer()


def _template_source(folder: pathlib.Path) -> str:
  """Where a folder's chat template comes from (transformers prefers chat_template.jinja)."""
  for name in ("chat_template.jinja", "chat_template.json"):
    if (folder / name).is_file():
      return str(folder / name)
  return f"{folder / 'tokenizer_config.json'} (chat_template)"


# Files that make up a checkpoint's tokenizer (copied verbatim by `CheckpointTokenizer.save`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


@dataclasses.dataclass(frozen=True, eq=False)
class CheckpointTokenizer:
  """A checkpoint's own tokenizer behind the `Tokenizer` protocol (see `load_checkpoint_tokenizer`).

  Attributes:
    hf: the `transformers` tokenizer (`AutoTokenizer.from_pretrained(source)`).
    source: the folder it was loaded from.
    vocab_size, bos_id, eos_id, pad_id, stop_ids, end_of_turn_id, chat_template: see the protocol.
      `pad_id` is the checkpoint's pad token, else EOS (pad positions are masked everywhere, so any
      id inside the vocabulary does; EOS always is one).
  """
  hf: Any
  source: pathlib.Path
  vocab_size: int
  bos_id: Optional[int]
  eos_id: int
  pad_id: int
  stop_ids: tuple[int, ...]
  end_of_turn_id: Optional[int]
  chat_template: Optional[str]

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Ids of `text`; `add_special_tokens` applies the tokenizer's own rules (e.g. Llama's BOS)."""
    return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

  def decode(self, ids) -> str:
    """Text of `ids` (a list or an int array), special tokens dropped."""
    return self.hf.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)

  def chat_prompt_ids(self, messages: Sequence[dict]) -> list[int]:
    """`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`'s ids."""
    return self.chat_ids(messages)

  def chat_ids(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
    """`apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=True)`'s ids.

    A template that raises on these messages or tools is a ValueError naming the template's source
    (TemplateTimeout when it overruns `RENDER_TIMEOUT_S`); no template at all is a ValueError too.
    """
    if self.chat_template is None:
      raise ValueError(f"{self.source}: the tokenizer has no chat template (no 'chat_template' in "
                       "tokenizer_config.json and no chat_template.jinja)")
    messages, tools = list(messages), (None if tools is None else list(tools))
    describe = lambda: (f"the chat template {_template_source(self.source)}, given a {len(messages)}-message prompt"
                        + (f" and {len(tools)} tools" if tools else "") + ",")
    try:
      return list(_RENDERER.run(
          lambda: self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False), describe))
    except TemplateTimeout:
      raise
    except Exception as e:  # jinja's TemplateError, a raise_exception() in the template, a KeyError...
      raise ValueError(f"{describe()[:-1]} failed to render: {type(e).__name__}: {e}") from e

  def save(self, folder) -> None:
    """Copies the tokenizer files of `source` into `folder` (a checkpoint exported from this model)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
      if (self.source / name).is_file() and (self.source / name).resolve() != (folder / name).resolve():
        shutil.copyfile(self.source / name, folder / name)


def has_tokenizer_files(path) -> bool:
  """Whether a folder holds a Hugging Face fast tokenizer (`tokenizer.json`)."""
  return (pathlib.Path(path) / "tokenizer.json").is_file()


def _generation_eos_ids(folder: pathlib.Path) -> list[int]:
  """`eos_token_id` of generation_config.json (an int or a list), [] when absent."""
  file = folder / "generation_config.json"
  ids = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
  if ids is None:
    return []
  return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _end_of_turn_id(hf, chat_template: Optional[str], folder: pathlib.Path) -> Optional[int]:
  """The special token the chat template writes right after an assistant message (None if none).

  Rendered through the template itself: the first special token of the text that follows an
  assistant message's content (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3, EOS for others).
  This is the start-up probe of the template: one that does not finish in time raises TemplateTimeout.
  """
  if chat_template is None:
    return None
  mark = "\u2063jaxrl-answer\u2063"
  conversation = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": mark}]
  try:
    text = _RENDERER.run(lambda: hf.apply_chat_template(conversation, tokenize=False),
                         lambda: f"the chat template {_template_source(folder)}")
  except TemplateTimeout:
    raise
  except Exception:  # a template that rejects this conversation: no end-of-turn token known
    return None
  if mark not in text:
    return None
  special = {i for i, t in hf.added_tokens_decoder.items() if t.special} | set(hf.all_special_ids)
  tail = hf.encode(text[text.rindex(mark) + len(mark):], add_special_tokens=False)
  return next((int(i) for i in tail if i in special), None)


def load_checkpoint_tokenizer(path) -> CheckpointTokenizer:
  """The `Tokenizer` of a Hugging Face checkpoint folder, through `transformers.AutoTokenizer`.

  stop_ids = EOS, the chat template's end-of-turn token and generation_config.json's eos_token_id.
  Raises FileNotFoundError naming the folder when it has no tokenizer.json, ValueError when the
  tokenizer names no EOS token, TemplateTimeout (a ValueError) when its chat template does not render a
  probe conversation within `RENDER_TIMEOUT_S`.
  """
  folder = pathlib.Path(path)
  if not has_tokenizer_files(folder):
    raise FileNotFoundError(f"{folder}: no tokenizer files (expected tokenizer.json and tokenizer_config.json of a "
                            "Hugging Face checkpoint)")
  from transformers import AutoTokenizer  # local: transformers is heavy, and only checkpoints need it
  hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
  if hf.eos_token_id is None:
    raise ValueError(f"{folder}: the tokenizer names no eos_token (tokenizer_config.json); completions could never end")
  template = hf.chat_template if isinstance(hf.chat_template, str) else None
  eot = _end_of_turn_id(hf, template, folder)
  eos = int(hf.eos_token_id)
  stop = {eos, *_generation_eos_ids(folder)} | ({eot} if eot is not None else set())
  return CheckpointTokenizer(
      hf=hf, source=folder, vocab_size=max(hf.get_vocab().values()) + 1,
      bos_id=None if hf.bos_token_id is None else int(hf.bos_token_id), eos_id=eos,
      pad_id=eos if hf.pad_token_id is None else int(hf.pad_token_id), stop_ids=tuple(sorted(stop)),
      end_of_turn_id=eot, chat_template=template)
