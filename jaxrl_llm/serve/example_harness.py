"""A scripted agent harness written with the official `openai` client, as a user's own harness would be: nothing in
it knows about jaxrl_llm beyond the base URL, the episode id (sent as the `X-Episode-Id` header) and the reward
route. configs/harness_tiny.py trains it (`serve.harness = "jaxrl_llm.serve.example_harness:run"`).

An episode: the question "what is a+b? use add." with the `add` tool; a tool-call turn (the model's `tool_calls`
are run and answered with `tool` messages; after a reply without one the harness fetches the tool's result itself,
as a scripted agent would, and passes it on in a user message) then an answer turn; the reward is 1 when the answer
holds a+b, else 0.
"""

from __future__ import annotations

import json
import random

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def add(a: int, b: int) -> int:
  return int(a) + int(b)


def _tool_result(call) -> str:
  try:
    return str(add(**json.loads(call.function.arguments)))
  except (TypeError, ValueError) as e:
    return f"error: {e}"


def run(base_url: str, episode_id: str, seed: int) -> float:
  """Plays one episode against the endpoint at `base_url`; reports and returns its reward."""
  import httpx  # noqa: PLC0415  (the `serve` extra)
  from openai import OpenAI  # noqa: PLC0415

  rng = random.Random(seed)
  a, b = rng.randint(0, 9), rng.randint(0, 9)
  client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                  default_headers={"X-Episode-Id": episode_id})
  model = client.models.list().data[0].id
  messages = [{"role": "user", "content": f"what is {a}+{b}? use add."}]
  first = client.chat.completions.create(model=model, messages=messages, tools=[ADD_TOOL], logprobs=True)
  reply = first.choices[0].message
  messages.append(reply.model_dump(exclude_none=True))
  if reply.tool_calls:
    messages += [{"role": "tool", "tool_call_id": c.id, "content": _tool_result(c)} for c in reply.tool_calls]
  else:  # the harness fetches the tool's answer itself and says so as the user: a `tool` message must answer a call
    messages.append({"role": "user", "content": f"add(a={a}, b={b}) returned {add(a, b)}. What is {a}+{b}?"})
  answer = client.chat.completions.create(model=model, messages=messages, tools=[ADD_TOOL], logprobs=True)
  reward = float(str(a + b) in (answer.choices[0].message.content or ""))
  httpx.post(f"{base_url}/v1/episodes/{episode_id}/reward", json={"reward": reward}, timeout=30).raise_for_status()
  client.close()
  return reward
