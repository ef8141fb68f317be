"""Scripted players and the demonstration episodes they play, for an SFT warm start on multi-turn episodes.

A player answers an episode's history with its next action text: `action(history) -> str`, where
`history` is the list of `(action_text, observation_text)` pairs played so far (empty on the first turn).
`demo_episodes` lets a player play the real environment (`envs.get`) from given seeds and returns
text only: `(first_message, [(action_text, observation_text), ...])` per episode, every step the
environment took, the last observation included (the SFT layout drops what the runner would not append:
`jaxrl_llm.sft.episode_record`).

For guess_number (a secret digit 0-9, "<" = the secret is smaller than the guess, ">" = larger):
- `ConsistentGuesser`: each guess uniformly random among the digits still consistent with the feedback
  so far. Valid and in format, but not optimal: it wins within 4 turns about 3 episodes in 4
  (`tests/test_demos.py` checks the rate), so SFT on its demos teaches the format and leaves room for RL.
- `BinarySearchGuesser`: the middle of the consistent range; wins every episode within 4 turns (the
  optimum: 10 secrets need ceil(log2(10 + 1)) = 4 guesses of a three-way comparison).
Text only (`.importlinter`): no models, sampler or rollout.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np

from jaxrl_llm import envs

History = Sequence[tuple[str, str]]
Episode = tuple[str, list[tuple[str, str]]]


class Player(Protocol):
  """A scripted player (module docstring)."""

  def action(self, history: History) -> str:
    ...


def consistent_digits(history: History) -> list[int]:
  """The digits 0-9 a guess_number secret can still be after `history` (its "<" / ">" feedback)."""
  lo, hi = 0, 9
  for act, obs in history:
    guess = int(next(ch for ch in act if ch.isdigit()))
    if obs == "<":
      hi = min(hi, guess - 1)
    elif obs == ">":
      lo = max(lo, guess + 1)
  return list(range(lo, hi + 1))


class ConsistentGuesser:
  """guess_number: a uniformly random digit among those consistent with the feedback; its draws come from
  its own generator seeded by `seed` (one player per episode keeps episodes reproducible)."""

  def __init__(self, seed: int):
    self.rng = np.random.default_rng([seed, 0xDE30])

  def action(self, history: History) -> str:
    left = consistent_digits(history)
    return str(left[int(self.rng.integers(len(left)))] if left else 0)


class BinarySearchGuesser:
  """guess_number: the middle of the consistent range (the lower middle of an even range)."""

  def __init__(self, seed: int = 0):
    del seed  # deterministic

  def action(self, history: History) -> str:
    left = consistent_digits(history)
    return str(left[(len(left) - 1) // 2] if left else 0)


# env name -> player name -> factory (episode seed -> Player)
PLAYERS: dict[str, dict[str, Callable[[int], Player]]] = {
    "guess_number": {"consistent": ConsistentGuesser, "optimal": BinarySearchGuesser},
}


def player_names(env_name: str) -> list[str]:
  """Scripted players of the environment `env_name` (empty when it has none)."""
  return sorted(PLAYERS.get(env_name, {}))


def make_player(env_name: str, player: str | Callable[[int], Player], seed: int) -> Player:
  """The player of one episode: `player` is a name in `PLAYERS[env_name]` or a factory `seed -> Player`."""
  if callable(player):
    return player(seed)
  if player not in PLAYERS.get(env_name, {}):
    raise ValueError(f"environment {env_name!r} has no scripted player {player!r} "
                     f"(its players: {', '.join(player_names(env_name)) or 'none'})")
  return PLAYERS[env_name][player](seed)


def play(env, player: Player, seed: int, max_turns: int) -> Episode:
  """One episode of `player` in `env` from `seed`, at most `max_turns` steps (the environment may end it earlier)."""
  first = env.reset(seed)
  steps: list[tuple[str, str]] = []
  for _ in range(max_turns):
    act = player.action(steps)
    obs, _, done = env.step(act)
    steps.append((act, obs))
    if done:
      break
  return first, steps


def demo_episodes(env_name: str, env_kwargs: dict, player: str | Callable[[int], Player], seeds: Sequence[int],
                  max_turns: int = 64) -> list[Episode]:
  """One demonstration episode per seed: `player` (a name in `PLAYERS` or a factory `seed -> Player`) plays a
  fresh `envs.get(env_name, **env_kwargs)` from that seed; `max_turns` caps episodes the environment
  never ends. Returns `(first_message, [(action_text, observation_text), ...])` per seed."""
  out = []
  for s in seeds:
    env = envs.get(env_name, **dict(env_kwargs))
    out.append(play(env, make_player(env_name, player, int(s)), int(s), max_turns))
  return out
