"""Scripted demonstrations (`envs.demos`), SFT on demonstration episodes (`sft.episode_record`, `sft_on_demos`)
and the held-out multi-turn evaluation (`episode_eval`), with numbers."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import config as config_lib, envs, learner, loop, sft
from jaxrl_llm.config import ConfigError, load_file
from jaxrl_llm.envs import demos
from jaxrl_llm.episode_eval import EVAL_SEED_BASE, eval_seeds
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.rollout import episodes
from jaxrl_llm.rollout.episodes import EnvSettings, run_episodes
from jaxrl_llm.rollout.generation import Generation
from jaxrl_llm.sampling import SamplerConfig
from jaxrl_llm.tasks import tokenizer as char_tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=char_tok.vocab_size, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32,
                  d_ff=128, max_seq_len=64, dtype="float32")
SETTINGS = EnvSettings(name="guess_number", kwargs=(("max_turns", 4),), max_turns=4, turn_tokens=3,
                       max_episode_tokens=16, timeout_s=5.0, prompt_width=8)


def secret(seed):
  return int(np.random.default_rng(seed).integers(10))  # guess_number's draw, restated


def win_probability(n, turns):
  """Exact P(the consistent random guesser finds a uniform secret among n candidates within `turns` guesses)."""
  if n == 0 or turns == 0:
    return 0.0
  return sum((1 + g * win_probability(g, turns - 1) + (n - 1 - g) * win_probability(n - 1 - g, turns - 1)) / n
             for g in range(n)) / n


def test_binary_search_wins_every_secret_with_the_expected_guesses():
  seeds = [next(s for s in range(1000) if secret(s) == d) for d in range(10)]
  eps = demos.demo_episodes("guess_number", {"max_turns": 4}, "optimal", seeds)
  guesses = [[int(a) for a, _ in steps] for _, steps in eps]
  assert guesses[9] == [4, 7, 8, 9] and guesses[4] == [4] and guesses[0] == [4, 1, 0]  # middles of 0-9, 5-9, 8-9
  assert all(steps[-1][1] == "=" and len(steps) <= 4 for _, steps in eps)
  assert all(first == "guess:" for first, _ in eps)


def test_consistent_player_is_consistent_and_wins_at_its_exact_rate():
  n = 3000
  eps = demos.demo_episodes("guess_number", {"max_turns": 4}, "consistent", range(n))
  for s, (_, steps) in enumerate(eps[:300]):
    for i, (act, obs) in enumerate(steps):  # every guess is still possible, every observation the real comparison
      assert int(act) in demos.consistent_digits(steps[:i])
      assert obs == ("=" if int(act) == secret(s) else "<" if secret(s) < int(act) else ">")
  rate = np.mean([steps[-1][1] == "=" for _, steps in eps])
  exact = win_probability(10, 4)  # 0.7683 (not optimal: binary search wins all)
  assert 0.74 < exact < 0.8 and abs(rate - exact) < 3 * np.sqrt(exact * (1 - exact) / n)
  assert demos.demo_episodes("guess_number", {}, "consistent", [5, 6]) == demos.demo_episodes(
      "guess_number", {}, "consistent", [5, 6])  # reproducible


def test_unknown_player_names_the_choices():
  with pytest.raises(ValueError, match="no scripted player 'nope'.*consistent, optimal"):
    demos.demo_episodes("guess_number", {}, "nope", [0])
  with pytest.raises(ValueError, match="players: none"):
    demos.make_player("other_env", "consistent", 0)


def test_episode_record_layout_golden():
  e = char_tok.encode
  steps = [("7", ">"), ("9", "<"), ("8", "=")]
  prompt, resp, mask = sft.episode_record(CHAR_ENCODER, "guess:", steps, max_turns=4, N=16)
  assert prompt == e("guess:", add_bos=True)
  assert resp == e("7") + [char_tok.eos_id] + e(">") + e("9") + [char_tok.eos_id] + e("<") + e("8") + [char_tok.eos_id]
  assert mask == [1, 1, 0, 1, 1, 0, 1, 1]
  # policy tokens decode to the scripted actions, turn by turn (split at the stop id)
  pol = [t for t, m in zip(resp, mask) if m]
  ends = [i + 1 for i, t in enumerate(pol) if t == char_tok.eos_id]
  assert ends == [2, 4, 6]
  texts = [char_tok.completion_text(char_tok.CHAR_TOKENIZER, pol[a:b]) for a, b in zip([0] + ends, ends)]
  assert texts == ["7", "9", "8"]
  # the runner's turn limit (no observation after turn max_turns) and budget (no observation without room after it)
  assert sft.episode_record(CHAR_ENCODER, "guess:", steps, max_turns=2, N=16)[1] == resp[:5]
  assert sft.episode_record(CHAR_ENCODER, "guess:", steps, max_turns=4, N=5)[1:] == (resp[:5], mask[:5])
  assert sft.episode_record(CHAR_ENCODER, "guess:", steps, max_turns=4, N=4)[1:] == (resp[:3] + resp[3:4], [1, 1, 0, 1])


@functools.lru_cache(maxsize=1)
def trained_params():
  """(untrained, SFT-on-demos) parameters of the test model: 150 steps on 64 consistent-player episodes."""
  p0 = init_params(CFG, jax.random.key(0))
  records = sft.demo_records(CHAR_ENCODER, SETTINGS, "consistent", 64, seed=0)
  sched = sft.SftSchedule(steps=150, batch_size=16, lr=3e-3, max_new_tokens=0, seed=0)
  p1, loss = sft.sft_on_demos(sched, CFG, jax.tree_util.tree_map(jnp.copy, p0), records, 8, 16)
  return p0, p1, loss


def greedy_gen():
  samp = SamplerConfig(max_new_tokens=3, stop_ids=(char_tok.eos_id,), temperature=0.0, pad_id=char_tok.pad_id)
  return Generation(task=None, train_examples=None, width=8, model_cfg=CFG, sampler_cfg=samp,
                    key_root=jax.random.key(1), seed=0, encoder=CHAR_ENCODER)


def test_sft_on_demos_raises_greedy_episode_success():
  p0, p1, loss = trained_params()
  seeds = [next(s for s in range(EVAL_SEED_BASE, EVAL_SEED_BASE + 1000) if secret(s) == d) for d in range(10)]
  success = lambda p: float(np.mean(
      run_episodes(greedy_gen(), p, seeds, 1, SETTINGS, jax.random.key(2), 0).reward_B >= 1))
  before, after = success(p0), success(p1)
  assert np.isfinite(loss) and loss < 1.2  # the demos' own entropy is about 0.9 nats per policy token
  assert before <= 0.1 and after >= before + 0.3, (before, after)  # measured 0.1 -> 0.5 (the 10 secrets once each)


def test_demo_record_equals_the_runners_record_of_the_same_play():
  """Episodes the SFT'd model plays (sampled): their actions replayed as demonstrations give the runner's record
  token for token (sequence, positions, segments, policy mask), so SFT trains the layout RL samples."""
  _, p1, _ = trained_params()
  gen = dataclasses.replace(greedy_gen(), sampler_cfg=dataclasses.replace(greedy_gen().sampler_cfg, temperature=1.0))
  ro = run_episodes(gen, p1, [11, 12, 13, 14], 2, SETTINGS, jax.random.key(3), 0)
  tok_BN, mask_BN, turn_BN = ro.sequence_BT[:, 8:], ro.mask_BN, ro.turn_BN
  checked = 0
  for b, st in enumerate(ro.stats["episode_statuses"]):
    acts = [tok_BN[b][(turn_BN[b] == t) & (mask_BN[b] > 0)] for t in range(SETTINGS.max_turns)]
    acts = [a for a in acts if a.size]
    if st not in ("done", "max_turns") or any(a[-1] != char_tok.eos_id for a in acts):
      continue
    env = envs.get("guess_number", max_turns=4)
    first = env.reset([11, 12, 13, 14][b // 2])
    steps = [(char_tok.decode(a[:-1]), env.step(char_tok.decode(a[:-1]))[0]) for a in acts]
    rec = sft.episode_record(CHAR_ENCODER, first, steps, SETTINGS.max_turns, SETTINGS.max_episode_tokens)
    seq, pos, seg, mask = sft.episode_batch([rec], 8, 16, char_tok.pad_id)
    np.testing.assert_array_equal(np.asarray(seq)[0], ro.sequence_BT[b])
    np.testing.assert_array_equal(np.asarray(pos)[0], ro.positions_BT[b])
    np.testing.assert_array_equal(np.asarray(seg)[0], ro.segment_ids_BT[b])
    np.testing.assert_array_equal(np.asarray(mask)[0], ro.mask_BN[b])
    checked += 1
  assert checked >= 4, ro.stats["episode_statuses"]


def test_sft_loss_gradient_is_zero_at_environment_positions(monkeypatch):
  """`learner.make_sft_step` on an episode batch, its log-probs replaced by a free array x: one SGD step of rate
  1 moves x by -dloss/dx, exactly 0 at environment tokens and padding, 1/#policy tokens at policy tokens."""
  rec = sft.episode_record(CHAR_ENCODER, "guess:", [("7", ">"), ("9", "<"), ("8", "=")], 4, 16)
  seq, pos, seg, mask = sft.episode_batch([rec, rec], 8, 16, char_tok.pad_id)
  monkeypatch.setattr(learner, "completion_logprobs", lambda params, *a: {"logp_BT": params["x"]})
  step = learner.make_sft_step(CFG, optax.sgd(1.0))
  x = jnp.zeros((2, 16), jnp.float32)
  new, _, _ = step({"x": x}, optax.sgd(1.0).init({"x": x}), seq, pos, seg, mask)
  grad = -np.asarray(new["x"])
  m = np.asarray(mask)
  assert m.sum() == 2 * 6
  np.testing.assert_array_equal(grad[m == 0], 0.0)
  np.testing.assert_allclose(grad[m > 0], -1.0 / m.sum(), rtol=1e-6)


