"""TextArena's single-player games as a text environment (`envs.get("textarena", env_id=...)`).

Needs the `envs` extra (`pip install 'jaxrl_llm[envs]'`); textarena is imported when an instance is
made, so importing this module never needs it. The adapter over textarena's API:

- `reset(seed)`: `ta.make(env_id)` (textarena's default wrappers: the observation is the player's
  whole history as one string, and an action without brackets is put in brackets), then
  `reset(num_players=1, seed=seed)`; returns the first observation.
- `step(action)`: `env.step(action)`, then the observation. The reward is 0 until the game ends; then
  it is player 0's entry of `close()`'s rewards (textarena gives rewards only there): for
  GuessTheNumber 1 for a win, else the fraction of the range the last guess was off by subtracted
  from 1. Other games have their own scales; the value is passed through as a float.
- Observations (`observation=`): textarena's string is cumulative, and the episode runner appends
  every observation to the context, so by default (`"new"`) a turn's observation is only its new
  part: with `prev` the cumulative string textarena returned at the previous call and `full` the
  current one, `full[len(prev):]` when `full` starts with `prev` (else all of `full`), with
  surrounding whitespace stripped. The new part begins with textarena's echo of the action as it
  read it (`[Player] [10]`), then the game's messages (`[GAME] The target number is lower.`).
  `"last_line"`: the last non-empty line of the new part only (short contexts for the character
  model: GuessTheNumber's hints are one line; a board game's last line is not enough). `"full"`:
  textarena's whole string every turn (for a harness that renders each turn as a fresh prompt).
- Invalid moves: textarena's own rule, kept as it is. A move the game cannot read or does not allow
  is not an `InvalidAction`: textarena answers with an observation that says so ("You attempted an
  invalid move ... Please resubmit a valid move") and lets the player retry once (`error_allowance=1`);
  a second invalid move in a row ends the game with the game's partial reward (GuessTheNumber: as
  at the turn limit). A valid move resets the allowance.
- Randomness: textarena seeds Python's global `random` in `reset` and draws from it (and some games
  from numpy's global state) in `reset` and `step`. The episode runner calls environments from
  several threads, so every textarena call here runs under one module lock with this instance's own
  `random` and `np.random` states swapped in and the caller's restored after: an episode is a pure
  function of its seed and actions, whatever runs next to it, and the process's global streams are
  untouched.

Which ids play: an `env_id` must be registered in textarena and playable by one player offline.
Construction raises ValueError naming `env_id` and why for the families known to fail (measured,
textarena 0.7.4): the word games (nltk's `words` corpus, downloaded at import, fails offline), the
LLM-judged games (an OpenRouter key and the network), games written in Python 3.12 syntax (on older
Pythons), and multi-player games that accept one player by mistake. Any other id is tried once per
process (make, reset with seed 0, first observation must be player 0's text); a failure there, such
as a two-player game refusing one player, is the ValueError. Works offline: GuessTheNumber-v0,
TowerOfHanoi-v0, 2048-v0, Blackjack-v0, FrozenLake-v0, Mastermind-v0, Minesweeper-v0, Sudoku-v0-easy,
... (`SUPPORTED_EXAMPLES`).

nltk offline: textarena's word-game modules call `nltk.download` when `ta.make` first imports them;
with no network that fails in well under a second (no hang) and prints `[nltk_data] Error loading
words ...`, then the game raises LookupError. Their ids are refused before `ta.make`, so the adapter
does not import those modules and nothing is printed; `import textarena` itself downloads nothing
(measured: ~1 s, silent offline). An id outside the list that did reach such a module would fail the
same fast way and be refused by the probe. Where a network exists the word games are still refused.

One lock serialises textarena calls in the process: a game that hangs inside a call (none of the
listed ones does) holds it, so the runner's time limit then ends the other episodes' calls too.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from typing import Any

import numpy as np

from jaxrl_llm.envs import register

OBSERVATIONS = ("new", "last_line", "full")
SUPPORTED_EXAMPLES = ("GuessTheNumber-v0", "GuessTheNumber-v0-hardcore", "TowerOfHanoi-v0", "2048-v0", "Blackjack-v0",
                      "FrozenLake-v0", "Mastermind-v0", "Minesweeper-v0-small", "Sudoku-v0-easy", "LightsOut-v0")

_NLTK = "a word game: it downloads nltk's 'words' corpus when imported, which fails offline"
_LLM = "an LLM-judged game: it needs an OpenRouter API key and the network"
_PY312 = "written in Python 3.12 syntax (SyntaxError on this Python)"
_MULTI = "a multi-player game (it accepts num_players=1, but is not meant to be played alone)"
# Family (the id before "-v") -> why it cannot be played here.
KNOWN_FAILING: dict[str, str] = {
    **{f: _NLTK for f in ("Wordle", "Hangman", "WordLadder", "WordSearch", "WordChains", "Codenames", "DontSayIt",
                          "LetterAuction")},
    **{f: _LLM for f in ("Debate", "GuessWho", "TwentyQuestions", "ScenarioPlanning")},
    **({f: _PY312 for f in ("Chess", "Checkers", "ReverseTicTacToe", "IteratedStagHunt", "UltimateTexasHoldem",
                            "Klondike")} if sys.version_info < (3, 12) else {}),
    **{f: _MULTI for f in ("MarketEntryGame", "PublicGoodsGame", "QuantumTicTacToe", "SpiteAndMalice")},
}

_LOCK = threading.RLock()  # every textarena call (module docstring: randomness)
_CHECKED: set[str] = set()  # env ids whose one-player probe passed in this process


def import_textarena():
  """The textarena module, or an ImportError that names the extra to install."""
  try:
    import textarena
  except ImportError as e:
    raise ImportError("the 'textarena' environment needs textarena: pip install 'jaxrl_llm[envs]'") from e
  return textarena


def family(env_id: str) -> str:
  """The game family of a textarena id: the part before its version ("Wordle-v0-long" -> "Wordle")."""
  return env_id.split("-v", 1)[0]


def new_part(prev: str, full: str) -> str:
  """The part of the cumulative observation `full` that `prev` did not have (all of `full` when it
  does not start with `prev`), surrounding whitespace stripped."""
  return (full[len(prev):] if full.startswith(prev) else full).strip()


def last_line(text: str) -> str:
  """The last non-empty line of `text`, stripped ("" when there is none)."""
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  return lines[-1] if lines else ""


@contextlib.contextmanager
def _own_rng(states: list):
  """Holds the module lock with `states` ([python random state, numpy state]) as the global random
  states, stores their new values back into `states`, and restores the caller's."""
  with _LOCK:
    outer = random.getstate(), np.random.get_state()
    random.setstate(states[0])
    np.random.set_state(states[1])
    try:
      yield
    finally:
      states[:] = [random.getstate(), np.random.get_state()]
      random.setstate(outer[0])
      np.random.set_state(outer[1])


