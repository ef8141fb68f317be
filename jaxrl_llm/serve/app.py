"""The OpenAI-compatible FastAPI app and the in-process uvicorn server that runs it.

Routes (served on 127.0.0.1 only):
  GET  /v1/models                    the one served model (`serve.model_name`)
  POST /v1/chat/completions          messages (+ tools) -> one choice: `message` (Hermes `<tool_call>` blocks as
                                     `tool_calls`, finish_reason "tool_calls"), `logprobs.content` when
                                     `logprobs` (with `top_logprobs` <= 20), and vLLM's `prompt_token_ids` (top
                                     level) and `choices[0].token_ids` when `return_token_ids`
  POST /v1/completions               a text prompt or token ids -> `text`, legacy `logprobs`, token ids as above
  POST /inference/v1/generate        verifiers' token-in route: `token_ids` + `sampling_params` ->
                                     `choices[0].token_ids`, `choices[0].logprobs.content[*].logprob`,
                                     `finish_reason`, `prompt_token_ids`
  POST /v1/episodes/{id}/reward      {"reward": float}: ends the episode

Every completion call belongs to an episode: header `X-Episode-Id`, else the body's `user` field. μ must be the
training distribution, so a temperature / top_p / top_k other than the run's sampler settings, penalties or a
logit bias, streaming, stop strings, `n` > 1 and the `UNSERVED` fields (best_of, seed, min_tokens, ignore_eos,
stop_token_ids but on the token-in route, response_format and guided decoding, tool_choice other than "auto",
echo, suffix, continue_final_message) are refused with a 400 naming the field. Bad input gets an OpenAI-style
error `{"error": {"message", "type", "param", "code"}}` (400 malformed or refused, 404 unknown model, episode or
route, 405 a wrong method, 409 an ended episode, 408 one closed at its deadline) before anything is queued for the
sampler. The completion ids include the stop id the sampler drew (it is trained on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request  # the `serve` extra (route annotations are resolved from module globals)
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxrl_llm.serve import chat
from jaxrl_llm.serve.batcher import TOPK, Batcher, Completion
from jaxrl_llm.serve.recorder import Call, EpisodeEnded, EpisodeExpired, Recorder, UnknownEpisode
from jaxrl_llm.tasks.encoder import Encoder

_MISSING = object()


class ApiError(Exception):
  """An OpenAI-style error response."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
  """What a request may ask: the served model, the context and completion limits, and μ's sampler settings."""
  model_name: str
  max_context: int
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  vocab_size: int


@dataclasses.dataclass
class Endpoint:
  """What the routes use: the prompt encoder, the batcher, the recorder and the limits."""
  encoder: Encoder
  batcher: Batcher
  recorder: Recorder
  limits: Limits


# ---- request validation (never touches the sampler) ----

def _field(body: dict, name: str, types, default=_MISSING, *, where: str = ""):
  v = body.get(name, _MISSING)
  if v is _MISSING or (v is None and default is not _MISSING):
    if default is _MISSING:
      raise ApiError(400, f"missing required field '{where}{name}'", where + name, "missing_field")
    return default
  if not isinstance(v, types) or (isinstance(v, bool) and bool not in _tuple(types)):
    names = "/".join(t.__name__ for t in _tuple(types))
    raise ApiError(400, f"'{where}{name}' must be {names}, got {type(v).__name__}", where + name, "invalid_type")
  return v


def _tuple(types) -> tuple:
  return types if isinstance(types, tuple) else (types,)


def _number(body: dict, name: str, where: str = "") -> float | None:
  v = _field(body, name, (int, float), None, where=where)
  if v is not None and not math.isfinite(v):
    raise ApiError(400, f"'{where}{name}' must be finite", where + name, "invalid_value")
  return v


def _check_model(ep: Endpoint, body: dict, required: bool = True) -> None:
  model = _field(body, "model", str) if required else _field(body, "model", str, None)
  if model is not None and model != ep.limits.model_name:
    raise ApiError(404, f"The model '{model}' does not exist; this server serves '{ep.limits.model_name}'", "model",
                   "model_not_found")


