"""Chat messages to prompt ids and a completion to an OpenAI assistant message: the endpoint's text side.

A chat episode's ids are built the way `rollout.episodes` builds an environment's: the first call's messages
through `Encoder.episode_prompt_ids(messages, tools=)` (the chat template via `chat_ids(..., tools=)`, or the
Hermes tools block for templates that do not render tools; raw text for a tokenizer without a template); every
later call whose messages repeat an earlier call's messages plus the assistant message served for it, then only
user / tool messages, is that call's prompt + served completion ids (never re-encoded) + the template's delta for
the new messages (`Encoder.observation_ids`). A conversation the harness rewrote is rendered whole (`full_ids`).

Hermes `<tool_call>` blocks in a completion (`envs.tools.parse_tool_calls`) become `message.tool_calls`; the text
before the first block is the content (None when empty), as vLLM's hermes parser answers.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Sequence

from jaxrl_llm.envs.tools import MalformedToolCall, parse_tool_calls
from jaxrl_llm.tasks.encoder import Encoder, hermes_tools_text

ROLES = ("system", "user", "assistant", "tool")


def canonical(message: dict) -> tuple:
  """What identifies a message in a conversation: role, content text, tool calls as (name, arguments) pairs
  (arguments parsed when they are a JSON string). Ids and other fields the client adds are ignored."""
  calls = []
  for c in message.get("tool_calls") or ():
    fn = c.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
      try:
        args = json.loads(args)
      except json.JSONDecodeError:
        pass
    calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
  return (message.get("role"), message.get("content") or "", tuple(calls))


def conversation_error(messages: Sequence[dict]) -> str | None:
  """Why `messages` is not a valid conversation (OpenAI's rules for tool turns), or None: a `tool` message answers
  a tool call of the assistant message before it (its `tool_call_id`, when given, one of that message's call ids),
  and an assistant message's tool calls are all answered before the next user, system or assistant message."""
  pending: dict | None = None  # the open tool block: {"at": index, "ids": unanswered ids (None: unnamed calls)}
  for i, m in enumerate(messages):
    role = m["role"]
    if role == "tool":
      if pending is None:
        return f"messages[{i}] is a 'tool' message that answers no assistant message's tool_calls"
      tid = m.get("tool_call_id")
      if pending["ids"] is not None and tid is not None:
        if tid not in pending["ids"]:
          return f"messages[{i}].tool_call_id={tid!r} answers no open tool call of messages[{pending['at']}]"
        pending["ids"].discard(tid)
      continue
    if pending is not None and pending["ids"]:
      return (f"messages[{pending['at']}]'s tool calls {sorted(pending['ids'])} are not all answered before "
              f"messages[{i}]")
    pending = None
    if role == "assistant" and m.get("tool_calls"):
      ids = [t.get("id") for t in m["tool_calls"]]
      pending = {"at": i, "ids": set(ids) if all(isinstance(x, str) for x in ids) else None}
  if pending is not None and pending["ids"] and len(messages) - 1 == pending["at"]:
    return f"messages[{pending['at']}]'s tool calls are not answered (the conversation ends with them)"
  return None


@dataclasses.dataclass(frozen=True)
class Turn:
  """An earlier call of the episode as the next call may extend it: its messages plus the served assistant
  message (canonical), the ids of its prompt + completion, and whether the completion ended with a stop id."""
  key: tuple
  ids: tuple
  ended: bool


def prompt_ids(encoder: Encoder, messages: Sequence[dict], tools: Sequence[dict] | None,
               history: Sequence[Turn]) -> tuple[list[int], bool]:
  """(ids, extended): the prompt of a chat call; `extended` when it continues an earlier call of `history`
  (module docstring), else the whole conversation rendered (`full_ids`)."""
  canon = tuple(canonical(m) for m in messages)
  for turn in reversed(history):
    n = len(turn.key)
    rest = messages[n:]
    if canon[:n] == turn.key and rest and all(m["role"] in ("user", "tool") for m in rest):
      obs = [{"role": m["role"], "content": m.get("content") or ""} for m in rest]
      return list(turn.ids) + encoder.observation_ids(obs, turn_ended=turn.ended), True
  return full_ids(encoder, messages, tools), False


def full_ids(encoder: Encoder, messages: Sequence[dict], tools: Sequence[dict] | None) -> list[int]:
  """A conversation rendered whole with the generation prompt: system/user messages only through
  `Encoder.episode_prompt_ids`; otherwise the chat template over every message (assistant tool calls as the
  template expects them, tools as a Hermes system block when it does not render them), or for raw text every
  message's text (assistant tool calls written back as Hermes blocks) joined by newlines."""
  if all(m["role"] in ("system", "user") for m in messages):
    return encoder.episode_prompt_ids([{"role": m["role"], "content": m.get("content") or ""} for m in messages],
                                      tools=list(tools) if tools else None)
  if not encoder.chat:
    texts = ([hermes_tools_text(tools)] if tools else []) + [_text(m) for m in messages]
    return encoder.prompt_ids("\n".join(texts))
  msgs = [_template_message(m) for m in messages]
  if msgs[0]["role"] != "system" and encoder.system_prompt:
    msgs.insert(0, {"role": "system", "content": encoder.system_prompt})
  if tools and not encoder.renders_tools:
    block = hermes_tools_text(tools)
    if msgs[0]["role"] == "system":
      msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + block}
    else:
      msgs.insert(0, {"role": "system", "content": block})
    tools = None
  return encoder.tokenizer.chat_ids(msgs, tools=list(tools) if tools else None, add_generation_prompt=True)


def _text(m: dict) -> str:
  calls = "".join(f'<tool_call>{json.dumps({"name": n, "arguments": json.loads(a)})}</tool_call>'
                  for n, a in canonical(m)[2])
  return (m.get("content") or "") + calls


def _template_message(m: dict) -> dict:
  out = {"role": m["role"], "content": m.get("content") or ""}
  if m.get("tool_calls"):
    out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                         for n, a in canonical(m)[2]]
  if m.get("tool_call_id"):
    out["tool_call_id"] = m["tool_call_id"]
  return out


def assistant_message(text: str, tools: Sequence[dict] | None) -> tuple[dict, bool]:
  """(message, has_tool_calls): the OpenAI assistant message of a completion's text. With `tools` in the request,
  well-formed Hermes blocks naming one of them become `tool_calls` (ids `call_<hex>`, arguments as a JSON string);
  a malformed block stays text."""
  calls = []
  if tools and "<tool_call>" in text:
    names = [t.get("function", {}).get("name") for t in tools]
    try:
      calls = parse_tool_calls(text, names)
    except MalformedToolCall:
      calls = []
  if not calls:
    return {"role": "assistant", "content": text}, False
  content = text[:text.index("<tool_call>")].strip() or None
  return {"role": "assistant", "content": content,
          "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]}, True


def served_turn(messages: Sequence[dict], message: dict, prompt: Sequence[int], completion: Sequence[int],
                ended: bool) -> Turn:
  """The `Turn` a later call may extend: the request's messages plus the served assistant message."""
  return Turn(tuple(canonical(m) for m in messages) + (canonical(message),), tuple(prompt) + tuple(completion), ended)