def _seeded_states(seed: int) -> list:
  """Fresh [python random, numpy] global states seeded by `seed` (numpy's reduced mod 2**32)."""
  py, npr = random.Random(seed), np.random.RandomState(seed % 2**32)
  return [py.getstate(), npr.get_state()]


def _reject(env_id: str, why: str) -> ValueError:
  return ValueError(f"textarena env_id={env_id!r} cannot be played here: {why}")


def _probe(ta, env_id: str) -> None:
  """Raises ValueError naming `env_id` unless it makes, resets with one player and observes as text."""
  try:
    with _own_rng(_seeded_states(0)):
      env = ta.make(env_id)
      env.reset(num_players=1, seed=0)
      pid, obs = env.get_observation()
  except Exception as e:  # textarena's own errors: AssertionError for 2+ players, LookupError, ImportError, ...
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    why = ("not a single-player game" if isinstance(e, AssertionError) and "player" in msg.lower()
           else "reset with one player failed")
    raise _reject(env_id, f"{why} ({type(e).__name__}: {msg})") from e
  if pid != 0 or not isinstance(obs, str):
    raise _reject(env_id, f"its first observation is not text for player 0 (player {pid}, {type(obs).__name__}); "
                          "use an id with textarena's default wrappers (not '-raw')")


@register("textarena")
class TextArena:
  """A textarena single-player game (module docstring).

  Args:
    env_id: a textarena environment id, e.g. "GuessTheNumber-v0", "TowerOfHanoi-v0".
    observation: "new" (default), "last_line" or "full" (module docstring).
  """

  def __init__(self, env_id: str = "GuessTheNumber-v0", observation: str = "new"):
    if observation not in OBSERVATIONS:
      raise ValueError(f"observation={observation!r}: must be one of {', '.join(OBSERVATIONS)}")
    if family(env_id) in KNOWN_FAILING:
      raise _reject(env_id, KNOWN_FAILING[family(env_id)])
    self.ta = import_textarena()
    from textarena.envs.registration import ENV_REGISTRY
    if env_id not in ENV_REGISTRY:
      raise ValueError(f"textarena env_id={env_id!r} is not a registered textarena environment "
                       f"(e.g. {', '.join(SUPPORTED_EXAMPLES[:4])})")
    with _LOCK:
      if env_id not in _CHECKED:
        _probe(self.ta, env_id)
        _CHECKED.add(env_id)
    self.env_id, self.observation = env_id, observation
    self._env: Any = None
    self._rng: list = []
    self._prev = ""
    self._done = False

  def _observe(self) -> str:
    """Player 0's observation, as `observation` says; advances `_prev` (call under `_own_rng`)."""
    pid, full = self._env.get_observation()
    if pid != 0:
      raise RuntimeError(f"textarena {self.env_id}: expected player 0 to move, got player {pid}")
    new = new_part(self._prev, full)
    self._prev = full
    if self.observation == "full":
      return full.strip()
    return last_line(new) if self.observation == "last_line" else new

  def reset(self, seed: int) -> str:
    self._rng = _seeded_states(seed)
    self._prev, self._done = "", False
    with _own_rng(self._rng):
      self._env = self.ta.make(self.env_id)
      self._env.reset(num_players=1, seed=seed)
      return self._observe()

  def step(self, action_text: str) -> tuple[str, float, bool]:
    if self._env is None:
      raise RuntimeError("step before reset")
    if self._done:
      raise RuntimeError("step after the game ended")
    with _own_rng(self._rng):
      done, _ = self._env.step(action=action_text)
      obs = self._observe()
      if not done:
        return obs, 0.0, False
      rewards, _ = self._env.close()
    self._done = True
    return obs, float((rewards or {}).get(0, 0.0)), True
