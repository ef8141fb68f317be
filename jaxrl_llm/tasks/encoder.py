"""The one place task text becomes token ids: prompts (raw or through a chat template) and SFT targets.

Tasks are text-level (prompts, answers and rewards are strings); a run builds one `Encoder` from its
tokenizer and chat settings (`encoder_from_config`) and every prompt the sampler, the learner, the
evaluation and the teacher see goes through it.

The tokenizer follows the model: without `model.init_from` it is the character tokenizer
(`tasks.tokenizer.CHAR_TOKENIZER`, the fast default for from-scratch toy models); with it, the
checkpoint folder's own (`policy_init.tokenizer_for_checkpoint`: tasks import no models).

Chat settings (`config.task`):
  chat_template  "auto"  the tokenizer's chat template when it has one, raw text otherwise (default)
                 "chat"  the chat template; an error when the tokenizer has none
                 "none"  raw text (base models): `encode(prompt, add_special_tokens=True)`, i.e. the
                         tokenizer's own BOS rule (the char tokenizer: BOS + one id per character)
  system_prompt  "" (no system message) or the system message of every chat prompt
A chat prompt is `[{"role": "system", ...}?, {"role": "user", "content": prompt}]` rendered with the
generation prompt: the ids `transformers`' `apply_chat_template(..., add_generation_prompt=True)` gives.
An SFT target is the answer's ids then the id that ends it: the template's end-of-turn token for chat
prompts (e.g. `<|im_end|>`), EOS otherwise.

Prompt width P (the sampler's prompt bucket, `prompt_width`): `task.prompt_width` tokens when set;
else for the character tokenizer in raw mode the task's bound + BOS (exact: one id per character);
else the longest encoded train/test prompt rounded up to a multiple of `WIDTH_MULTIPLE`, capped by
the checkpoint's context minus `sampler.max_new_tokens`. Prompts longer than P are dropped (and
counted) by `fit_examples`, never truncated.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxrl_llm.tasks import tokenizer as char_tok
from jaxrl_llm.tasks.tokenizer import CHAR_TOKENIZER, CharTokenizer, Tokenizer

CHAT_MODES = ("auto", "chat", "none")
WIDTH_MULTIPLE = 16  # prompt widths measured from the data are rounded up to this (few distinct buckets)


class Encoder:
  """Text -> ids for one tokenizer and chat setting; prompt ids are cached by text (pure function of it)."""

  def __init__(self, tokenizer: Tokenizer = CHAR_TOKENIZER, chat_template: str = "auto", system_prompt: str = ""):
    if chat_template not in CHAT_MODES:
      raise ValueError(f"chat_template={chat_template!r}: must be one of {CHAT_MODES}")
    if chat_template == "chat" and tokenizer.chat_template is None:
      raise ValueError(f"chat_template='chat': the tokenizer{_where(tokenizer)} has no chat template "
                       "(no 'chat_template' in tokenizer_config.json and no chat_template.jinja); "
                       "use chat_template='none' for a base model")
    self.tokenizer = tokenizer
    self.chat = chat_template == "chat" or (chat_template == "auto" and tokenizer.chat_template is not None)
    if system_prompt and not self.chat:
      raise ValueError(f"system_prompt={system_prompt!r} needs a chat template, and prompts are raw text here "
                       f"(chat_template={chat_template!r}, tokenizer{_where(tokenizer)})")
    self.system_prompt = system_prompt
    self._prompt_cache: dict[str, tuple[int, ...]] = {}

  @property
  def end_id(self) -> int:
    """The id that ends a reference completion: end-of-turn for chat prompts (when the template has one), else EOS."""
    t = self.tokenizer
    return t.end_of_turn_id if self.chat and t.end_of_turn_id is not None else t.eos_id

  def prompt_ids(self, prompt: str) -> list[int]:
    """Ids of a prompt as the policy sees it (raw with the tokenizer's BOS rule, or the rendered chat)."""
    ids = self._prompt_cache.get(prompt)
    if ids is None:
      if self.chat:
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        ids = tuple(self.tokenizer.chat_prompt_ids(messages + [{"role": "user", "content": prompt}]))
      else:
        ids = tuple(self.tokenizer.encode(prompt, add_special_tokens=True))
      self._prompt_cache[prompt] = ids
    return list(ids)

  def target_ids(self, answer: str) -> list[int]:
    """Ids of a reference completion: the answer then `end_id`."""
    return self.tokenizer.encode(answer) + [self.end_id]

  def pad_prompts(self, prompts: Sequence[str], width: int) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens_BP, len_B)`: prompts left-padded with the tokenizer's pad id to `width` (ValueError if longer)."""
    return char_tok.pad_left([self.prompt_ids(p) for p in prompts], width, self.tokenizer.pad_id)

  def pad_targets(self, answers: Sequence[str], width: int, truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens_BA, len_B)`: targets right-padded to `width` (`truncate`: cut at `width`, else ValueError)."""
    ids = [self.target_ids(a)[:width] if truncate else self.target_ids(a) for a in answers]
    return char_tok.pad_right(ids, width, self.tokenizer.pad_id)

  @property
  def exact_char_widths(self) -> bool:
    """Whether a prompt of n characters is exactly n + 1 ids (the char tokenizer, raw): task bounds give P."""
    return isinstance(self.tokenizer, CharTokenizer) and not self.chat


CHAR_ENCODER = Encoder()
"""The default: character tokenizer, raw prompts (BOS + characters), targets ending with EOS."""


def _where(tokenizer) -> str:
  source = getattr(tokenizer, "source", None)
  return f" of {source}" if source is not None else ""


def round_width(n: int, multiple: int = WIDTH_MULTIPLE) -> int:
  """`n` rounded up to a multiple of `multiple` (a prompt shape bucket)."""
  return -(-max(n, 1) // multiple) * multiple


def measured_width(encoder: Encoder, prompts: Sequence[str], cap: int | None = None) -> int:
  """The bucket width for these prompts: the longest encoding rounded up (`round_width`), at most `cap`."""
  longest = max((len(encoder.prompt_ids(p)) for p in prompts), default=1)
  width = round_width(longest)
  return width if cap is None else min(width, cap)


def fit_examples(encoder: Encoder, examples: Sequence[dict], width: int) -> tuple[list[dict], int]:
  """`(kept, dropped)`: the examples whose encoded prompt fits `width` tokens, and how many did not."""
  kept = [ex for ex in examples if len(encoder.prompt_ids(ex["prompt"])) <= width]
  return kept, len(examples) - len(kept)
