"""Package-backed environments (`envs.textarena_env`, `envs.reasoning_gym_env`) through our `Env` interface.

Scripted players with known outcomes (binary search wins GuessTheNumber in at most 5 guesses of 1..20;
the optimal 3-disk Hanoi solution is 7 moves), golden answers computed apart from the package
(basic_arithmetic's expression evaluated here), error paths, determinism, and one episode of each
through `rollout.episodes.run_episodes` with the tiny character model. Needs the `envs` extra.
"""

import random
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("textarena")
pytest.importorskip("reasoning_gym")

from jaxrl_llm import envs  # noqa: E402
from jaxrl_llm.envs import reasoning_gym_env, textarena_env  # noqa: E402
from jaxrl_llm.models import ModelConfig, init_params  # noqa: E402
from jaxrl_llm.rollout.episodes import EPISODE_STATUSES, EnvSettings, run_episodes  # noqa: E402
from jaxrl_llm.rollout.generation import Generation  # noqa: E402
from jaxrl_llm.sampling import SamplerConfig  # noqa: E402
from jaxrl_llm.tasks import tokenizer as char_tok  # noqa: E402
from jaxrl_llm.tasks.encoder import CHAR_ENCODER  # noqa: E402

# basic_arithmetic without division: integer answers we can evaluate here.
ARITH = dict(task="basic_arithmetic", size=16, dataset_seed=3, config={"operators": ["+", "-", "*"]})


def play_binary_search(env, seed):
  """Plays GuessTheNumber 1..20 by binary search; returns (observations, rewards, turns)."""
  obs, rewards = [env.reset(seed)], []
  lo, hi = 1, 20
  for _ in range(10):
    guess = (lo + hi) // 2
    o, r, done = env.step(f"my guess is [{guess}]")
    obs.append(o)
    rewards.append(r)
    if done:
      break
    last = textarena_env.last_line(o).lower()
    assert "higher" in last or "lower" in last, o
    lo, hi = (guess + 1, hi) if "higher" in last else (lo, guess - 1)
  return obs, rewards, len(rewards)


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_guess_the_number_binary_search_wins(seed):
  obs, rewards, turns = play_binary_search(envs.get("textarena", env_id="GuessTheNumber-v0"), seed)
  assert turns <= 5  # ceil(log2(20)) = 5 guesses always suffice
  assert rewards[-1] == 1.0 and all(r == 0.0 for r in rewards[:-1])  # the reward only from close(), at the end
  assert obs[0].startswith("[GAME] You are Player 0. You are playing Guess The Number.")


def test_new_part_has_no_repeated_history():
  full_env = envs.get("textarena", env_id="GuessTheNumber-v0", observation="full")
  new_env = envs.get("textarena", env_id="GuessTheNumber-v0")
  full0, new0 = full_env.reset(4), new_env.reset(4)
  assert full0 == new0
  full1, new1 = full_env.step("[10]")[0], new_env.step("[10]")[0]
  assert full1.startswith(full0) and new0 not in new1
  assert new1.startswith("[Player] [10]\n[GAME] The target number is")  # the action echo, then the hint
  assert full1 == (full0 + "\n" + new1)  # cumulative = previous + new part (textarena joins with "\n")
  line_env = envs.get("textarena", env_id="GuessTheNumber-v0", observation="last_line")
  assert line_env.reset(4) == "Enter your guess."
  assert line_env.step("[10]")[0] == new1.splitlines()[-1]


def test_new_part_and_last_line_helpers():
  assert textarena_env.new_part("\nab", "\nab\ncd \n") == "cd"
  assert textarena_env.new_part("xyz", "\nother") == "other"  # not a continuation: the whole string
  assert textarena_env.last_line("a\nb\n\n  ") == "b" and textarena_env.last_line("") == ""


def test_determinism_and_global_rng_untouched():
  random.seed(99)
  np.random.seed(99)
  before = random.getstate(), np.random.get_state()[1].copy()
  a = play_binary_search(envs.get("textarena", env_id="GuessTheNumber-v0"), 5)
  assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
  random.seed(0)  # the caller's global stream does not reach the game
  b = play_binary_search(envs.get("textarena", env_id="GuessTheNumber-v0"), 5)
  assert a == b
  # Different seeds pick different numbers: the binary-search transcripts are not all equal.
  assert len({tuple(play_binary_search(envs.get("textarena", env_id="GuessTheNumber-v0"), s)[0]) for s in range(6)}) > 1


