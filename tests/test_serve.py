"""The OpenAI-compatible endpoint (`jaxrl_llm.serve`) and the harness source: the official `openai` client against a
scripted sampler (tool calls, recorded ids = served ids), 8 concurrent episodes in one sampler batch with the tiny
model, verifiers' token-in route, bad input that never reaches the sampler, the episode row layout, and a 2-step
harness run through the loop."""

import json
import os
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from jaxrl_llm import config as config_lib  # noqa: E402
from jaxrl_llm import wiring  # noqa: E402
from jaxrl_llm.config import ConfigError, load_file  # noqa: E402
from jaxrl_llm.models import init_params  # noqa: E402
from jaxrl_llm.rollout.async_engine import worker_params  # noqa: E402
from jaxrl_llm.rollout.param_store import ParamStore  # noqa: E402
from jaxrl_llm.rollout.sources import harness as harness_source  # noqa: E402
from jaxrl_llm.rollout.settings import ServeSettings  # noqa: E402
from jaxrl_llm.sampling import SamplerConfig  # noqa: E402
from jaxrl_llm.serve import example_harness  # noqa: E402
from jaxrl_llm.serve.recorder import Call, episode_row, extends  # noqa: E402
from jaxrl_llm.serve.service import Service  # noqa: E402
from jaxrl_llm.tasks.encoder import Encoder  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG = 120  # seconds: a hang guard only, never a timing assumption


class ScriptedSampler:
  """A `SampleFn` that answers each context with the next scripted completion (ids) and log-probs -0.1·(i+1);
  counts its calls (bad input must never reach it)."""

  def __init__(self, script):
    self.script, self.calls, self.contexts = list(script), 0, []

  def __call__(self, params, version, contexts, key, top_logprobs=0):
    del params, version, key, top_logprobs
    self.calls += 1
    self.contexts += [list(c) for c in contexts]
    outs = [self.script.pop(0) for _ in contexts]
    M = max(len(o) for o in outs)
    tokens = np.zeros((len(outs), M), np.int32)
    logp = np.zeros((len(outs), M), np.float32)
    for i, o in enumerate(outs):
      tokens[i, :len(o)] = o
      logp[i, :len(o)] = -0.1 * (np.arange(len(o)) + 1)
    return {"tokens_BN": tokens, "lengths_B": np.asarray([len(o) for o in outs], np.int32), "behavior_logp_BN": logp}


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
  import tiny_hf
  from jaxrl_llm.models.tokenizer import load_checkpoint_tokenizer
  return load_checkpoint_tokenizer(tiny_hf.make_tokenizer(tmp_path_factory.mktemp("tok")))


def fake_gen(tokenizer, temperature=1.0):
  return types.SimpleNamespace(encoder=Encoder(tokenizer, "auto"), key_root=jax.random.key(0),
                               sampler_cfg=SamplerConfig(max_new_tokens=8, stop_ids=tokenizer.stop_ids,
                                                         pad_id=tokenizer.pad_id, temperature=temperature))


def stub_service(tokenizer, script=(), auto_open=True, **over):
  store = ParamStore(keep_last=1)
  store.publish({"w": jnp.zeros(2)})
  s = ServeSettings(**{"harness": "x:y", "max_context": 1024, "prompt_width": 768, "max_tokens": 128, **over})
  sampler = ScriptedSampler(script)
  return Service.start(fake_gen(tokenizer), store, s, auto_open=auto_open, sample_fn=sampler), sampler


# ---- the openai client: a tool-call turn and an answer turn ----

