"""Multi-turn episodes (`rollout.episodes`) and the environment registry (`envs`), with numbers.

A random tiny model on the character vocabulary plays test environments registered here; the
record is checked against the sampler's own turn outputs, the encoded observations and the learner's
recomputed log-probs.
"""

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import envs, losses
from jaxrl_llm.models import ModelConfig, init_params, token_logprobs
from jaxrl_llm.rollout.episodes import EnvSettings, render_env_message, run_episodes
from jaxrl_llm.rollout.generation import Generation
from jaxrl_llm.sampling import SamplerConfig
from jaxrl_llm.tasks import tokenizer as char_tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder
from jaxrl_llm.tasks.tokenizer import CHAR_TOKENIZER, completion_text
from jaxrl_llm.types import LossInputs

CFG = ModelConfig(vocab_size=char_tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_seq_len=128, dtype="float32")
P = 8


@functools.partial(jax.jit, static_argnums=(0,))
def random_params(cfg):
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 4.0 * x
  return jax.tree_util.tree_map_with_path(scale, init_params(cfg, jax.random.key(0)))


PARAMS = random_params(CFG)


@envs.register("test_echo")
class Echo:
  """Accepts any action; observes "<" or "<<" (by the action's length), reward = 0.25 per step; never done."""

  def __init__(self, max_turns: int = 3):
    self.max_turns = max_turns

  def reset(self, seed):
    return "go" + str(seed % 10)

  def step(self, action):
    return ("<" * (1 + len(action) % 2)), 0.25, False


@envs.register("test_faulty")
class Faulty:
  """Row behaviour chosen by the seed: 0 fine, 1 raises at step, 2 hangs at step, 3 rejects the action, 4 raises at reset."""

  def __init__(self, hang_s: float = 3.0):
    self.hang_s = hang_s

  def reset(self, seed):
    if seed == 4:
      raise RuntimeError("no reset")
    self.mode = seed
    return "x"

  def step(self, action):
    if self.mode == 1:
      raise RuntimeError("boom")
    if self.mode == 2:
      time.sleep(self.hang_s)
    if self.mode == 3:
      raise envs.InvalidAction(action)
    return "=", 1.0, True


@envs.register("test_countdown")
class Countdown:
  """Done after seed % 3 + 1 steps (reward 1 at the end); observes "." meanwhile."""

  def reset(self, seed):
    self.left = seed % 3 + 1
    return "c"

  def step(self, action):
    self.left -= 1
    return (".", 0.0, False) if self.left else ("=", 1.0, True)


def make_gen(temperature=1.0):
  samp = SamplerConfig(max_new_tokens=4, stop_ids=(char_tok.eos_id,), temperature=temperature, pad_id=char_tok.pad_id)
  return Generation(task=None, train_examples=None, width=P, model_cfg=CFG, sampler_cfg=samp,
                    key_root=jax.random.key(1), seed=0, encoder=CHAR_ENCODER)


@functools.partial(jax.jit, static_argnames=("temperature",))
def learner_logp(params, seq, pos, seg, temperature):
  logp = token_logprobs(params, seq[:, :-1], seq[:, 1:], CFG, positions_BT=pos[:, :-1], segment_ids_BT=seg[:, :-1],
                        temperature=temperature, chunk_size=16)["logp_BT"]
  return logp[:, P - 1:]


@pytest.fixture(scope="module")
def echo_record():
  s = EnvSettings(name="test_echo", max_turns=3, turn_tokens=4, max_episode_tokens=20, timeout_s=5.0)
  return run_episodes(make_gen(0.7), PARAMS, [3, 7], 3, s, jax.random.key(5), version=2, keep_turns=True), s


def test_guess_number_env():
  e = envs.get("guess_number", max_turns=3)
  first = e.reset(123)
  secret = e.secret
  assert first == "guess:" and envs.get("guess_number").reset(123) == first
  e2 = envs.get("guess_number")
  e2.reset(123)
  assert e2.secret == secret  # deterministic in the seed
  wrong = (secret + 1) % 10
  obs, r, done = e.step(str(wrong))
  assert obs == ("<" if secret < wrong else ">") and r == 0.0 and not done
  assert e.step(f" {secret}\n") == ("=", 1.0, True)
  with pytest.raises(envs.InvalidAction):
    e.step("ab")
  strict = envs.get("guess_number", strict=True)
  strict.reset(123)
  with pytest.raises(envs.InvalidAction):
    strict.step("12")
  lenient = envs.get("guess_number")
  lenient.reset(123)
  assert lenient.step(f"a{secret}9") == ("=", 1.0, True)
  assert char_tok.decode(char_tok.encode("<>=guess:")) == "<>=guess:"
  with pytest.raises(ValueError, match="takes no argument 'turns'"):
    envs.get("guess_number", turns=2)
  with pytest.raises(ValueError, match="unknown environment"):
    envs.get("nope")