# Request fields that would change μ (the distribution a completion is drawn from, which the record says it was drawn
# from) or what a completion is: refused with a 400 naming the field rather than ignored, so a harness never believes
# a setting took effect. Their neutral values pass. (name, whether a value is refused, why)
_MASKS_STOP = "it masks the stop ids, so μ would not be the distribution the completion was drawn from"
_CONSTRAINS = "constrained decoding changes μ: the recorded log-probs would not be the ones sampled from"
UNSERVED = (
    ("best_of", lambda v: v not in (None, 1), "it keeps the best of several samples, which is not a sample of μ"),
    ("seed", lambda v: v is not None, "the run draws every sampling key from its own seed (`seed` of the config)"),
    ("min_tokens", lambda v: v not in (None, 0), _MASKS_STOP),
    ("ignore_eos", bool, _MASKS_STOP),
    ("stop_token_ids", bool, "a completion ends at the policy's stop ids (a cut one would not be what μ sampled)"),
    ("response_format", lambda v: v not in (None, {"type": "text"}), _CONSTRAINS),
    ("tool_choice", lambda v: v not in (None, "auto"), _CONSTRAINS + " (only 'auto' is served)"),
    *((f, bool, _CONSTRAINS) for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                       "structured_outputs")),
    ("echo", bool, "the response holds the completion only"),
    ("suffix", bool, "insertion is not served; a completion continues the prompt"),
    ("continue_final_message", bool, "the prompt always ends with the template's generation prompt"),
)


def _unserved(body: dict, where: str, allow: tuple[str, ...] = ()) -> None:
  for name, refused, why in UNSERVED:
    if name in body and name not in allow and refused(body[name]):
      raise ApiError(400, f"{where}{name}={body[name]!r} is not served: {why}", where + name, "unsupported_value")


def _sampling(ep: Endpoint, body: dict, where: str = "", allow: tuple[str, ...] = ()) -> int:
  """Checks the sampling fields against μ's settings (and refuses the `UNSERVED` ones but `allow`); returns
  max_tokens."""
  lim = ep.limits
  _unserved(body, where, allow)
  t = _number(body, "temperature", where)
  if t is not None and abs(t - lim.temperature) > 1e-6:
    raise ApiError(400, f"temperature={t} is not served: completions are sampled at the run's sampler temperature "
                   f"{lim.temperature} (their log-probs are the training distribution μ); omit it or pass "
                   f"{lim.temperature}", where + "temperature", "unsupported_value")
  p = _number(body, "top_p", where)
  if p is not None and abs(p - lim.top_p) > 1e-6:
    raise ApiError(400, f"top_p={p} is not served: the run samples with top_p={lim.top_p} (μ is the training "
                   "distribution)", where + "top_p", "unsupported_value")
  k = _field(body, "top_k", int, None, where=where)
  if k is not None and not (k == lim.top_k or (k in (-1, 0) and lim.top_k == 0)):
    raise ApiError(400, f"top_k={k} is not served: the run samples with top_k={lim.top_k}", where + "top_k",
                   "unsupported_value")
  for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
    v = _number(body, name, where)
    if v is not None and v != neutral:
      raise ApiError(400, f"{name}={v} is not served: it would change μ, the training distribution (leave it at "
                     f"{neutral})", where + name, "unsupported_value")
  if body.get("logit_bias"):
    raise ApiError(400, "logit_bias is not served: it would change μ, the training distribution", where + "logit_bias",
                   "unsupported_value")
  n = _field(body, "n", int, 1, where=where)
  if n != 1:
    raise ApiError(400, f"n={n}: this server returns one choice per request (send n requests)", where + "n",
                   "unsupported_value")
  if _field(body, "stream", bool, False, where=where):
    raise ApiError(400, "stream=true is not supported", where + "stream", "unsupported_value")
  stop = body.get("stop")
  if stop:
    raise ApiError(400, "stop strings are not supported: a completion ends at the policy's stop ids (a cut "
                   "completion would not be what μ sampled)", where + "stop", "unsupported_value")
  name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  mt = _field(body, name, int, None, where=where)
  if mt is None:
    return lim.max_tokens
  if not 1 <= mt <= lim.max_tokens:
    raise ApiError(400, f"{where}{name}={mt} must be in [1, {lim.max_tokens}] (serve.max_tokens)", where + name,
                   "invalid_value")
  return mt