def test_openai_client_tool_call_episode_records_the_served_ids(chat_tok):
  tok = chat_tok
  end = tok.end_of_turn_id
  call_text = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
  script = [tok.encode(call_text) + [end], tok.encode("7") + [end]]
  svc, sampler = stub_service(tok, script)
  try:
    client = openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", max_retries=0, timeout=HANG)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "what is 3+4? use add."}]
    served = []
    for turn in range(2):
      r = client.chat.completions.create(model=model, messages=msgs, tools=[example_harness.ADD_TOOL], logprobs=True,
                                         user="ep-1", extra_body={"return_token_ids": True})
      ch = r.choices[0]
      served.append((r.prompt_token_ids, ch.token_ids, [x.logprob for x in ch.logprobs.content]))
      msgs.append(ch.message.model_dump(exclude_none=True))
      if turn == 0:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        tc = ch.message.tool_calls[0]
        assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 3, "b": 4}
        msgs.append({"role": "tool", "tool_call_id": tc.id, "content": example_harness._tool_result(tc)})
      else:
        assert ch.finish_reason == "stop" and ch.message.content == "7" and not ch.message.tool_calls
    httpx.post(f"{svc.base_url}/v1/episodes/ep-1/reward", json={"reward": 1.0}, timeout=HANG).raise_for_status()
    ep = svc.recorder.pop("ep-1")
  finally:
    svc.close()
  assert ep.reward == 1.0 and len(ep.calls) == 2 and sampler.calls == 2
  for call, (prompt, ids, logp) in zip(ep.calls, served):
    assert call.prompt_ids == prompt and call.completion_ids == ids
    np.testing.assert_allclose(call.logprobs, logp, rtol=0, atol=1e-6)
    np.testing.assert_allclose(logp, -0.1 * (np.arange(len(ids)) + 1), rtol=0, atol=1e-6)  # the sampler's μ
  assert ep.calls[0].completion_ids == script[0] and ep.calls[1].completion_ids == script[1]
  # the episode's timeline: its calls in order (the tool call served, then the tool result carried), its reward
  ev = ep.events
  assert [e["event"] for e in ev] == ["call", "call", "reward"] and all(a["t"] <= b["t"] for a, b in zip(ev, ev[1:]))
  assert ev[0] | {"t": 0} == {"t": 0, "event": "call", "route": "chat", "version": 0, "extended": False,
                              "prompt_tokens": len(served[0][0]), "completion_tokens": len(script[0]),
                              "finish": "stop", "tool_calls": 1, "tool_results": 0}
  assert (ev[1]["extended"], ev[1]["tool_calls"], ev[1]["tool_results"]) == (True, 0, 1) and ev[2]["reward"] == 1.0
  # turn 1: the chat template's first prompt; turn 2: turn 1's ids + served ids + the tool message's delta
  first = tok.chat_ids([{"role": "system", "content": _tools_block()}, msgs[0]], add_generation_prompt=True)
  assert ep.calls[0].prompt_ids == first
  delta = tok.encode("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
  assert ep.calls[1].prompt_ids == first + script[0] + delta
  assert sampler.contexts == [ep.calls[0].prompt_ids, ep.calls[1].prompt_ids]
  # the episode's row: mask exactly on the served completion tokens, μ there, the rest the harness's (mask 0)
  P, N = 640, 256
  row = episode_row(ep.calls, P, N, tok.pad_id)
  assert not row["split"]
  resp = row["sequence_T"][P:]
  n1, n2 = len(script[0]), len(script[1])
  want_mask = np.zeros(N)
  want_mask[:n1] = 1
  want_mask[n1 + len(delta):n1 + len(delta) + n2] = 1
  np.testing.assert_array_equal(row["mask_N"], want_mask)
  np.testing.assert_array_equal(resp[row["mask_N"] > 0], script[0] + script[1])
  np.testing.assert_allclose(row["behavior_logp_N"][row["mask_N"] > 0], served[0][2] + served[1][2], atol=1e-6)
  np.testing.assert_array_equal(row["env_mask_N"][:n1 + len(delta) + n2], 1 - want_mask[:n1 + len(delta) + n2])
  assert list(row["sequence_T"][P - len(first):P]) == first and row["segment_ids_T"][P - len(first) - 1] == 0


@pytest.mark.parametrize("calls_tool", [True, False])
def test_example_harness_plays_a_valid_episode_with_or_without_a_tool_call(chat_tok, calls_tool):
  """configs/harness_tiny.py's harness: a model that calls `add` gets a `tool` answer; one that does not (an untrained
  model, nearly always) gets the result in a user message, which the endpoint accepts, and the episode is scored."""
  import random
  tok, end, seed = chat_tok, chat_tok.end_of_turn_id, 5
  rng = random.Random(seed)
  a, b = rng.randint(0, 9), rng.randint(0, 9)
  first = (f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>' if calls_tool
           else "let me see")
  svc, sampler = stub_service(tok, [tok.encode(first) + [end], tok.encode(str(a + b)) + [end]])
  try:
    reward = example_harness.run(svc.base_url, "ep-h", seed)
    ep = svc.recorder.pop("ep-h")
  finally:
    svc.close()
  assert reward == 1.0 and ep.reward == 1.0 and ep.invalid is None and len(ep.calls) == 2 and sampler.calls == 2
  said = tok.decode(sampler.contexts[1])
  assert (f"returned {a + b}" in said) != calls_tool and str(a + b) in said


def _call(call_id):
  return {"id": call_id, "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


def _tools_block():
  from jaxrl_llm.tasks.encoder import hermes_tools_text
  return hermes_tools_text([example_harness.ADD_TOOL])


# ---- verifiers' token-in route and token-id completions ----

def test_generate_route_with_verifiers_request_shape(chat_tok):
  tok = chat_tok
  end = tok.end_of_turn_id
  a, b = tok.encode("12"), tok.encode("34")
  svc, sampler = stub_service(tok, [a + [end] + b, b + [end]])
  prompt = tok.chat_ids([{"role": "user", "content": "hi"}])
  try:
    body = {"model": "jaxrl-policy", "token_ids": prompt,
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "logprobs": 1,
                                "stop_token_ids": [end], "skip_special_tokens": False}}
    r = httpx.post(f"{svc.base_url}/inference/v1/generate", json=body, headers={"X-Episode-Id": "v1"}, timeout=HANG)
    assert r.status_code == 200, r.text
    out = r.json()
    ch = out["choices"][0]
    assert out["prompt_token_ids"] == prompt
    assert ch["token_ids"] == a + [end] and ch["finish_reason"] == "stop"  # cut after the first stop_token_id
    want = [-0.1 * (i + 1) for i in range(len(a) + 1)]
    assert [x["logprob"] for x in ch["logprobs"]["content"]] == pytest.approx(want)
    # /v1/completions with token ids extends the same episode
    p2 = prompt + ch["token_ids"] + tok.encode("ok")
    r2 = httpx.post(f"{svc.base_url}/v1/completions", json={"model": "jaxrl-policy", "prompt": p2, "logprobs": 0,
                                                              "return_token_ids": True, "user": "v1"}, timeout=HANG)
    assert r2.status_code == 200, r2.text
    c2 = r2.json()["choices"][0]
    assert c2["token_ids"] == b + [end] and c2["text"] == "34" and c2["finish_reason"] == "stop"
    assert c2["logprobs"]["token_logprobs"] == pytest.approx([-0.1 * (i + 1) for i in range(len(b) + 1)])
    ep = svc.recorder.pop("v1")
  finally:
    svc.close()
  assert [c.prompt_ids for c in ep.calls] == [prompt, p2] and extends(ep.calls)
  assert ep.calls[0].completion_ids == a + [end] and ep.calls[1].completion_ids == b + [end]


# ---- bad input: OpenAI-style errors, the sampler never called ----

_CHAT = {"model": "jaxrl-policy", "messages": [{"role": "user", "content": "hi"}], "user": "e"}


@pytest.mark.parametrize("path,body,headers,status,match", [
    ("/v1/chat/completions", b"{not json", {}, 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", {}, 400, "JSON object"),
    ("/v1/chat/completions", {"model": "jaxrl-policy", "user": "e"}, {}, 400, "messages"),
    ("/v1/chat/completions", {**_CHAT, "messages": "hi"}, {}, 400, "messages"),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "robot", "content": "x"}]}, {}, 400, "role"),
    ("/v1/chat/completions", {**_CHAT, "temperature": 0.5}, {}, 400, "sampler temperature"),
    ("/v1/chat/completions", {**_CHAT, "temperature": "hot"}, {}, 400, "temperature"),
    ("/v1/chat/completions", {**_CHAT, "n": 2}, {}, 400, "one choice"),
    ("/v1/chat/completions", {**_CHAT, "presence_penalty": 0.5}, {}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**_CHAT, "stream": True}, {}, 400, "stream"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 1000}, {}, 400, "serve.max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "model": "gpt-4"}, {}, 404, "does not exist"),
    ("/v1/chat/completions", {k: v for k, v in _CHAT.items() if k != "user"}, {}, 400, "X-Episode-Id"),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "user", "content": "word " * 1200}]}, {}, 400,
     "serve.max_context"),
    ("/v1/completions", {"model": "jaxrl-policy", "prompt": [1, 2, 10**6], "user": "e"}, {}, 400, "vocabulary"),
    ("/v1/completions", {"model": "jaxrl-policy", "prompt": 5, "user": "e"}, {}, 400, "prompt"),
    ("/inference/v1/generate", {"token_ids": "abc", "sampling_params": {}}, {"X-Episode-Id": "e"}, 400, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"temperature": 0.0}}, {"X-Episode-Id": "e"},
     400, "temperature"),
    ("/v1/episodes/nope/reward", {"reward": 1.0}, {}, 404, "unknown episode"),
    ("/v1/episodes/nope/reward", {"reward": "high"}, {}, 400, "reward"),
])
def test_bad_input_is_refused_before_the_sampler(chat_tok, path, body, headers, status, match):
  svc, sampler = stub_service(chat_tok, auto_open=True)
  try:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(svc.base_url + path, headers={"content-type": "application/json", **headers}, timeout=HANG, **kw)
  finally:
    svc.close()
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and match in err["message"], err
  assert sampler.calls == 0