def test_interleaved_instances_are_independent():
  """2048 draws a new tile from the global random stream at every step: two games with one seed,
  stepped in turn next to a third game, see what one game alone sees."""
  moves = ["[up]", "[left]", "[down]", "[right]", "[up]"]
  solo = envs.get("textarena", env_id="2048-v0")
  solo_obs = [solo.reset(11)] + [solo.step(m)[0] for m in moves]
  a, b, other = (envs.get("textarena", env_id="2048-v0") for _ in range(3))
  a_obs, b_obs = [a.reset(11)], [b.reset(11)]
  other.reset(12)
  for m in moves:
    a_obs.append(a.step(m)[0])
    other.step("[left]")
    b_obs.append(b.step(m)[0])
  assert a_obs == solo_obs and b_obs == solo_obs
  assert len(set(solo_obs)) > 2  # the board changes: the moves were played


def hanoi_moves(n, src="A", via="B", dst="C"):
  return [] if n == 0 else hanoi_moves(n - 1, src, dst, via) + [(src, dst)] + hanoi_moves(n - 1, via, src, dst)


def test_tower_of_hanoi_optimal_player():
  env = envs.get("textarena", env_id="TowerOfHanoi-v0")
  assert "A: [3, 2, 1]" in env.reset(0)
  moves = hanoi_moves(3)
  assert len(moves) == 7
  results = [env.step(f"[{s} {d}]") for s, d in moves]
  assert [done for _, _, done in results] == [False] * 6 + [True]
  assert [r for _, r, _ in results] == [0.0] * 6 + [1.0]
  with pytest.raises(RuntimeError, match="ended"):
    env.step("[A C]")


def test_invalid_move_gets_one_retry_then_ends():
  env = envs.get("textarena", env_id="GuessTheNumber-v0")
  env.reset(2)
  obs, r, done = env.step("hello")
  assert "invalid move" in obs and "resubmit" in obs and (r, done) == (0.0, False)
  obs, r, done = env.step("still no number")
  assert done and r == 0.0  # no guess yet: GuessTheNumber's partial reward is 0


def test_invalid_allowance_resets_after_a_valid_move():
  env = envs.get("textarena", env_id="GuessTheNumber-v0")
  env.reset(2)
  assert not env.step("x")[2] and not env.step("[1]")[2] and not env.step("y")[2]


@pytest.mark.parametrize("env_id,why", [
    ("Wordle-v0", "word game"), ("Hangman-v0-train", "word game"), ("Debate-v0", "OpenRouter"),
    ("TicTacToe-v0", "not a single-player game"), ("QuantumTicTacToe-v0", "multi-player"),
    ("NoSuchGame-v0", "not a registered"), ("GuessTheNumber-v0-raw", "not text")])
def test_unsupported_env_ids_are_named(env_id, why):
  with pytest.raises(ValueError, match=why) as e:
    envs.get("textarena", env_id=env_id)
  assert f"env_id={env_id!r}" in str(e.value)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12 reads these games")
def test_python312_games_are_refused():
  with pytest.raises(ValueError, match="env_id='Chess-v0'.*3.12"):
    envs.get("textarena", env_id="Chess-v0")


def test_bad_observation_option_and_step_before_reset():
  with pytest.raises(ValueError, match="observation='lines'"):
    envs.get("textarena", observation="lines")
  with pytest.raises(RuntimeError, match="before reset"):
    envs.get("textarena").step("[3]")


def test_missing_package_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "textarena", None)  # `import textarena` now raises ImportError
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)
  with pytest.raises(ImportError, match=r"jaxrl_llm\[envs\]"):
    envs.get("textarena")
  with pytest.raises(ImportError, match=r"jaxrl_llm\[envs\]"):
    envs.get("reasoning_gym", task="basic_arithmetic", size=3, dataset_seed=987654)  # not cached


# --- reasoning-gym