def test_record_layout_tokens_and_masks(echo_record):
  r, s = echo_record
  st = r.stats
  # each turn's step reward (Echo: 0.25 per step, never done): they sum to the return (turn-level credit's input)
  assert r.turn_reward_BK.shape == (6, s.max_turns)
  np.testing.assert_allclose(r.turn_reward_BK.sum(1), r.reward_B, rtol=1e-6)
  played = np.array([[(r.turn_BN[b] == k).any() for k in range(s.max_turns)] for b in range(6)])
  np.testing.assert_allclose(r.turn_reward_BK, np.where(played, 0.25, 0.0), rtol=1e-6)
  B, N = 6, s.max_episode_tokens
  assert r.sequence_BT.shape == (B, P + N) and r.mask_BN.shape == (B, N) and r.turn_BN.shape == (B, N)
  pol, env = r.mask_BN > 0, r.env_mask_BN > 0
  pad = ~pol & ~env
  assert not (pol & env).any()  # the masks partition the response
  resp = r.sequence_BT[:, P:]
  # padding only at the end, with pad id, segment 0, turn -1; real tokens segment 1
  used = (pol | env).sum(1)
  assert (pad == (np.arange(N)[None] >= used[:, None])).all()
  assert (resp[pad] == char_tok.pad_id).all() and (r.turn_BN[pad] == -1).all()
  assert (r.segment_ids_BT[:, P:] == (~pad)).all()
  assert (r.behavior_logp_BN[~pol] == 0).all() and (r.versions_BN == 2).all()
  # rebuild every episode from the sampler's turn outputs and the encoded observations (the echo is never done)
  outs = st["turn_outputs"]
  for b in range(B):
    expect, steps, status = [], 0, "max_turns"
    for t, o in enumerate(outs):
      assert o["live_B"][b] and o["start_B"][b] == len(expect)
      n_b = int(o["lengths_B"][b])
      toks = o["tokens_BN"][b, :n_b]
      k = min(n_b, N - len(expect))
      expect += [("p", int(x), t, float(lp)) for x, lp in zip(toks[:k], o["behavior_logp_BN"][b, :k])]
      if k < n_b:
        status = "truncated"
        break
      steps += 1
      action = char_tok.decode(toks[:-1] if toks[-1] == char_tok.eos_id else toks)
      ids = render_env_message(CHAR_ENCODER, "<" * (1 + len(action) % 2))
      assert ids == char_tok.encode("<" * (1 + len(action) % 2))
      if t == s.max_turns - 1:
        break
      if len(expect) + len(ids) >= N:
        status = "truncated"
        break
      expect += [("e", x, t, 0.0) for x in ids]
    assert st["episode_statuses"][b] == status
    assert used[b] == len(expect)
    got = [("p" if pol[b, j] else "e", int(resp[b, j]), int(r.turn_BN[b, j])) for j in range(used[b])]
    assert got == [e[:3] for e in expect], b
    np.testing.assert_array_equal(r.behavior_logp_BN[b, pol[b]], np.asarray([e[3] for e in expect if e[0] == "p"], np.float32))
    assert r.reward_B[b] == pytest.approx(0.25 * steps)
    # the prompt is the encoded reset text, left-padded
    first = CHAR_ENCODER.prompt_ids("go" + str([3, 7][b // 3] % 10))
    assert r.sequence_BT[b, P - len(first):P].tolist() == first
  counts = st["episode_status"]
  assert sum(counts.values()) == B and st["env_policy_tokens"] == pol.sum() and st["env_tokens"] == env.sum()
  assert (r.group_B == np.arange(B) // 3).all()


def test_behavior_logp_equals_learner_logp(echo_record):
  """The context of every turn is what the learner sees: recomputed log-probs equal μ's (fp32, same temperature)."""
  r, _ = echo_record
  lp = np.asarray(learner_logp(PARAMS, jnp.asarray(r.sequence_BT), jnp.asarray(r.positions_BT),
                               jnp.asarray(r.segment_ids_BT), 0.7))
  m = r.mask_BN > 0
  assert m.sum() > 10
  np.testing.assert_allclose(lp[m], r.behavior_logp_BN[m], atol=1e-5)


def test_environment_tokens_get_zero_gradient(echo_record):
  """d(summed ppo_clip loss)/d logp is exactly 0 where mask_BN is 0 (environment tokens and padding)."""
  r, _ = echo_record
  assert (r.env_mask_BN > 0).any()
  spec = losses.get("ppo_clip")
  hp = losses.make_hparams(spec)
  adv = jnp.asarray(np.random.default_rng(0).normal(size=r.mask_BN.shape), jnp.float32)
  rng_logp = jnp.asarray(r.behavior_logp_BN) + 0.1

  def total(logp):
    inp = LossInputs(logp_BN=logp, mask_BN=jnp.asarray(r.mask_BN), adv_BN=adv, prox_logp_BN=jnp.asarray(r.behavior_logp_BN),
                     behavior_logp_BN=jnp.asarray(r.behavior_logp_BN), turn_BN=jnp.asarray(r.turn_BN))
    loss_BN, _ = spec.fn(inp, hp)
    num, den = losses.reduce_parts(loss_BN, inp.mask_BN)
    return num / jnp.maximum(den, 1.0)

  g = np.asarray(jax.grad(total)(rng_logp))
  assert (g[r.mask_BN == 0] == 0).all()
  assert np.abs(g[r.mask_BN > 0]).sum() > 0


def test_faulty_environments_cost_one_episode_each():
  s = EnvSettings(name="test_faulty", kwargs=(("hang_s", 3.0),), max_turns=2, turn_tokens=3, max_episode_tokens=12,
                  timeout_s=0.5)
  t0 = time.perf_counter()
  r = run_episodes(make_gen(), PARAMS, [0, 1, 2, 3, 4], 2, s, jax.random.key(9), version=0)
  assert time.perf_counter() - t0 < 60
  st = r.stats
  assert st["episode_statuses"] == ("done",) * 2 + ("error",) * 2 + ("timeout",) * 2 + ("invalid",) * 2 + ("error",) * 2
  assert st["env_errors"] == 4 and st["env_timeouts"] == 2 and st["env_invalid"] == 2 and st["reward_errors"] == 8
  np.testing.assert_array_equal(r.reward_B, [1, 1, 0, 0, 0, 0, 0, 0, 0, 0])
  assert r.mask_BN.shape == (10, 12) and (r.mask_BN[:8].sum(1) > 0).all()  # those reset played their first turn
  assert (r.mask_BN[8:] == 0).all() and (r.segment_ids_BT[8:, P:] == 0).all()  # a failed reset plays nothing
  assert (r.env_mask_BN == 0).all()


def test_budget_truncates_and_guess_number_plays():
  s = EnvSettings(name="test_echo", max_turns=10, turn_tokens=4, max_episode_tokens=7)
  r = run_episodes(make_gen(), PARAMS, [1], 2, s, jax.random.key(3), version=0)
  assert r.stats["env_truncated"] == 2 and r.mask_BN.shape == (2, 7)
  # a first message longer than the prompt width: those episodes never start (counted); the batch forms
  r = run_episodes(make_gen(), PARAMS, [1], 2, s, jax.random.key(3), version=0, width=3)
  assert r.stats["episode_statuses"] == ("too_long",) * 2 and r.stats["env_too_long"] == 2
  assert r.mask_BN.sum() == 0 and r.reward_B.tolist() == [0.0, 0.0]
  np.testing.assert_array_equal(r.sequence_BT[:, :3], [[0, 0, char_tok.bos_id]] * 2)  # an empty first message
  g = EnvSettings(name="guess_number", kwargs=(("max_turns", 2),), max_turns=2, turn_tokens=2, max_episode_tokens=8)
  r = run_episodes(make_gen(), PARAMS, [5, 6], 2, g, jax.random.key(4), version=1)
  assert sum(r.stats["episode_status"].values()) == 4 and r.reward_B.shape == (4,)


def test_finished_episodes_stop_generating():
  """Episodes that end early leave the sampler batch; the rest play on with contexts the learner reproduces."""
  s = EnvSettings(name="test_countdown", max_turns=4, turn_tokens=3, max_episode_tokens=20)
  r = run_episodes(make_gen(), PARAMS, [0, 1, 2], 2, s, jax.random.key(11), version=0, keep_turns=True)
  assert r.stats["episode_statuses"] == ("done",) * 6
  want_turns = np.repeat([1, 2, 3], 2)
  np.testing.assert_array_equal(r.turn_BN.max(1) + 1, want_turns)
  np.testing.assert_array_equal(r.reward_B, np.ones(6))
  live = [o["live_B"].sum() for o in r.stats["turn_outputs"]]
  assert live == [6, 4, 2]
  lp = np.asarray(learner_logp(PARAMS, jnp.asarray(r.sequence_BT), jnp.asarray(r.positions_BT),
                               jnp.asarray(r.segment_ids_BT), 1.0))
  m = r.mask_BN > 0
  np.testing.assert_allclose(lp[m], r.behavior_logp_BN[m], atol=1e-5)
  # environment tokens: "." after every step but the last
  for b in range(6):
    env_ids = r.sequence_BT[b, P:][r.env_mask_BN[b] > 0].tolist()
    assert env_ids == char_tok.encode(".") * (want_turns[b] - 1)


# ----------------------------------------------------------------------------- messages, info, chat templates


@envs.register("test_messages")
class Messages:
  """Chat-style: a system + user start, tool messages and an `info` dict; reward 0.5 per step.
  Seed 5: reset returns a bad message list; seed 6: step returns a bad observation; seed 7: info is no dict."""

  def reset(self, seed):
    self.seed = seed
    if seed == 5:
      return [{"role": "assistant", "content": "not a start"}]
    return [{"role": "system", "content": "sys"}, {"role": "user", "content": f"go{seed}"}]

  def step(self, action):
    if self.seed == 6:
      return {"role": "tool", "content": "x"}, 0.0, False
    if self.seed == 7:
      return "x", 0.0, False, ["not", "a", "dict"]
    return [{"role": "tool", "content": str(len(action))}], 0.5, False, {"calls": 1, "chars": len(action), "tag": "t"}


@envs.register("test_messages_tools")
class MessagesWithTools(Messages):
  """`test_messages` with a `tools` attribute (schemas the runner hands the template)."""

  tools = [{"type": "function", "function": {"name": "f", "description": "F.", "parameters": {}}}]


@envs.register("test_declared")
class Declared:
  """Declares its step counters; every step raises on odd seeds, so a batch of odd seeds reports none."""
  counters = ("hits", "misses")

  def reset(self, seed):
    self.seed = seed
    return "d"

  def step(self, action):
    if self.seed % 2:
      raise RuntimeError("no step succeeds")
    return "", 0.0, True, {"hits": 1}


def test_declared_counters_are_in_every_batch_and_rows_cut_into_their_own_counters():
  """Issue 48: an environment's declared counters appear (0) in a batch where no step succeeded; `row_counters` of
  a cut (staged: one call, several learner steps) counts that cut's rows only."""
  from jaxrl_llm.rollout.episodes import row_counters
  s = EnvSettings(name="test_declared", max_turns=2, turn_tokens=3, max_episode_tokens=12)
  failed = run_episodes(make_gen(), PARAMS, [1, 3], 2, s, jax.random.key(2), version=0).stats
  assert failed["env_hits"] == 0 and failed["env_misses"] == 0 and failed["env_errors"] == 4
  r = run_episodes(make_gen(), PARAMS, [2, 1], 2, s, jax.random.key(2), version=0)
  st = r.stats
  assert (st["env_hits"], st["env_misses"], st["env_errors"], st["env_done"]) == (2, 0, 2, 2)
  cut = lambda lo, hi: row_counters(st["episode_statuses"][lo:hi], st["episode_turns"][lo:hi],  # noqa: E731
                                    r.mask_BN[lo:hi], r.env_mask_BN[lo:hi], r.versions_BN[lo:hi],
                                    st["episode_info"][lo:hi], ("hits", "misses"))
  first, second = cut(0, 2), cut(2, 4)
  assert (first["env_hits"], first["env_done"], first["env_errors"]) == (2, 2, 0)
  assert (second["env_hits"], second["env_done"], second["env_errors"], second["reward_errors"]) == (0, 0, 2, 2)
  for k in ("env_policy_tokens", "env_tokens", "env_turns", "env_episodes", "env_hits"):
    assert first[k] + second[k] == st[k], k


def test_message_results_info_and_malformed_results_are_errors():
  s = EnvSettings(name="test_messages", max_turns=2, turn_tokens=3, max_episode_tokens=24)
  r = run_episodes(make_gen(), PARAMS, [1, 5, 6, 7], 2, s, jax.random.key(2), version=0, keep_turns=True)
  st = r.stats
  assert st["episode_statuses"] == ("max_turns",) * 2 + ("error",) * 6
  np.testing.assert_array_equal(r.reward_B, [1.0, 1.0] + [0.0] * 6)
  # raw mode (character tokenizer): the messages' contents joined with "\n" (unk)
  first = [char_tok.bos_id] + char_tok.encode("sys") + [char_tok.unk_id] + char_tok.encode("go1")
  assert r.sequence_BT[0, :P].tolist() == first and r.sequence_BT[1, :P].tolist() == first
  assert st["env_calls"] == 4  # 2 rows x 2 steps, summed over the batch; "tag" (not a number) is dropped
  outs = st["turn_outputs"]
  assert st["env_chars"] == sum(len(completion_text(CHAR_TOKENIZER, o["tokens_BN"][b, :o["lengths_B"][b]]))
                                for o in outs for b in (0, 1))
  # the observation after turn 0: the tool message's content, no separator (raw mode)
  for b in (0, 1):
    n0 = int(outs[0]["lengths_B"][b])
    obs = r.sequence_BT[b, P:][r.env_mask_BN[b] > 0].tolist()
    assert obs == char_tok.encode(str(len(completion_text(CHAR_TOKENIZER, outs[0]["tokens_BN"][b, :n0]))))


CHAT_P = 48


@pytest.fixture(scope="module")
def chat_gen(tmp_path_factory):
  """A random tiny model on a tiny BPE vocabulary whose ChatML template also renders `tools` (as a short
  "tools:N" line, so prompts stay small). Half the vocabulary are stop ids (generation_config), so that
  policy turns end with a stop id about as often as the per-turn token limit cuts them."""
  pytest.importorskip("transformers")
  import tiny_hf
  from jaxrl_llm.models.tokenizer import load_checkpoint_tokenizer
  template = "{% if tools %}{{ 'tools:' + (tools | length | string) + '\n' }}{% endif %}" + tiny_hf.CHATML
  tok = load_checkpoint_tokenizer(tiny_hf.make_tokenizer(tmp_path_factory.mktemp("chat_tok"), template=template,
                                                         generation_eos=list(range(0, 300, 2))))
  cfg = dataclasses.replace(CFG, vocab_size=320)
  samp = SamplerConfig(max_new_tokens=4, stop_ids=tok.stop_ids, temperature=1.0, pad_id=tok.pad_id)
  gen = Generation(task=None, train_examples=None, width=CHAT_P, model_cfg=cfg, sampler_cfg=samp,
                   key_root=jax.random.key(1), seed=0, encoder=Encoder(tok))
  return gen, random_params(cfg)


def test_chat_episode_keeps_sampled_tokens_and_appends_template_deltas(chat_gen):
  """With a chat template: the prompt is the template's (tools passed), every policy token is the sampled
  one, and each observation is exactly the template delta (closed by <|im_end|> after a cut turn)."""
  gen, params = chat_gen
  enc, tok = gen.encoder, gen.encoder.tokenizer
  assert enc.chat and enc.renders_tools
  s = EnvSettings(name="test_messages_tools", max_turns=3, turn_tokens=3, max_episode_tokens=64)
  r = run_episodes(gen, params, [1, 2], 2, s, jax.random.key(4), version=0, keep_turns=True)
  assert r.stats["episode_statuses"] == ("max_turns",) * 4
  outs = r.stats["turn_outputs"]
  ended_seen = set()
  for b in range(4):
    start = Messages().reset([1, 2][b // 2])
    first = tok.hf.apply_chat_template(start, tools=MessagesWithTools.tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    assert tok.hf.decode(first).startswith("tools:1\n<|im_start|>system\nsys")
    assert r.sequence_BT[b, CHAT_P - len(first):CHAT_P].tolist() == list(first)
    expect = []
    for t, o in enumerate(outs):
      toks = o["tokens_BN"][b, :int(o["lengths_B"][b])].tolist()
      expect += [("p", x) for x in toks]
      if t == s.max_turns - 1:
        break
      ended = toks[-1] in tok.stop_ids
      ended_seen.add(ended)
      content = str(len(completion_text(tok, toks)))
      ref = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
      delta_text = "\n<|im_start|>tool\n" + content + "<|im_end|>\n<|im_start|>assistant\n"
      full = tok.hf.apply_chat_template(ref + [{"role": "tool", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
      delta = list(full[len(tok.hf.apply_chat_template(ref, tokenize=True, return_dict=False)) - 1:])
      assert tok.hf.decode(delta) == delta_text
      expect += [("e", x) for x in ([] if ended else [tok.end_of_turn_id]) + delta]
    pol, env = r.mask_BN[b] > 0, r.env_mask_BN[b] > 0
    got = [("p" if pol[j] else "e", int(r.sequence_BT[b, CHAT_P + j])) for j in range(int((pol | env).sum()))]
    assert got == expect, b
  assert ended_seen == {True, False}  # both a stopped and a cut turn were followed by an observation
  assert r.stats["env_calls"] == 12  # 4 rows x 3 steps