def test_every_setting_that_would_change_mu_is_refused_naming_it(chat_tok):
  """Issue 48: fields that change the sampling distribution (or what a completion is) get a 400 naming the field,
  never a silent 200; their neutral values pass; errors about the episode name where its id came from; unknown
  routes and wrong methods answer in OpenAI's error shape too."""
  tok = chat_tok
  end = [tok.end_of_turn_id]
  svc, sampler = stub_service(tok, [tok.encode("1") + end] * 4, auto_open=True)
  refused = [("best_of", 2), ("seed", 7), ("min_tokens", 3), ("ignore_eos", True), ("stop_token_ids", [5]),
             ("response_format", {"type": "json_object"}), ("tool_choice", "required"),
             ("tool_choice", {"type": "function", "function": {"name": "add"}}), ("guided_regex", "[0-9]+"),
             ("echo", True), ("suffix", "x"), ("continue_final_message", True)]
  post = lambda path, body, **kw: httpx.post(svc.base_url + path, json=body, timeout=HANG, **kw)
  comp = {"model": "jaxrl-policy", "prompt": "hi", "user": "c"}
  try:
    for field, value in refused:
      for path, base in (("/v1/chat/completions", _CHAT), ("/v1/completions", comp)):
        r = post(path, {**base, field: value})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and "not served" in err["message"], (field, r.text)
    r = post("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"min_tokens": 2}},
             headers={"X-Episode-Id": "g"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.min_tokens", r.text
    assert sampler.calls == 0
    neutral = {"best_of": 1, "seed": None, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [],
               "response_format": {"type": "text"}, "tool_choice": "auto", "echo": False, "suffix": None}
    assert post("/v1/chat/completions", {**_CHAT, **neutral}).status_code == 200
    assert sampler.calls == 1
    r = post("/v1/chat/completions", {**_CHAT, "max_completion_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    for route, method in (("/v1/nope", "POST"), ("/v1/chat/completions", "GET")):
      r = httpx.request(method, svc.base_url + route, timeout=HANG)
      err = r.json()["error"]
      assert r.status_code in (404, 405) and set(err) == {"message", "type", "param", "code"}, r.text
  finally:
    svc.close()


def test_unknown_and_ended_episodes(chat_tok):
  tok = chat_tok
  svc, sampler = stub_service(tok, [tok.encode("1") + [tok.end_of_turn_id]], auto_open=False)
  try:
    post = lambda user: httpx.post(svc.base_url + "/v1/chat/completions", json={**_CHAT, "user": user}, timeout=HANG)
    r = post("stray")
    assert r.status_code == 404 and r.json()["error"]["code"] == "episode_not_found"
    assert r.json()["error"]["param"] == "user"  # where the id came from (the header's name only when it is used)
    svc.recorder.open("mine")
    assert post("mine").status_code == 200
    assert httpx.post(svc.base_url + "/v1/episodes/mine/reward", json={"reward": 0.5}, timeout=HANG).status_code == 200
    r = post("mine")
    assert r.status_code == 409 and "ended" in r.json()["error"]["message"]
  finally:
    svc.close()
  assert sampler.calls == 1


@pytest.mark.parametrize("messages,error", [
    ([{"role": "tool", "content": "7"}], "messages[0] is a 'tool' message that answers no assistant"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "7"}],
     "messages[2] is a 'tool' message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("c1"), _call("c2")]},
      {"role": "tool", "tool_call_id": "c1", "content": "7"}, {"role": "user", "content": "and?"}],
     "messages[1]'s tool calls ['c2'] are not all answered before messages[3]"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("c1")]},
      {"role": "tool", "tool_call_id": "zz", "content": "7"}],
     "messages[2].tool_call_id='zz' answers no open tool call of messages[1]"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("c1")]}],
     "the conversation ends with them"),
])
def test_a_call_that_is_no_valid_conversation_is_refused_and_its_episode_dropped(chat_tok, messages, error):
  """Issue 48: OpenAI's tool-turn rules (`chat.conversation_error`); the call gets a 400 naming what is wrong, the
  episode is marked invalid (its timeline says why) and `group_from_episodes` drops it as `invalid`."""
  svc, sampler = stub_service(chat_tok, [chat_tok.encode("1") + [chat_tok.end_of_turn_id]])
  try:
    ok = httpx.post(svc.base_url + "/v1/chat/completions", json={**_CHAT, "user": "e"}, timeout=HANG)
    r = httpx.post(svc.base_url + "/v1/chat/completions", json={**_CHAT, "messages": messages, "user": "e"},
                   timeout=HANG)
    httpx.post(svc.base_url + "/v1/episodes/e/reward", json={"reward": 1.0}, timeout=HANG).raise_for_status()
    ep = svc.recorder.pop("e")
  finally:
    svc.close()
  assert ok.status_code == 200 and sampler.calls == 1
  assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_conversation", r.text
  assert error in r.json()["error"]["message"] and ep.invalid == r.json()["error"]["message"]
  assert [e["event"] for e in ep.events] == ["call", "invalid", "reward"]
  status = [None]
  group = harness_source.group_from_episodes([ep], status, P=32, N=32, pad_id=0, version=0)
  assert status == ["invalid"] and group.stats["serve_invalid"] == 1 and group.mask_BN.sum() == 0
  assert group.stats["timeline"][0]["status"] == "invalid"