def arith_value(item):
  """basic_arithmetic's answer computed here from the expression in its metadata (+ - * only)."""
  expr = item["metadata"]["expression"]
  assert set(expr) <= set("0123456789+-*() "), expr
  return int(eval(expr))  # noqa: S307 (digits and + - * only, checked above)


def test_reasoning_gym_gold_and_wrong_answers():
  env = envs.get("reasoning_gym", **ARITH)
  for seed in range(4):
    q = env.reset(seed)
    item = env.data.item(seed)
    assert q == item["question"] and q.startswith("Calculate")
    gold = arith_value(item)
    assert item["answer"] == str(gold)
    assert env.step(f"I think <answer>{gold}</answer>") == ("", 1.0, True)  # extracted from the tags
    env.reset(seed)
    assert env.step(f"  {gold}\n") == ("", 1.0, True)  # no tags: the whole text, stripped
    env.reset(seed)
    assert env.step(f"<answer>{gold + 1}</answer>")[1] < 1.0
    env.reset(seed)
    assert env.step(f"{gold} or so")[1] < 1.0


def test_reasoning_gym_partial_credit_countdown():
  env = envs.get("reasoning_gym", task="countdown", size=4, dataset_seed=0)
  env.reset(1)
  item = env.data.item(1)
  assert env.step(f"<answer>{item['answer']}</answer>")[1] == 1.0
  env.reset(1)
  nums = item["metadata"]["numbers"]
  wrong = " + ".join(map(str, nums))  # every number once, summed: well-formed, value (almost surely) wrong
  r = env.step(f"<answer>{wrong}</answer>")[1]
  assert (r == 1.0) if sum(nums) == item["metadata"]["target"] else (0.0 < r < 1.0)  # partial credit


def test_reasoning_gym_determinism_and_cache():
  a, b = envs.get("reasoning_gym", **ARITH), envs.get("reasoning_gym", **ARITH)
  assert a.data is b.data  # one dataset per (task, size, dataset_seed, config)
  assert a.reset(5) == b.reset(5) == a.reset(5 + ARITH["size"])  # item seed % size
  other = envs.get("reasoning_gym", **{**ARITH, "dataset_seed": 4})
  assert other.data is not a.data and other.reset(5) != a.reset(5)
  # A made item is not made again: the dataset object is no longer consulted for it.
  made = dict(a.data.items)
  ds, a.data.ds = a.data.ds, None
  try:
    assert a.reset(5) == made[5]["question"]
  finally:
    a.data.ds = ds
  # The items do not depend on the order they were made in.
  assert reasoning_gym_env.dataset_items(**ARITH, n=6) == [ds[i] for i in range(6)]


def test_reasoning_gym_errors():
  with pytest.raises(ValueError, match="task='nope'"):
    envs.get("reasoning_gym", task="nope", size=2)
  with pytest.raises(ValueError, match="bad config.*bogus"):
    envs.get("reasoning_gym", task="basic_arithmetic", size=2, config={"bogus": 1})
  with pytest.raises(ValueError, match="size=0"):
    envs.get("reasoning_gym", task="basic_arithmetic", size=0)
  env = envs.get("reasoning_gym", **ARITH)
  with pytest.raises(RuntimeError, match="before reset"):
    env.step("3")
  env.reset(0)
  env.step("3")
  with pytest.raises(RuntimeError):  # one turn only
    env.step("3")


# --- inside the episode runner, with the tiny character model

CFG = ModelConfig(vocab_size=char_tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_seq_len=384, dtype="float32")
P = 40


@pytest.fixture(scope="module")
def gen_params():
  samp = SamplerConfig(max_new_tokens=4, stop_ids=(char_tok.eos_id,), temperature=1.0, pad_id=char_tok.pad_id)
  gen = Generation(task=None, train_examples=None, width=P, model_cfg=CFG, sampler_cfg=samp,
                   key_root=jax.random.key(1), seed=0, encoder=CHAR_ENCODER)
  return gen, init_params(CFG, jax.random.key(0))


