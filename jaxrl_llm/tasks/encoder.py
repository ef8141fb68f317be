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

Multi-turn episodes (`rollout.episodes`): `episode_prompt_ids(first, tools)` renders an environment's first
message(s), optionally with tool schemas; `observation_ids(messages, turn_ended)` renders what the environment
says after a policy turn as the ids appended to the episode. The policy's own tokens are never re-encoded:
in chat mode an observation is the template's *delta* (what the template writes after a closed assistant
turn, up to and including the next generation prompt), so an episode's ids are token for token those of
`apply_chat_template(whole conversation)` (tested against SmolLM2's template). Templates that do not render
`tools` (SmolLM2's) get the tools as `hermes_tools_text` merged into the system message.

Prompt width P (the sampler's prompt bucket, `prompt_width`): `task.prompt_width` tokens when set;
else for the character tokenizer in raw mode the task's bound + BOS (exact: one id per character);
else the longest encoded train/test prompt rounded up to a multiple of `WIDTH_MULTIPLE`, capped by
the checkpoint's context minus `sampler.max_new_tokens`. Prompts longer than P are dropped (and
counted) by `fit_examples`, never truncated.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from jaxrl_llm.tasks import tokenizer as char_tok
from jaxrl_llm.tasks.tokenizer import CHAR_TOKENIZER, CharTokenizer, Tokenizer

CHAT_MODES = ("auto", "chat", "none")
WIDTH_MULTIPLE = 16  # prompt widths measured from the data are rounded up to this (few distinct buckets)

# The fixed conversation an observation's delta is measured against (`Encoder.observation_ids`).
_REF_MARK = "jaxrl-reference-reply"
_REF_CONVERSATION = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": _REF_MARK})
# A tool schema rendered once to learn whether a template renders `tools` at all (`Encoder.renders_tools`).
_PROBE_TOOL = {"type": "function", "function": {
    "name": "jaxrl_probe_tool", "description": "Probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "x"}}, "required": ["x"]}}}


def hermes_tools_text(tools: Sequence[dict]) -> str:
  """The system text that describes `tools` (JSON schemas) to a policy whose template does not render them.

  Hermes-style: one schema per line inside `<tools></tools>`, then the call format
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what `envs.tools.parse_tool_calls` reads).
  """
  schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
  return ("You can call the functions described by these JSON schemas:\n<tools>\n" + schemas + "\n</tools>\n"
          "To call one, write a JSON object with its name and arguments inside tool_call tags, one block per call:\n"
          '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
          "Each call's result comes back in the next message. A reply without a tool call is your final answer.")


def check_messages(value: Any, roles: Sequence[str]) -> list[dict]:
  """`value` as a list of messages: a str is one user message; a list must hold {"role", "content": str}
  dicts with a role in `roles` (a ValueError saying what is wrong otherwise)."""
  if isinstance(value, str):
    return [{"role": "user", "content": value}]
  if not isinstance(value, (list, tuple)) or not value:
    raise ValueError(f"messages must be a str or a non-empty list of message dicts, got {type(value).__name__}")
  for i, m in enumerate(value):
    if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
      raise ValueError(f"message {i} must be a dict with 'role' in {tuple(roles)} and a str 'content', got {m!r:.200}")
  return [{"role": m["role"], "content": m["content"]} for m in value]


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
    self._renders_tools: bool | None = None
    self._reference: tuple[list[int], int] | None = None  # (reference ids, where an observation's delta starts)

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

  @property
  def renders_tools(self) -> bool:
    """Whether the chat template renders `tools=` (probed once: does a small tool schema change the prompt?)."""
    if self._renders_tools is None:
      probe = [{"role": "user", "content": "hi"}]
      self._renders_tools = self.chat and (self.tokenizer.chat_ids(probe, tools=[_PROBE_TOOL])
                                           != self.tokenizer.chat_ids(probe))
    return self._renders_tools

  def episode_prompt_ids(self, first: str | Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Ids of an episode's first prompt: `first` is one user message (str) or system/user message dicts.

    Chat: the encoder's `system_prompt` first unless the messages start with a system message, rendered with
    the generation prompt; `tools` passed to the template when it renders them (`renders_tools`), else
    `hermes_tools_text(tools)` appended to the system message (or as one). Raw: the contents joined with
    "\n" (after `hermes_tools_text(tools)` when tools are given), with `prompt_ids`' BOS rule.
    A str without tools gives exactly `prompt_ids(first)`.
    """
    messages = check_messages(first, ("system", "user"))
    if not self.chat:
      texts = ([hermes_tools_text(tools)] if tools else []) + [m["content"] for m in messages]
      return self.prompt_ids("\n".join(texts))
    if messages[0]["role"] != "system" and self.system_prompt:
      messages.insert(0, {"role": "system", "content": self.system_prompt})
    if tools and not self.renders_tools:
      block = hermes_tools_text(tools)
      if messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + block}
      else:
        messages.insert(0, {"role": "system", "content": block})
      tools = None
    return self.tokenizer.chat_ids(messages, tools=list(tools) if tools else None, add_generation_prompt=True)

  def _delta_start(self) -> tuple[list[int], int]:
    """The reference conversation's ids (ending with a closed assistant turn) and the index just after its
    last stop id (where an observation's delta starts); cached. ValueError when the assistant turn is not
    closed by a stop id (no delta can follow a sampled stop)."""
    if self._reference is None:
      ref = self.tokenizer.chat_ids(list(_REF_CONVERSATION), add_generation_prompt=False)
      stops = set(self.tokenizer.stop_ids) | ({self.tokenizer.end_of_turn_id} - {None})
      hits = [i for i, x in enumerate(ref) if x in stops]
      if not hits or _REF_MARK in self.tokenizer.decode(ref[hits[-1]:]):
        raise ValueError(f"the chat template{_where(self.tokenizer)} closes an assistant turn with none of the stop "
                         f"ids {sorted(stops)}: environment messages cannot follow a sampled turn")
      self._reference = (ref, hits[-1] + 1)
    return self._reference

  def observation_ids(self, messages: str | Sequence[dict], turn_ended: bool = True) -> list[int]:
    """Ids appended to an episode after a policy turn for the environment's `messages` (a str = one user
    message, or user/tool message dicts).

    Chat: the template's delta: the reference conversation (ending with an assistant turn) plus `messages`,
    rendered with the generation prompt, after the reference's last stop id (template text after the
    end-of-turn token, e.g. ChatML's "\n", belongs to the delta: the sampler stops at the token). The
    reference must render as a prefix of that, else ValueError naming the template. `turn_ended=False` (the
    policy's turn was cut before a stop id) puts the end-of-turn id (EOS without one) first.
    Raw: each content's ids (`encode`, no special tokens) concatenated, nothing between them; `turn_ended`
    is ignored (raw text has no turn structure).
    """
    msgs = check_messages(messages, ("user", "tool"))
    tok = self.tokenizer
    if not self.chat:
      return [i for m in msgs for i in tok.encode(m["content"])]
    ref, start = self._delta_start()
    full = tok.chat_ids(list(_REF_CONVERSATION) + msgs, add_generation_prompt=True)
    if full[:len(ref)] != ref:
      raise ValueError(f"the chat template{_where(tok)} renders a conversation differently once messages follow "
                       "an assistant turn (the earlier turns' ids change), so environment messages cannot be "
                       "appended as a delta")
    delta = full[start:]
    return delta if turn_ended else [tok.end_of_turn_id if tok.end_of_turn_id is not None else tok.eos_id] + delta

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