def test_valid_tool_conversations_pass():
  from jaxrl_llm.serve import chat
  user, tool = {"role": "user", "content": "q"}, lambda i: {"role": "tool", "tool_call_id": i, "content": "7"}
  assert chat.conversation_error([user]) is None
  assert chat.conversation_error([user, {"role": "assistant", "tool_calls": [_call("a"), _call("b")]}, tool("b"),
                                  tool("a"), {"role": "assistant", "content": "14"}, user]) is None
  unnamed = {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]}
  assert chat.conversation_error([user, unnamed, {"role": "tool", "content": "7"}]) is None  # ids not given


def test_a_failing_sampler_is_an_openai_error_and_the_server_goes_on(chat_tok):
  svc, sampler = stub_service(chat_tok, script=[])  # the scripted sampler raises IndexError on its first call
  try:
    r = httpx.post(svc.base_url + "/v1/chat/completions", json=_CHAT, timeout=HANG)
    assert r.status_code == 500 and r.json()["error"]["code"] == "sampler_error", r.text
    assert httpx.get(svc.base_url + "/v1/models", timeout=HANG).json()["data"][0]["id"] == "jaxrl-policy"
  finally:
    svc.close()
  assert sampler.calls == 1


# ---- the row layout (golden values by hand) ----

def test_episode_row_extended_and_split():
  c1 = Call([1, 2, 3], [10, 11], [-1.0, -2.0], version=4)
  c2 = Call([1, 2, 3, 10, 11, 7], [12], [-3.0], version=5)
  row = episode_row([c1, c2], P=4, N=6, pad_id=0)
  assert not row["split"]
  np.testing.assert_array_equal(row["sequence_T"], [0, 1, 2, 3, 10, 11, 7, 12, 0, 0])
  np.testing.assert_array_equal(row["positions_T"], [0, 0, 1, 2, 3, 4, 5, 6, 0, 0])
  np.testing.assert_array_equal(row["segment_ids_T"], [0, 1, 1, 1, 1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(row["mask_N"], [1, 1, 0, 1, 0, 0])
  np.testing.assert_array_equal(row["env_mask_N"], [0, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(row["behavior_logp_N"], [-1, -2, 0, -3, 0, 0])
  np.testing.assert_array_equal(row["versions_N"][:4], [4, 4, 4, 5])
  # the harness rewrote its history: one packed segment per call, positions restarting
  c3 = Call([1, 9], [12], [-3.0], version=5)
  row = episode_row([c1, c3], P=4, N=6, pad_id=0)
  assert row["split"]
  np.testing.assert_array_equal(row["sequence_T"], [0, 1, 2, 3, 10, 11, 1, 9, 12, 0])
  np.testing.assert_array_equal(row["positions_T"], [0, 0, 1, 2, 3, 4, 0, 1, 2, 0])
  np.testing.assert_array_equal(row["segment_ids_T"], [0, 1, 1, 1, 1, 1, 2, 2, 2, 0])
  np.testing.assert_array_equal(row["mask_N"], [1, 1, 0, 0, 1, 0])
  with pytest.raises(ValueError, match="serve.max_context"):
    episode_row([c1, c3], P=4, N=4, pad_id=0)


def test_episode_row_places_records_and_routes():
  """μ's records land on each call's completion columns (pad / 0 elsewhere); routes by position, the later call's
  where two calls fed a token, experts 0..k-1 where none did. Golden arrays written by hand."""
  rec = lambda ids, lp: {"behavior_topk_ids_BNk": np.asarray(ids, np.int32)[:, None],
                         "behavior_topk_logp_BNk": np.asarray(lp, np.float32)[:, None]}
  route = lambda vals: np.asarray(vals, np.int32).reshape(-1, 1, 1)  # L = k = 1
  c1 = Call([1, 2, 3], [10, 11], [-1.0, -2.0], version=4, records=rec([10, 5], [-1.0, -0.5]),
            routes=route([1, 1, 1, 1, 1]))
  c2 = Call([1, 2, 3, 10, 11, 7], [12], [-3.0], version=5, records=rec([12], [-0.1]),
            routes=route([2, 2, 2, 2, 2, 2, 2]))
  row = episode_row([c1, c2], P=4, N=6, pad_id=0)
  np.testing.assert_array_equal(row["behavior_topk_ids_BNk"][:, 0], [10, 5, 0, 12, 0, 0])
  np.testing.assert_array_equal(row["behavior_topk_logp_BNk"][:, 0], np.float32([-1.0, -0.5, 0, -0.1, 0, 0]))
  # columns: pad, the prompt 1 2 3, then 10 11 7 12 (fed by c2, the later call), then 2 unfed columns
  np.testing.assert_array_equal(row["routes_TLk"][:, 0, 0], [0, 2, 2, 2, 2, 2, 2, 2, 0, 0])
  # split: each segment keeps its own call's routes
  c3 = Call([1, 9], [12], [-3.0], version=5, records=rec([12], [-0.2]), routes=route([3, 3, 3]))
  row = episode_row([c1, c3], P=4, N=6, pad_id=0)
  np.testing.assert_array_equal(row["routes_TLk"][:, 0, 0], [0, 1, 1, 1, 1, 1, 3, 3, 3, 0])
  np.testing.assert_array_equal(row["behavior_topk_ids_BNk"][:, 0], [10, 5, 0, 0, 12, 0])
  # a call without routes (or records): the row has none
  assert "routes_TLk" not in episode_row([c1, Call([1, 9], [12], [-3.0], version=5)], P=4, N=6, pad_id=0)


def test_harness_group_carries_every_field_on_failed_rows_too():
  """`group_from_episodes` with `row_extras`: a failed episode's row holds the fills, so the group carries routes,
  μ's records and the window of every row and joining groups drops none of them."""
  import types as t
  gen = t.SimpleNamespace(sampler_cfg=SamplerConfig(max_new_tokens=4, behavior_topk=1, mc_samples=2, pad_id=0),
                          keep_routes=True, model_cfg=t.SimpleNamespace(n_layers=1, experts_per_token=1))
  extras = harness_source.row_extras(gen, 4, 6)
  assert set(extras) == {"behavior_topk_ids_BNk", "behavior_topk_logp_BNk", "mc_ids_BNJ", "mc_behavior_logp_BNJ",
                         "routes_TLk"}
  mc = {"mc_ids_BNJ": np.asarray([[10, 3], [11, 11]], np.int32), "mc_behavior_logp_BNJ": np.zeros((2, 2), np.float32)}
  c1 = Call([1, 2, 3], [10, 11], [-1.0, -2.0], version=4,
            records={"behavior_topk_ids_BNk": np.asarray([[10], [5]], np.int32),
                     "behavior_topk_logp_BNk": np.zeros((2, 1), np.float32), **mc},
            routes=np.ones((5, 1, 1), np.int32))
  ok = t.SimpleNamespace(calls=[c1], reward=1.0, invalid=None, id="a", events=[])
  g = harness_source.group_from_episodes([ok, None], [None, "errors"], 4, 6, 0, 4, extras, (1, 2))
  np.testing.assert_array_equal(g.routes_BTLk[:, :, 0, 0], [[0, 1, 1, 1, 1, 1, 0, 0, 0, 0], [0] * 10])
  np.testing.assert_array_equal(g.mc_ids_BNJ[:, :2], [[[10, 3], [11, 11]], [[0, 0], [0, 0]]])
  np.testing.assert_array_equal(g.kv_window_B2, [[1, 2], [1, 2]])
  assert g.behavior_topk_ids_BNk.shape == (2, 6, 1) and list(g.mask_BN[1]) == [0] * 6


# ---- the tiny model: 8 concurrent episodes, and the run ----

def short_harness(base_url: str, episode_id: str, seed: int) -> None:
  """Two turns with the `openai` client (short prompts for the char tokenizer); g3 episodes raise."""
  if "-g3-" in episode_id:
    raise RuntimeError("this harness fails")
  client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=HANG,
                         default_headers={"X-Episode-Id": episode_id})
  msgs = [{"role": "user", "content": f"add {seed % 10} and 2."}]
  r = client.chat.completions.create(model="jaxrl-policy", messages=msgs, logprobs=True,
                                     extra_body={"return_token_ids": True})
  msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "so?"}]
  r2 = client.chat.completions.create(model="jaxrl-policy", messages=msgs, logprobs=True,
                                      extra_body={"return_token_ids": True})
  SERVED.setdefault(episode_id, []).extend(
      (x.prompt_token_ids, x.choices[0].token_ids, [t.logprob for t in x.choices[0].logprobs.content]) for x in (r, r2))
  reward = float(any(ch in (r2.choices[0].message.content or "") for ch in "0123456789"))
  httpx.post(f"{base_url}/v1/episodes/{episode_id}/reward", json={"reward": reward}, timeout=HANG).raise_for_status()


SERVED: dict = {}


def harness_config(**serve):
  c = load_file(os.path.join(ROOT, "configs", "harness_tiny.py"))
  c.log.tensorboard, c.log.progress, c.checkpoint.every = False, False, 0
  c.serve.harness = f"{__name__}:short_harness"
  c.serve.max_context, c.serve.prompt_width, c.serve.max_tokens = 48, 24, 6
  for k, v in serve.items():
    c.serve[k] = v
  return c


def test_eight_concurrent_episodes_share_a_batch():
  c = harness_config()
  r = wiring.setup(c)
  store = ParamStore(keep_last=1)
  store.publish(init_params(r.sampler_model_cfg, jax.random.key(0)))
  s = r.ctx.settings.serve
  sample_fn = harness_source.make_sample_fn(r.ctx.gen, s.max_context, s.max_tokens, s.max_batch)
  svc = Service.start(r.ctx.gen, store, s, sample_fn=sample_fn, params_of=worker_params, auto_open=True)
  ids = [f"c{i}-g0-x" for i in range(8)]
  SERVED.clear()
  try:
    svc.batcher.hold()
    threads = [threading.Thread(target=short_harness, args=(svc.base_url, e, i)) for i, e in enumerate(ids)]
    for t in threads:
      t.start()
    t0 = time.monotonic()
    while svc.batcher.pending() < 8:  # every episode's first call is queued: the first sampler call takes all 8
      assert time.monotonic() - t0 < HANG, "the 8 first calls never arrived"
      time.sleep(0.01)
    svc.batcher.resume()
    for t in threads:
      t.join(HANG)
    episodes = [svc.recorder.pop(e) for e in ids]
    stats = svc.batcher.stats()
    # top_logprobs as OpenAI: μ's most likely tokens, best first, the sampled token's log-prob among them or below
    r = httpx.post(svc.base_url + "/v1/chat/completions", timeout=HANG, json={
        "model": "jaxrl-policy", "messages": [{"role": "user", "content": "hi"}], "user": "top", "logprobs": True,
        "top_logprobs": 3, "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(r.json()["choices"][0]["token_ids"]) >= 1
    for tok in content:
      tops = [t["logprob"] for t in tok["top_logprobs"]]
      assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tok["logprob"] <= tops[0] + 1e-6
      assert tok["token"].startswith("token_id:")
  finally:
    svc.close()
  assert svc.batcher.sizes[0] == 8 and stats["serve_batch_max"] == 8 and stats["serve_calls"] == 16
  for e, ep in zip(ids, episodes):
    assert ep.reward is not None and extends(ep.calls)
    for call, (prompt, got, logp) in zip(ep.calls, SERVED[e]):
      assert call.prompt_ids == prompt and call.completion_ids == got
      np.testing.assert_allclose(call.logprobs, logp, atol=1e-6)
    row = episode_row(ep.calls, 24, 24, 0)
    served_ids = [t for _, got, _ in SERVED[e] for t in got]
    np.testing.assert_array_equal(row["sequence_T"][24:][row["mask_N"] > 0], served_ids)


@pytest.mark.parametrize("slots, drafter", [(0, False), (4, False), (0, True)], ids=["static", "slots", "drafter"])
def test_harness_run_trains_two_steps(tmp_path, slots, drafter):
  """The 2-step harness run as a user starts it (`python -m jaxrl_llm`, its own process: a server, harness threads
  and XLA compiles share it, as in a real run, not a test worker's accumulated state); with `rollout.slots` the
  endpoint's calls decode through the slot engine."""
  import subprocess
  import sys
  wd = tmp_path / "run"
  c = harness_config()
  over = {"serve.harness": "test_serve:short_harness", "serve.max_context": c.serve.max_context,
          "serve.prompt_width": c.serve.prompt_width, "serve.max_tokens": c.serve.max_tokens,
          "log.tensorboard": False, "log.progress": False, "checkpoint.every": 0, "rollout.slots": slots}
  if drafter:  # the endpoint's calls speculate with the distilled drafter, distilled after every learner step
    over.update({"model.n_layers": 2, "sampler.spec_gamma": 2, "sampler.spec_draft_layers": 1,
                 "sampler.spec_drafter": "distilled"})
  cmd = [sys.executable, "-m", "jaxrl_llm", f"--config={os.path.join(ROOT, 'configs', 'harness_tiny.py')}",
         f"--workdir={wd}"] + [f"--config.{k}={v}" for k, v in over.items()]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH")) if p)}
  p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1]
  need = {"step", "version", "lag_mean", "lag_max", "reward_mean", "loss", "serve_batch_mean", "serve_batch_max",
          "serve_failed", "serve_episodes", "serve_slot_resumes"}
  for r in rows:
    assert need <= set(r), need - set(r)
    assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"])
    assert r["lag_max"] <= c.rollout.lag
    # one of the 4 episodes of each of the 2 groups raises: it costs that episode only
    assert r["serve_episodes"] == 8 and r["serve_failed"] == r["serve_errors"] == 2
    assert r["mismatch_abs_max"] < 1e-5  # π_old recomputed at each token's version equals the served μ
  assert sum(r["updates_applied"] for r in rows) >= 1
  # timeline.jsonl: each consumed episode's events in order, with the step that consumed it
  timeline = [json.loads(line) for line in (wd / "timeline.jsonl").read_text().splitlines()]
  assert sorted(e["step"] for e in timeline) == [0] * 8 + [1] * 8
  assert sum(e["status"] == "errors" for e in timeline) == 4 and {e["status"] for e in timeline} == {"ok", "errors"}
  for e in timeline:
    kinds = [x["event"] for x in e["events"]]
    assert kinds == (["call", "call", "reward"] if e["status"] == "ok" else []), e  # g3 raises before calling
    assert all(a["t"] <= b["t"] for a, b in zip(e["events"], e["events"][1:])), e
  if drafter:
    assert all(r["spec_drafter_kl"] > 0 for r in rows)
  # how many second calls find their first call's slot still parked depends on the order calls arrive in
  assert all(r["serve_slot_resumes"] >= 0 for r in rows) and (slots or not any(r["serve_slot_resumes"] for r in rows))


def test_harness_tiny_as_shipped_trains_on_its_episodes(tmp_path):
  """configs/harness_tiny.py with its own harness (jaxrl_llm/serve/example_harness.py) for one step: every episode's
  two calls fit the endpoint's widths and its learner row, no episode fails, and the step trains on them."""
  import subprocess
  import sys
  wd = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl_llm", f"--config={os.path.join(ROOT, 'configs', 'harness_tiny.py')}",
         f"--workdir={wd}", "--config.num_steps=1", "--config.log.tensorboard=False", "--config.log.progress=False",
         "--config.checkpoint.every=0"]
  p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                     timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  (r,) = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
  assert r["serve_episodes"] == 8 and r["serve_failed"] == 0 and r["serve_calls"] == 16, r
  assert r["updates_applied"] == 1 and r["completion_len"] > 8 and np.isfinite(r["loss"])


def test_failed_harness_costs_its_episode_only(chat_tok):
  """`play` + `group_from_episodes`: a harness that raises, one still running at the timeout, one that never reports
  a reward, and a good one; the failed rows keep no tokens and take the good episodes' mean reward."""
  from jaxrl_llm.serve.recorder import Recorder
  rec, release = Recorder(auto_open=False), threading.Event()
  ids = ["ok", "raises", "hangs", "silent"]
  for e in ids:
    rec.open(e)

  def harness(base_url, episode_id, seed):
    del base_url
    if episode_id == "raises":
      raise ValueError("boom")
    if episode_id == "hangs":
      release.wait(HANG)
      return
    rec.record(episode_id, Call([5, 6], [7, 8], [-0.5, -0.25], version=seed))
    if episode_id == "ok":
      rec.reward(episode_id, 0.75)

  status = harness_source.play(harness, "http://unused", ids, seed=3, timeout_s=2.0)
  release.set()
  assert status == [None, "errors", "timeouts", None]
  group = harness_source.group_from_episodes([rec.pop(e) for e in ids], status, P=4, N=4, pad_id=0, version=2)
  assert status == [None, "errors", "timeouts", "no_reward"]
  np.testing.assert_array_equal(group.reward_B, [0.75] * 4)
  np.testing.assert_array_equal(group.mask_BN, [[1, 1, 0, 0]] + [[0] * 4] * 3)
  np.testing.assert_array_equal(group.sequence_BT[0], [0, 0, 5, 6, 7, 8, 0, 0])
  np.testing.assert_array_equal(group.segment_ids_BT[1:], 0)
  assert group.stats["serve_failed"] == 3 and group.stats["serve_errors"] == 1
  assert group.stats["serve_timeouts"] == 1 and group.stats["serve_no_reward"] == 1
  np.testing.assert_array_equal(group.versions_BN, [[3] * 4] + [[2] * 4] * 3)  # the call's, else the admitted one


def test_an_episode_past_its_deadline_is_closed_and_its_late_calls_get_408(chat_tok):
  """Issue 48: `serve.timeout_s` is a deadline per episode: the overrunning episode is a timeout, closed as expired,
  so a late call or reward for it gets a 408 (an episode that merely never reported a reward is unknown: 404)."""
  svc, sampler = stub_service(chat_tok, script=[], auto_open=False)
  release = threading.Event()

  def harness(base_url, episode_id, seed):
    del base_url, seed
    if "-g1-" in episode_id:
      release.wait(HANG)

  try:
    gen = types.SimpleNamespace(seed=0, encoder=Encoder(chat_tok, "auto"), sampler_cfg=SamplerConfig(max_new_tokens=8))
    s = ServeSettings(harness="x:y", timeout_s=1.0, max_context=64, prompt_width=32)
    rollout = harness_source.make_harness_rollout(gen, svc, harness, s, group_size=2)
    group = rollout(types.SimpleNamespace(version=0), 0)
    release.set()
    late, silent = [e["episode"] for e in sorted(group.stats["timeline"], key=lambda e: e["episode"])[::-1]]
    assert [e["status"] for e in group.stats["timeline"]] == ["no_reward", "timeouts"]
    r = httpx.post(svc.base_url + "/v1/chat/completions", json={**_CHAT, "user": late}, timeout=HANG)
    assert r.status_code == 408 and r.json()["error"]["code"] == "episode_timed_out", r.text
    r = httpx.post(f"{svc.base_url}/v1/episodes/{late}/reward", json={"reward": 1.0}, timeout=HANG)
    assert r.status_code == 408 and r.json()["error"]["param"] == "episode_id"
    r = httpx.post(svc.base_url + "/v1/chat/completions", json={**_CHAT, "user": silent}, timeout=HANG)
    assert r.status_code == 404
  finally:
    release.set()
    svc.close()
  assert sampler.calls == 0


def test_harness_source_state_is_the_request_cursor():
  ctx = types.SimpleNamespace(settings=types.SimpleNamespace(serve=ServeSettings(harness=f"{__name__}:short_harness")))
  src = harness_source.Harness(ctx, store=None)
  assert src.state() == {"next_request_id": 0}
  src.restore({"next_request_id": 7})
  assert src.state() == {"next_request_id": 7}
  with pytest.raises(ValueError, match="no callable"):
    harness_source.load_harness(f"{__name__}:nope")


@pytest.mark.parametrize("field,value", [("harness", "no_colon"), ("max_batch", 0), ("timeout_s", 0.0),
                                         ("max_tokens", 48), ("prompt_width", 48), ("harness_kwargs", None),
                                         ("harness_kwargs", {"fn": object()})])
def test_serve_validation_names_the_field(field, value):
  c = harness_config()
  c.serve[field] = value
  with pytest.raises(ConfigError, match=f"config.serve.{field}="):
    config_lib.validate(c)


def test_speculating_sampler_answers_top_logprobs():
  """With speculative decoding on, a call that asks for top log-probs speculates too and records μ's top-k at every
  token (the verify step's records): the sampled token's log-prob among them is its μ."""
  import dataclasses
  import jax
  from jaxrl_llm.rollout.sources.harness import make_sample_fn
  from test_episodes import PARAMS, make_gen
  g = make_gen(0.8)
  g = dataclasses.replace(g, sampler_cfg=dataclasses.replace(g.sampler_cfg, spec_gamma=2, spec_draft_layers=1))
  sample = make_sample_fn(g, 16, 4, 4)
  ctx = [[1, 5, 6], [1, 7]]
  plain = sample(PARAMS, 0, ctx, jax.random.key(0), 0)
  top = sample(PARAMS, 0, ctx, jax.random.key(0), 3)
  assert "behavior_topk_ids_BNk" not in plain and top["behavior_topk_ids_BNk"].shape[:2] == top["tokens_BN"].shape
  import numpy as np
  hit = top["behavior_topk_ids_BNk"] == top["tokens_BN"][..., None]
  live = np.arange(top["tokens_BN"].shape[1])[None, :] < top["lengths_B"][:, None]
  assert (hit.any(-1) & live).sum() >= 2
  np.testing.assert_allclose(np.where(hit, top["behavior_topk_logp_BNk"], 0).sum(-1)[hit.any(-1) & live],
                             top["behavior_logp_BN"][hit.any(-1) & live], atol=1e-5)


def test_slot_sampler_continues_a_conversation_from_its_parked_slot():
  """With slots the endpoint's sampler keeps a finished request's keys/values in its slot: a conversation's next call
  (its last call's context and reply, then a tool's answer) continues that slot, in whichever row of the call it
  comes, and draws what a sampler that prefills every call draws (same keys); a call whose context shares less than
  half its prefix with every parked slot prefills."""
  import dataclasses
  import jax
  import numpy as np
  from jaxrl_llm.rollout import turn_sampler
  from jaxrl_llm.rollout.sources.harness import make_sample_fn
  from test_episodes import PARAMS, make_gen
  g = dataclasses.replace(make_gen(0.8), slots=4, slot_chunk=2)
  sample = make_sample_fn(g, 24, 4, 4)
  plain = turn_sampler.SlotTurns(g, 24, 4, 2)
  base = dataclasses.replace(g.sampler_cfg, max_new_tokens=4, group_size=1, behavior_topk=0, mc_samples=0)
  ctx = [[1, 5, 6, 7], [1, 8, 9]]
  calls = [ctx]
  for t in range(3):
    key = jax.random.key(t)
    got = sample(PARAMS, 0, calls[-1], key)
    want = plain.turn(PARAMS, 0, list(range(len(calls[-1]))), calls[-1], key, base)
    np.testing.assert_array_equal(got["tokens_BN"], want["tokens_BN"][:len(calls[-1])])
    np.testing.assert_allclose(got["behavior_logp_BN"], want["behavior_logp_BN"][:len(calls[-1])], atol=2e-5)
    # the next call: the conversations in the other order (rows are not conversations), each extended by its
    # reply and a tool's answer; and a new conversation
    replies = [list(c) + got["tokens_BN"][i, :got["lengths_B"][i]].tolist() + [20 + t] for i, c in enumerate(calls[-1])]
    calls.append(replies[::-1][:2] + ([[1, 30 + t, 31 + t, 32 + t]] if t < 2 else []))
  # calls 2 and 3 continue both conversations they carry on; the new ones (sharing only the first id) prefill
  assert sample.turns.resumed == 4 and plain.resumed == 0