def test_textarena_episode_in_the_runner(gen_params):
  gen, params = gen_params
  # A random model's action is (almost surely) no number: textarena answers with its ~210-character
  # "invalid move" line, then ends the game at the second one (the budget N holds both turns).
  s = EnvSettings(name="textarena", kwargs=(("env_id", "GuessTheNumber-v0"), ("observation", "last_line")),
                  max_turns=3, turn_tokens=4, max_episode_tokens=300, timeout_s=30.0, prompt_width=P)
  r = run_episodes(gen, params, [3], 2, s, jax.random.key(2), version=0)
  st = r.stats
  assert sum(st["episode_status"].values()) == 2 and set(st["episode_statuses"]) <= set(EPISODE_STATUSES)
  assert st["env_errors"] == 0 and st["env_timeouts"] == 0  # the adapter ran: no exception, no overrun
  assert st["env_turns_mean"] >= 1 and r.env_mask_BN.sum() > 0  # observations were appended
  assert ((0.0 <= r.reward_B) & (r.reward_B <= 1.0)).all()


def test_reasoning_gym_episode_in_the_runner(gen_params):
  gen, params = gen_params
  s = EnvSettings(name="reasoning_gym", kwargs=tuple(ARITH.items()), max_turns=2, turn_tokens=4,
                  max_episode_tokens=8, timeout_s=30.0, prompt_width=P)
  r = run_episodes(gen, params, [0, 1], 2, s, jax.random.key(3), version=0)
  assert r.stats["episode_statuses"] == ("done",) * 4  # single turn: done after the first step
  assert r.stats["env_errors"] == 0 and r.env_mask_BN.sum() == 0  # no observation after the last step


@pytest.mark.parametrize("name", ["agent_textarena_tiny", "agent_reasoning_gym_tiny"])
def test_shipped_package_configs_fit(name):
  """configs/agent_textarena_tiny.py and agent_reasoning_gym_tiny.py validate, and their first messages fit their
  prompt buckets (BOS included)."""
  import pathlib
  from jaxrl_llm.config import load_file, validate
  c = load_file(pathlib.Path(__file__).parents[1] / "configs" / f"{name}.py")
  validate(c)
  env = envs.get(c.env.name, **c.env.kwargs.to_dict())
  assert max(len(CHAR_ENCODER.prompt_ids(env.reset(seed))) for seed in range(64)) <= c.env.prompt_width
  if name == "agent_reasoning_gym_tiny":  # the character model can write every answer: digits, scored exactly
    env.reset(1)
    answer = env.item["answer"]
    assert answer.isdigit() and env.step(answer) == ("", 1.0, True)


# --- the single-turn task


def test_reasoning_gym_task_rows_and_reward():
  from jaxrl_llm import tasks
  t = tasks.get_task("reasoning_gym", rg_task="basic_arithmetic", size=16, dataset_seed=3,
                     rg_config='{"operators": ["+", "-", "*"]}')
  items = reasoning_gym_env.dataset_items(**ARITH)  # the same dataset as the environment's (one cache)
  assert t.rows == tuple((it["question"], it["answer"]) for it in items)
  test = tasks.split_examples(t, "test", seed=0, num_test=4)
  train = tasks.split_examples(t, "train", seed=0, num_test=4)
  assert len(test) == 4 and len(train) == 12 and not {e["prompt"] for e in test} & {e["prompt"] for e in train}
  for it in items[:4]:
    gold = arith_value(it)
    assert t.reward(it["question"], "", f"<answer>{gold}</answer>") == 1.0
    assert t.reward(it["question"], "", str(gold)) == 1.0
    assert t.reward(it["question"], "", str(gold + 1)) < 1.0
  assert t.reward("not a question of the dataset", "", "1") == 0.0
  assert t.max_prompt_len == max(len(it["question"]) for it in items)


@pytest.mark.parametrize("kwargs,field", [
    (dict(rg_task="nope"), "rg_task"), (dict(rg_task="basic_arithmetic", rg_config="{bad"), "rg_config"),
    (dict(rg_task="basic_arithmetic", rg_config='{"bogus": 1}'), "rg_config"),
    (dict(rg_task="basic_arithmetic", size=1), "size")])
def test_reasoning_gym_task_errors_name_the_argument(kwargs, field):
  from jaxrl_llm import tasks
  with pytest.raises(tasks.TaskError) as e:
    tasks.get_task("reasoning_gym", **{"size": 8, **kwargs})
  assert e.value.kwarg == field