def _id_param(header: str | None) -> str:
  """Where the episode id came from, for an error about it: the header, else the body's `user`."""
  return "X-Episode-Id" if header else "user"


def _episode_id(body: dict, header: str | None) -> str:
  if header:
    return header
  user = _field(body, "user", str, None)
  if not user:
    raise ApiError(400, "no episode id: send the header X-Episode-Id or the 'user' field", "user", "missing_episode")
  return user


def _check_context(ep: Endpoint, n_prompt: int, max_tokens: int) -> None:
  lim = ep.limits
  if n_prompt < 1:
    raise ApiError(400, "the prompt is empty", "prompt", "invalid_value")
  if n_prompt + max_tokens > lim.max_context:
    raise ApiError(400, f"This model's maximum context length is {lim.max_context} tokens (serve.max_context); the "
                   f"prompt has {n_prompt} tokens and max_tokens is {max_tokens}", "messages",
                   "context_length_exceeded")


def _token_ids(ep: Endpoint, v: Any, param: str) -> list[int]:
  if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
    raise ApiError(400, f"'{param}' must be a list of token ids (ints)", param, "invalid_type")
  bad = [t for t in v if not 0 <= t < ep.limits.vocab_size]
  if bad:
    raise ApiError(400, f"'{param}' holds ids outside the vocabulary [0, {ep.limits.vocab_size}): {bad[:5]}", param,
                   "invalid_value")
  return list(v)


def _messages(body: dict) -> list[dict]:
  msgs = _field(body, "messages", list)
  if not msgs:
    raise ApiError(400, "'messages' must not be empty", "messages", "invalid_value")
  for i, m in enumerate(msgs):
    if not isinstance(m, dict) or m.get("role") not in chat.ROLES:
      raise ApiError(400, f"messages[{i}] must be an object with a 'role' in {chat.ROLES}", f"messages[{i}].role",
                     "invalid_value")
    c = m.get("content")
    if c is not None and not isinstance(c, str):
      if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
        m["content"] = "".join(str(p.get("text", "")) for p in c)  # text parts only
      else:
        raise ApiError(400, f"messages[{i}].content must be a string or text parts", f"messages[{i}].content",
                       "invalid_type")
    if c is None and not m.get("tool_calls"):
      m["content"] = ""
    if m.get("tool_calls") is not None and not (
        isinstance(m["tool_calls"], list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                  for t in m["tool_calls"])):
      raise ApiError(400, f"messages[{i}].tool_calls must be a list of {{'function': {{...}}}} objects",
                     f"messages[{i}].tool_calls", "invalid_type")
  return msgs


def _tools(body: dict) -> list[dict] | None:
  tools = _field(body, "tools", list, None)
  if tools is None:
    return None
  for i, t in enumerate(tools):
    if not isinstance(t, dict) or not isinstance(t.get("function"), dict) or not isinstance(
        t["function"].get("name"), str):
      raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                     f"tools[{i}]", "invalid_type")
  return tools or None


# ---- serving ----

