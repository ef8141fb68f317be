"""ScienceWorld through our `Env` interface (`envs.scienceworld_env`): needs the `envs` extra and Java.

Golden values from outside the adapter: ScienceWorld's own winning action sequence scores 100 (return 1.0), and
focusing on the wrong substance fails the task (score -100, return -1.0); the adapter's text, rewards and done flags
equal those of the package's own `ScienceWorldEnv` step by step; boil's variation split (train 0-13, dev 14-20,
test 21-29) as ScienceWorld 1.2.3 reports it. The JVM pool's rules (reuse, never while a call runs, a failed JVM
ended) are checked with a fake JVM, so they do not depend on Java's timing. One short episode runs through
`rollout.episodes.run_episodes` with the tiny character model.
"""

import collections
import gc
import pathlib
import shutil
import sys
import threading

import jax
import pytest

pytest.importorskip("scienceworld")
if shutil.which("java") is None:
  pytest.skip("ScienceWorld's simulator needs Java on PATH", allow_module_level=True)

from jaxrl_llm import envs  # noqa: E402
from jaxrl_llm.envs import scienceworld_env as sw  # noqa: E402

pytestmark = pytest.mark.slow

BOIL_TRAIN, BOIL_DEV, BOIL_TEST = range(0, 14), range(14, 21), range(21, 30)  # ScienceWorld 1.2.3's split of boil
ROOT = pathlib.Path(__file__).parents[1]


@pytest.fixture(scope="module", autouse=True)
def end_idle_jvms():
  yield
  sw.close_idle()


# --- the real simulator


def test_gold_actions_solve_boil_with_return_one():
  env = envs.get("scienceworld", task="boil", gold_path=True)
  first = env.reset(0)
  assert env.variation == 0 and first.startswith("Your task is to boil water.")
  assert "\n\nThis room is called the hallway." in first  # task description, blank line, first observation
  rewards, done = [], False
  for a in env.gold_actions():
    obs, r, done = env.step(a)
    rewards.append(r)
    if done:
      break
  assert done and sum(rewards) == pytest.approx(1.0)  # score 100 x 0.01
  assert min(rewards) >= 0.0 and max(rewards) > 0.0  # the score only rose on the way
  assert env._jvm is None  # the finished episode gave its JVM back
  with pytest.raises(RuntimeError, match="ended"):
    env.step("look around")


def test_matches_the_package_wrapper_step_by_step():
  """Variation 3 of boil (seed 3 + 14: train set of 14) against scienceworld's own ScienceWorldEnv: the same first
  text, observations, scaled rewards and done flags; focusing on the wrong substance fails the task."""
  from scienceworld import ScienceWorldEnv
  ref = ScienceWorldEnv("", envStepLimit=100)
  try:
    ref.load("boil", 3, "easy")
    ref_obs, _ = ref.reset()
    env = envs.get("scienceworld", task="boil")
    assert env.reset(3 + len(BOIL_TRAIN)) == f"{ref.get_task_description()}\n\n{ref_obs}"
    total = 0.0
    for a in ["go to kitchen", "blah blah", "pick up thermometer", "look around", "focus on air"]:
      o, r, d, _ = ref.step(a)
      got = env.step(a)
      assert got == (o, pytest.approx(r / 100), d), a
      total += got[1]
    assert d and total == pytest.approx(-1.0)  # failed: score -100
  finally:
    ref.close()


def test_seeds_pick_variations_of_the_chosen_set():
  a, b = envs.get("scienceworld"), envs.get("scienceworld")
  assert a.reset(5) == b.reset(5 + len(BOIL_TRAIN)) and a.variation == b.variation == 5
  assert a.reset(0) != a.reset(3)  # variation 0 starts in the hallway, 3 outside
  dev, test = envs.get("scienceworld", variations="dev"), envs.get("scienceworld", variations="test")
  dev.reset(len(BOIL_DEV) + 1)
  test.reset(2)
  assert dev.variation == BOIL_DEV[1] and test.variation == BOIL_TEST[2]
  assert sw._VARIATIONS[("boil", "test")] == tuple(BOIL_TEST)
  for e in (a, b, dev, test):
    e.close()


def test_unreadable_action_is_feedback_not_invalid():
  env = envs.get("scienceworld")
  env.reset(0)
  assert env.step("blah blah") == (sw.UNKNOWN_ACTION, 0.0, False)
  assert env.step("") == (sw.UNKNOWN_ACTION, 0.0, False)
  # Only the first non-empty line is the command ("go to kitchen\nplease" whole is unreadable).
  assert env.step("\n  go to kitchen  \nplease") == ("You move to the kitchen.", 0.0, False)
  env.close()


# --- arguments and missing pieces (no JVM)


@pytest.mark.parametrize("kwargs,field", [
    (dict(task="boil-the-ocean"), "task"), (dict(simplification="hard"), "simplification"),
    (dict(simplification="easy,openDoors,nope"), "simplification"),
    (dict(task="power-component", simplification="noElectricalAction"), "simplification"),
    (dict(step_limit=0), "step_limit"), (dict(variations="val"), "variations"),
    (dict(reward_scale=float("nan")), "reward_scale"), (dict(reward_scale=-1.0), "reward_scale"),
    (dict(observation="look"), "observation"), (dict(jvm_heap_mb=8), "jvm_heap_mb")])