def test_eval_seeds_are_disjoint_from_training_and_demo_seeds():
  train = [s for t in range(50) for s in episodes.episode_seeds(0, t, 64)]
  assert max(train + sft.demo_seeds(0, 1000)) < EVAL_SEED_BASE <= min(eval_seeds(64))
  assert eval_seeds(3) == [2**31, 2**31 + 1, 2**31 + 2]


def agent_sft(**over):
  c = load_file(os.path.join(ROOT, "configs", "agent_sft_tiny.py"))
  c.log.tensorboard, c.log.progress = False, False
  c.num_steps, c.checkpoint.every, c.sft.steps, c.eval.every, c.eval.num_prompts = 1, 0, 5, 1, 8
  c.model.n_layers, c.model.d_model, c.model.head_dim, c.model.d_ff = 1, 32, 16, 64  # compiles faster
  for k, v in over.items():
    sec, key = k.split("__")
    c[sec][key] = v
  return c


@pytest.mark.slow
def test_loop_writes_episode_success_as_eval_accuracy(tmp_path):
  rows = loop.run(agent_sft(), str(tmp_path / "run"))
  (row,) = rows
  assert row["eval_accuracy"] == row["eval_episode_success"] and 0 <= row["eval_episode_success"] <= 1
  assert 1 <= row["eval_episode_turns"] <= 4
  info = json.load(open(tmp_path / "run" / "run_info.json"))
  assert info["eval_episode_success_initial"] == info["eval_accuracy_initial"]
  assert 1 <= info["eval_episode_turns_initial"] <= 4
  assert np.isfinite(info["sft_final_loss"])


@pytest.mark.parametrize("field,value,named", [("demos", 0, "sft.demos"), ("demos", -1, "sft.demos"),
                                               ("demo_player", "nope", "sft.demo_player")])
def test_sft_demo_fields_are_validated(field, value, named):
  c = agent_sft(**{f"sft__{field}": value})
  with pytest.raises(ConfigError, match=named.replace(".", "\\.")):
    config_lib.validate(c)
  c.sft.steps = 0  # no warm start: the fields are not read
  config_lib.validate(c)