async def _complete(ep: Endpoint, episode_id: str, prompt: list[int], max_tokens: int, top: int,
                    id_param: str = "X-Episode-Id") -> Completion:
  """Queues the call for the batcher and waits for its completion (the episode is checked first; an error about it
  names `id_param`, where the id came from)."""
  try:
    ep.recorder.get(episode_id)
  except UnknownEpisode:
    raise ApiError(404, f"unknown episode {episode_id!r}", id_param, "episode_not_found") from None
  except EpisodeEnded as e:
    raise _ended(e, id_param) from None
  try:
    return await asyncio.wrap_future(ep.batcher.submit(prompt, max_tokens, top))
  except Exception as e:  # pylint: disable=broad-except  # the sampler failed or the server is stopping
    raise ApiError(500 if not isinstance(e, RuntimeError) else 503, f"the sampler failed: {type(e).__name__}: "
                   f"{str(e)[:300]}", None, "sampler_error", "server_error") from None


def _record(ep: Endpoint, episode_id: str, prompt: list[int], c: Completion, turn=None, **event) -> None:
  try:
    call = Call(prompt, c.ids, c.logprobs, c.version, turn, c.records, c.routes)
    ep.recorder.record(episode_id, call, finish=c.finish_reason, **event)
  except (UnknownEpisode, EpisodeEnded) as e:  # ended while sampling: the call is answered, not recorded
    del e


def _token_text(ep: Endpoint, t: int) -> str:
  return ep.encoder.tokenizer.decode([t])


def _chat_logprobs(ep: Endpoint, c: Completion, as_ids: bool) -> dict:
  name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: _token_text(ep, t))
  entry = lambda t, lp: {"token": name(t), "logprob": lp, "bytes": list(name(t).encode())}
  return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, x) for i, x in (c.top[n] if c.top else [])]}
                      for n, (t, lp) in enumerate(zip(c.ids, c.logprobs))]}


def _ended(e: EpisodeEnded, param: str | None) -> ApiError:
  """A call or reward for an episode that is over: 409 when its reward was reported, 408 when it overran
  `serve.timeout_s` and was closed."""
  if isinstance(e, EpisodeExpired):
    return ApiError(408, str(e), param, "episode_timed_out")
  return ApiError(409, str(e), param, "episode_ended")


def _tool_results(messages: list[dict]) -> int:
  """Tool messages after the conversation's last assistant message: the tool results this call carries (timeline)."""
  n = 0
  for m in reversed(messages):
    if m["role"] == "assistant":
      break
    n += m["role"] == "tool"
  return n


def _usage(n_prompt: int, n_completion: int) -> dict:
  return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


async def chat_completions(ep: Endpoint, body: dict, episode_header: str | None) -> dict:
  _check_model(ep, body)
  max_tokens = _sampling(ep, body)
  messages, tools = _messages(body), _tools(body)
  want_lp = _field(body, "logprobs", bool, False)
  top = _field(body, "top_logprobs", int, 0)
  if not 0 <= top <= TOPK or (top and not want_lp):
    raise ApiError(400, f"top_logprobs must be in [0, {TOPK}] and needs logprobs=true", "top_logprobs",
                   "invalid_value")
  episode_id = _episode_id(body, episode_header)
  try:
    history = ep.recorder.history(episode_id)
  except UnknownEpisode:
    raise ApiError(404, f"unknown episode {episode_id!r}", _id_param(episode_header),
                   "episode_not_found") from None
  except EpisodeEnded as e:
    raise _ended(e, _id_param(episode_header)) from None
  bad = chat.conversation_error(messages)
  if bad is not None:  # the episode's calls no longer form a conversation: it is dropped (`serve_invalid`)
    ep.recorder.invalidate(episode_id, bad)
    raise ApiError(400, bad, "messages", "invalid_conversation")
  try:
    prompt, extended = chat.prompt_ids(ep.encoder, messages, tools, history)
  except ValueError as e:  # a template that cannot render these messages / tools
    raise ApiError(400, f"the messages cannot be rendered: {str(e)[:300]}", "messages", "invalid_value") from None
  _check_context(ep, len(prompt), max_tokens)
  c = await _complete(ep, episode_id, prompt, max_tokens, top, _id_param(episode_header))
  text = ep.encoder.tokenizer.decode(_without_stop(ep, c.ids))
  message, called = chat.assistant_message(text, tools)
  _record(ep, episode_id, prompt, c, chat.served_turn(messages, message, prompt, c.ids, c.finish_reason == "stop"),
          route="chat", extended=extended, tool_results=_tool_results(messages),
          tool_calls=len(message.get("tool_calls") or []))
  choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if called else c.finish_reason,
            "logprobs": _chat_logprobs(ep, c, bool(body.get("return_tokens_as_token_ids"))) if want_lp else None}
  resp = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
          "model": ep.limits.model_name, "choices": [choice], "usage": _usage(len(prompt), len(c.ids)),
          "system_fingerprint": f"version-{c.version}"}
  if _field(body, "return_token_ids", bool, False):
    resp["prompt_token_ids"], choice["token_ids"] = prompt, c.ids
  return resp