def test_bad_arguments_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=f"{field}="):
    envs.get("scienceworld", **kwargs)


def test_unknown_argument_and_step_before_reset():
  with pytest.raises(ValueError, match="takes no argument 'variation'"):
    envs.get("scienceworld", variation=3)
  with pytest.raises(RuntimeError, match="before reset"):
    envs.get("scienceworld").step("look around")


def test_missing_java_is_a_clear_error(monkeypatch):
  monkeypatch.setenv("PATH", "")
  with pytest.raises(RuntimeError, match="Java 8 or newer on PATH"):
    envs.get("scienceworld")


def test_missing_package_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "scienceworld", None)  # `import scienceworld` now raises ImportError
  with pytest.raises(ImportError, match=r"jaxrl_llm\[envs\]"):
    envs.get("scienceworld")


def test_action_line():
  assert sw.action_line("\n  open door to kitchen \n go") == "open door to kitchen"
  assert sw.action_line(" \n\t") == ""


# --- the JVM pool, with a fake JVM


class FakeServer:
  """The `PythonInterface` calls the adapter makes. Actions: "win" (score 100), "crash" (raises), "wait" (blocks
  until `gate` is set); any other counts a move."""

  def __init__(self):
    self.gate, self.entered, self.returned = threading.Event(), threading.Event(), threading.Event()
    self.score, self.moves, self.loads = 0.0, 0, []

  def load(self, task, variation, simplification, gold):
    self.loads.append(variation)

  def getVariationsTrain(self):  # noqa: N802 (the Java names)
    return [10, 11, 12]

  def reset(self):
    self.score, self.moves = 0.0, 0

  def step(self, action):
    if action == "crash":
      raise RuntimeError("the JVM went away")
    if action == "wait":
      self.entered.set()
      assert self.gate.wait(60)
    self.score = 1.0 if action == "win" else self.score
    self.moves += action != "look around"
    self.returned.set()
    return f"did {action}"

  def getScore(self):  # noqa: N802
    return self.score

  def getCompleted(self):  # noqa: N802
    return self.score >= 1.0

  def getNumMoves(self):  # noqa: N802
    return self.moves

  def getTaskDescription(self):  # noqa: N802
    return "Your task is to test."

  def freeActionLook(self):  # noqa: N802
    return "did look around"


class FakeJvm:
  def __init__(self, heap_mb):
    self.heap_mb, self.server, self.closed = heap_mb, FakeServer(), False

  def alive(self):
    return not self.closed

  def close(self):
    self.closed = True


@pytest.fixture
def fake(monkeypatch):
  """Fresh pool and variation cache with FakeJvm; returns a maker of fake-backed instances."""
  monkeypatch.setattr(sw, "Jvm", FakeJvm)
  monkeypatch.setattr(sw, "_IDLE", collections.defaultdict(collections.deque))
  monkeypatch.setattr(sw, "_VARIATIONS", {})
  return lambda **kw: envs.get("scienceworld", **kw)


def test_fake_episode_rules(fake):
  env = fake(step_limit=2, observation="obs+look")
  assert env.reset(4) == "Your task is to test.\n\ndid look around" and env.variation == 11  # [10, 11, 12][4 % 3]
  assert env.step("a\nb") == ("did a\n\ndid look around", 0.0, False)
  assert env.step("b") == ("did b\n\ndid look around", 0.0, False)
  assert env.step("c")[2]  # 3 moves > step_limit 2: done (ScienceWorld's rule)
  env = fake(reward_scale=0.5)
  env.reset(0)
  assert env.step("win") == ("did win", 50.0, True)


def test_pool_reuses_a_jvm_across_episodes_and_instances(fake):
  a = fake()
  a.reset(0)
  jvm = a._jvm
  a.step("win")  # done: given back
  assert sw.idle_count() == 1 and a._jvm is None
  b, c = fake(), fake()
  b.reset(1)
  c.reset(2)
  assert b._jvm is jvm and c._jvm is not jvm  # the idle one is reused; a second concurrent episode gets its own
  assert jvm.server.loads[-1] == 11  # the next reset loaded its own game in the reused JVM
  del b  # dropped mid-episode (the runner's rows after max_turns): its JVM goes back
  gc.collect()
  assert sw.idle_count() == 1
  d = fake()
  d.reset(0)
  assert d._jvm is jvm


def test_no_jvm_is_shared_while_a_call_runs(fake):
  env = fake()
  env.reset(0)
  jvm = env._jvm
  t = threading.Thread(target=env.step, args=("wait",))
  t.start()
  assert jvm.server.entered.wait(60)
  env.close()  # during the call: deferred
  assert sw.idle_count() == 0
  other = fake()
  other.reset(0)
  assert other._jvm is not jvm
  jvm.server.gate.set()
  t.join(60)
  assert not t.is_alive() and list(sw._IDLE[512]) == [jvm]  # given back once the call returned


