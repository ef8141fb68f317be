"""Guess-the-number: a toy environment the tiny character model can play.

`reset(seed)` picks a secret digit 0-9 from the seed and says "guess:". Each turn the policy answers
a digit; the observation is "<" (the secret is smaller), ">" (larger) or "=" (guessed), all in the
character tokenizer's alphabet. Step reward 1 when guessed, else 0; the episode is done when guessed
or after `max_turns` guesses. `strict=True`: an action that is not one digit (surrounding spaces
allowed) raises `InvalidAction`; `strict=False` (default, so that an untrained character model can
play): the first digit of the action is the guess, and only an action without a digit is invalid.
"""

from __future__ import annotations

import numpy as np

from jaxrl_llm.envs import InvalidAction, register


@register("guess_number")
class GuessNumber:
  """The environment of the module docstring."""

  def __init__(self, max_turns: int = 4, strict: bool = False):
    if max_turns < 1:
      raise ValueError(f"max_turns={max_turns}: must be >= 1")
    self.max_turns, self.strict = max_turns, strict
    self.secret = None
    self.turns = 0

  def reset(self, seed: int) -> str:
    self.secret = int(np.random.default_rng(seed).integers(10))
    self.turns = 0
    return "guess:"

  def step(self, action_text: str) -> tuple[str, float, bool]:
    if self.secret is None:
      raise RuntimeError("step before reset")
    a = action_text.strip()
    digits = [ch for ch in a if ch in "0123456789"]
    if not digits or (self.strict and len(a) != 1):
      raise InvalidAction(f"not a digit: {action_text!r}")
    self.turns += 1
    guess = int(digits[0])
    if guess == self.secret:
      return "=", 1.0, True
    return ("<" if self.secret < guess else ">"), 0.0, self.turns >= self.max_turns