def _without_stop(ep: Endpoint, ids: list[int]) -> list[int]:
  stops = set(ep.encoder.tokenizer.stop_ids)
  return ids[:-1] if ids and ids[-1] in stops else ids


async def completions(ep: Endpoint, body: dict, episode_header: str | None) -> dict:
  _check_model(ep, body)
  max_tokens = _sampling(ep, body)
  p = _field(body, "prompt", (str, list))
  if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
    p = p[0]  # a batch of one
  if isinstance(p, str):
    prompt = ep.encoder.tokenizer.encode(p, add_special_tokens=True)
  else:
    prompt = _token_ids(ep, p, "prompt")
  lp_n = _field(body, "logprobs", int, None)
  if lp_n is not None and not 0 <= lp_n <= 5:
    raise ApiError(400, "logprobs must be in [0, 5]", "logprobs", "invalid_value")
  episode_id = _episode_id(body, episode_header)
  _check_context(ep, len(prompt), max_tokens)
  c = await _complete(ep, episode_id, prompt, max_tokens, lp_n or 0, _id_param(episode_header))
  _record(ep, episode_id, prompt, c, route="completions")
  choice = {"index": 0, "text": ep.encoder.tokenizer.decode(_without_stop(ep, c.ids)),
            "finish_reason": c.finish_reason, "logprobs": None}
  if lp_n is not None:
    toks = [_token_text(ep, t) for t in c.ids]
    choice["logprobs"] = {"tokens": toks, "token_logprobs": c.logprobs,
                          "top_logprobs": [{_token_text(ep, i): x for i, x in row} for row in c.top] if c.top else None,
                          "text_offset": [sum(len(s) for s in toks[:n]) for n in range(len(toks))]}
  resp = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
          "model": ep.limits.model_name, "choices": [choice], "usage": _usage(len(prompt), len(c.ids))}
  if _field(body, "return_token_ids", bool, False):
    resp["prompt_token_ids"], choice["token_ids"] = prompt, c.ids
  return resp


async def generate(ep: Endpoint, body: dict, episode_header: str | None) -> dict:
  """verifiers' token-in route (module docstring). `sampling_params.stop_token_ids` cut the completion after the
  first of them (what μ sampled up to there is unchanged)."""
  _check_model(ep, body, required=False)
  prompt = _token_ids(ep, _field(body, "token_ids", list), "token_ids")
  sp = _field(body, "sampling_params", dict, {})
  max_tokens = _sampling(ep, sp, where="sampling_params.", allow=("stop_token_ids",))  # honoured: the cut below
  stop_ids = _token_ids(ep, _field(sp, "stop_token_ids", list, [], where="sampling_params."),
                        "sampling_params.stop_token_ids")
  episode_id = _episode_id(body, episode_header)
  _check_context(ep, len(prompt), max_tokens)
  c = await _complete(ep, episode_id, prompt, max_tokens, 0, _id_param(episode_header))
  cut = next((n + 1 for n, t in enumerate(c.ids) if t in set(stop_ids)), None)
  if cut is not None and cut < len(c.ids):
    c = dataclasses.replace(c, ids=c.ids[:cut], logprobs=c.logprobs[:cut], finish_reason="stop")
  elif cut is not None:
    c = dataclasses.replace(c, finish_reason="stop")
  _record(ep, episode_id, prompt, c, route="generate")
  lp = {"content": [{"token": f"token_id:{t}", "logprob": x} for t, x in zip(c.ids, c.logprobs)]}
  return {"id": f"gen-{uuid.uuid4().hex}", "object": "generate", "created": int(time.time()),
          "model": ep.limits.model_name, "prompt_token_ids": prompt,
          "choices": [{"index": 0, "token_ids": c.ids, "logprobs": lp, "finish_reason": c.finish_reason}],
          "usage": _usage(len(prompt), len(c.ids))}