def test_an_abandoned_call_keeps_its_jvm_until_it_returns(fake):
  """As the runner does on a timeout: the call goes on in its worker thread and the instance is dropped; its JVM
  comes back to the pool only once the call has returned and the worker let go of the instance."""
  env = fake()
  env.reset(0)
  jvm = env._jvm
  worker = threading.Thread(target=env.step, args=("wait",))
  worker.start()
  assert jvm.server.entered.wait(60)
  del env  # abandoned
  gc.collect()
  assert sw.idle_count() == 0  # the worker still runs the call (and holds the instance)
  jvm.server.gate.set()
  worker.join(60)
  assert not worker.is_alive()
  gc.collect()
  assert list(sw._IDLE[512]) == [jvm]


def test_a_failed_jvm_is_ended_not_reused(fake):
  env = fake()
  env.reset(0)
  jvm = env._jvm
  with pytest.raises(RuntimeError, match="went away"):
    env.step("crash")
  assert jvm.closed and sw.idle_count() == 0
  with pytest.raises(RuntimeError, match="reset first"):
    env.step("look around")
  env.reset(0)
  assert env._jvm is not jvm
  dead = env._jvm
  env.close()
  dead.closed = True  # died while idle: dropped by the next acquire
  env.reset(0)
  assert env._jvm is not dead and sw.idle_count() == 0


# --- in the episode runner, and the config


def test_scienceworld_episode_in_the_runner():
  from jaxrl_llm.models import ModelConfig, init_params
  from jaxrl_llm.rollout.episodes import EPISODE_STATUSES, EnvSettings, run_episodes
  from jaxrl_llm.rollout.generation import Generation
  from jaxrl_llm.sampling import SamplerConfig
  from jaxrl_llm.tasks import tokenizer as char_tok
  from jaxrl_llm.tasks.encoder import CHAR_ENCODER
  P = 640  # boil variation 0's first message: ~560 characters (one id each) + BOS
  cfg = ModelConfig(vocab_size=char_tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=64, max_seq_len=1024, dtype="float32")
  samp = SamplerConfig(max_new_tokens=4, stop_ids=(char_tok.eos_id,), temperature=1.0, pad_id=char_tok.pad_id)
  gen = Generation(task=None, train_examples=None, width=P, model_cfg=cfg, sampler_cfg=samp,
                   key_root=jax.random.key(1), seed=0, encoder=CHAR_ENCODER)
  s = EnvSettings(name="scienceworld", kwargs=(("task", "boil"),), max_turns=2, turn_tokens=4, max_episode_tokens=128,
                  timeout_s=120.0, prompt_width=P)
  r = run_episodes(gen, init_params(cfg, jax.random.key(0)), [0], 2, s, jax.random.key(2), version=0)
  st = r.stats
  assert set(st["episode_statuses"]) <= set(EPISODE_STATUSES) - {"error", "timeout", "invalid"}, st
  assert st["env_turns_mean"] >= 1 and r.env_mask_BN.sum() > 0  # the simulator answered (random text: feedback)
  assert (r.reward_B == 0.0).all()  # 4 random characters neither solve nor fail boil


def test_agent_scienceworld_config_validates():
  from jaxrl_llm.config import load_file, validate
  c = load_file(ROOT / "configs" / "agent_scienceworld.py")
  validate(c)
  assert c.env.name == "scienceworld" and c.env.max_turns == 30
  env = envs.get(c.env.name, **c.env.kwargs.to_dict())  # its kwargs make an instance (no JVM yet)
  assert env._jvm is None


@pytest.mark.real_model
def test_agent_scienceworld_prompt_width_fits_every_boil_variation():
  """The first message of each of boil's 30 variations, rendered as the config renders it (SmolLM2's chat template)
  and raw, fits `env.prompt_width`."""
  import os
  from jaxrl_llm import wiring
  from jaxrl_llm.config import load_file
  from jaxrl_llm.models import gguf as gg
  from jaxrl_llm.tasks.encoder import Encoder
  if not os.environ.get("JAXRL_LLM_CACHE") and not (gg.default_cache_dir() / "config.json").is_file():
    pytest.skip("SmolLM2 is not imported: make smollm2")
  c = load_file(ROOT / "configs" / "agent_scienceworld.py")
  chat = wiring.encoder_from_config(c)
  raw = Encoder(chat.tokenizer, "none", "")
  widths = []
  for which, n in (("train", len(BOIL_TRAIN)), ("dev", len(BOIL_DEV)), ("test", len(BOIL_TEST))):
    env = envs.get(c.env.name, **{**c.env.kwargs.to_dict(), "variations": which})
    for seed in range(n):
      text = env.reset(seed)
      widths.append((len(chat.prompt_ids(text)), len(raw.prompt_ids(text))))
    env.close()
  assert max(max(w) for w in widths) <= c.env.prompt_width, max(widths)
  assert all(ch > r for ch, r in widths)  # the chat template adds its tokens: the chat encoder was used