def report_reward(ep: Endpoint, episode_id: str, body: dict) -> dict:
  r = _number(body, "reward")
  if r is None:
    raise ApiError(400, "missing required field 'reward' (a finite number)", "reward", "missing_field")
  try:
    ep.recorder.reward(episode_id, float(r))
  except UnknownEpisode:
    raise ApiError(404, f"unknown episode {episode_id!r}", "episode_id", "episode_not_found") from None
  except EpisodeEnded as e:
    raise _ended(e, "episode_id") from None
  return {"episode_id": episode_id, "reward": float(r)}


def make_app(ep: Endpoint):
  """The FastAPI app of `ep` (routes in the module docstring)."""
  app = FastAPI(title="jaxrl_llm policy endpoint")

  @app.exception_handler(ApiError)
  async def _api_error(request, e: ApiError):
    del request
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, e: StarletteHTTPException):
    """An unknown route or a wrong method: OpenAI's error shape too (not FastAPI's `{"detail": ...}`)."""
    code = {404: "unknown_route", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    err = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", None, code)
    return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

  async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object", None, "invalid_type")
    return body

  @app.get("/v1/models")
  async def _models():
    return {"object": "list", "data": [{"id": ep.limits.model_name, "object": "model", "created": 0,
                                        "owned_by": "jaxrl_llm", "max_model_len": ep.limits.max_context}]}

  @app.post("/v1/chat/completions")
  async def _chat(request: Request):
    return await chat_completions(ep, await _body(request), request.headers.get("x-episode-id"))

  @app.post("/v1/completions")
  async def _completions(request: Request):
    return await completions(ep, await _body(request), request.headers.get("x-episode-id"))

  @app.post("/inference/v1/generate")
  async def _generate(request: Request):
    return await generate(ep, await _body(request), request.headers.get("x-episode-id"))

  @app.post("/v1/episodes/{episode_id}/reward")
  async def _reward(episode_id: str, request: Request):
    return report_reward(ep, episode_id, await _body(request))

  return app


class Server:
  """uvicorn serving `app` on 127.0.0.1 at a free port, in a thread of this process (`start` / `stop`)."""

  def __init__(self, app, host: str = "127.0.0.1"):
    import uvicorn  # noqa: PLC0415  (the `serve` extra)
    # The pure-Python event loop and HTTP parser (no uvloop / httptools): the server shares its process with
    # XLA compiling and running in other threads; a local endpoint does not need their speed.
    self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="off",
                                                 loop="asyncio", http="h11", ws="none"))
    self._thread: threading.Thread | None = None
    self.host = host
    self.port: int | None = None

  @property
  def base_url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self, timeout: float = 30.0) -> "Server":
    self._thread = threading.Thread(target=self._server.run, name="serve-http", daemon=True)
    self._thread.start()
    t0 = time.monotonic()
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() - t0 > timeout:
        raise RuntimeError("the endpoint's uvicorn server did not start")
      time.sleep(0.01)
    self.port = self._server.servers[0].sockets[0].getsockname()[1]
    return self

  def stop(self, timeout: float = 10.0) -> None:
    if self._thread is None:
      return
    self._server.should_exit = True
    self._thread.join(timeout)
    self._thread = None
