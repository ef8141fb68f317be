"""Pats: a training-time scaffold of evidence cards, made from the latest policy's rollout groups.

Pats (abstract in `../shared/seeds/`; no released code was found) turns each rollout group into an evidence card,
shows the card in the context of later rollouts of that task, and uses a task-specific evaluation to revise or
remove cards as the policy improves; the policy trains with the environment's rewards (plain RLVR on the
scaffolded rollouts) and the scaffold is discarded at deployment (evaluation prompts never carry a card).

Here a task is a prompt text (a card is found again when the prompt recurs: tasks with few distinct prompts,
such as configs/pats_tiny.py's one-digit multiplication). A card holds the group's best completion and its worst,
each with its reward, rendered in front of the prompt as `best:r_best,worst:r_worst;`. For a group of G rows of a
prompt that holds a card, the first `h = round(card_frac · G)` rows see it and the other G − h do not, so every
group measures what the card is worth (and keeps rollout variation). After scoring, per group:

  - no card, group mean reward < `add_below`, and the group's rewards differ: the group becomes a card (added);
  - a card, and the bare rows score at least the carded rows − `retire_margin`: the card is redundant (retired);
  - a card still helping, and the group found a better completion than the card's best: the card is revised.

[GUESS] where the abstract is silent: the card's content (best and worst attempt with their rewards), the
carded/bare split as the evaluation, and its three thresholds. `Scaffold` is host state (plain data in the
checkpoint), updated in generation order, so a resumed run shows the cards the uninterrupted one would. The
synchronous sources apply and update it per sampler call (`sources.common.sync_rollout`); async workers per
group, as each group is admitted and scored (under a lock; which groups see which cards then depends on timing,
as everything in that mode), and a batch's stats merge its groups' (`merge_stats`). Stats
per step: `pats_cards` (held after the step), `pats_carded_frac` (rows that saw a card), `pats_added`,
`pats_revised`, `pats_retired`, `pats_too_long` (cards left out: the scaffolded prompt would not fit), and
`pats_reward_carded` / `pats_reward_bare` (mean reward of carded / bare rows of groups that had a card).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from jaxrl_llm.rollout import collect
from jaxrl_llm.tasks import tokenizer as tok


@dataclasses.dataclass(frozen=True)
class PatsSettings:
  """`rollout.pats.*` resolved (`wiring.pats_settings`): the prompt width of scaffolded rows and the card rules."""
  prompt_width: int
  card_frac: float = 0.5
  add_below: float = 1.0
  retire_margin: float = 0.0


@dataclasses.dataclass
class Card:
  best: str
  best_reward: float
  worst: str
  worst_reward: float

  def text(self) -> str:
    return f"{self.best}:{self.best_reward:.1f},{self.worst}:{self.worst_reward:.1f};"


def carded_rows(G: int, frac: float) -> int:
  """Rows of a group that see its prompt's card: round(frac · G), at least 1 and at most G − 1 (both kinds)."""
  return int(min(G - 1, max(1, round(frac * G))))


class Scaffold:
  """The evidence cards of a run, by prompt text (module docstring). Host state only."""

  def __init__(self, settings: PatsSettings):
    self.s = settings
    self.cards: dict[str, Card] = {}
    self._lock = threading.Lock()  # async workers apply and update from their threads

  def apply(self, encoder, p: collect.Prompts, G: int) -> tuple[collect.Prompts, np.ndarray, dict]:
    """(the prompts with cards in front of the first h rows of each carded group, padded to the scaffold's width;
    [B] bool: which rows saw a card; {"pats_too_long": cards left out because the prompt would not fit})."""
    h, W = carded_rows(G, self.s.card_frac), self.s.prompt_width
    texts, carded, too_long = [], np.zeros(len(p.examples), bool), 0
    for g in range(len(p.examples) // G):
      prompt = p.examples[g * G]["prompt"]
      with self._lock:
        card = self.cards.get(prompt)
      fits = card is not None and len(encoder.prompt_ids(card.text() + prompt)) <= W
      too_long += int(card is not None and not fits)
      for i in range(G):
        if fits and i < h:
          texts.append(card.text() + prompt)
          carded[g * G + i] = True
        else:
          texts.append(prompt)
    tokens, lens = encoder.pad_prompts(texts, W)
    return collect.Prompts(tokens, lens, p.examples), carded, {"pats_too_long": too_long}

  def update(self, examples: list[dict], tokens_BN: np.ndarray, reward_B: np.ndarray, carded_B: np.ndarray, G: int,
             tokenizer) -> dict:
    """Adds, revises and retires cards from the scored groups (in row order); the step's stats."""
    with self._lock:
      return self._update(examples, tokens_BN, reward_B, carded_B, G, tokenizer)

  def _update(self, examples, tokens_BN, reward_B, carded_B, G: int, tokenizer) -> dict:
    added = revised = retired = 0
    r_card, r_bare = [], []
    for g in range(len(examples) // G):
      rows = slice(g * G, (g + 1) * G)
      prompt, r, had = examples[g * G]["prompt"], np.asarray(reward_B[rows], np.float64), carded_B[rows]
      texts = [tok.completion_text(tokenizer, t) for t in tokens_BN[rows]]
      best, worst = int(np.argmax(r)), int(np.argmin(r))
      fresh = Card(texts[best], float(r[best]), texts[worst], float(r[worst]))
      card = self.cards.get(prompt)
      if had.any():
        rc, rb = float(r[had].mean()), float(r[~had].mean())
        r_card.append(rc)
        r_bare.append(rb)
        if card is None:  # retired by an earlier group of this call (a staged call holds several steps)
          continue
        if rb >= rc - self.s.retire_margin:
          del self.cards[prompt]
          retired += 1
        elif fresh.best_reward > card.best_reward:
          self.cards[prompt] = fresh
          revised += 1
      elif card is None and r.mean() < self.s.add_below and r[best] > r[worst]:
        self.cards[prompt] = fresh
        added += 1
    return {"pats_cards": len(self.cards), "pats_carded_frac": float(np.mean(carded_B)), "pats_added": added,
            "pats_revised": revised, "pats_retired": retired,
            **({"pats_reward_carded": float(np.mean(r_card)), "pats_reward_bare": float(np.mean(r_bare))}
               if r_card else {})}

  def state(self) -> dict:
    with self._lock:
      return {"cards": [[k, c.best, c.best_reward, c.worst, c.worst_reward] for k, c in self.cards.items()]}

  def restore(self, state: dict | None) -> None:
    self.cards = {} if not state else {str(k): Card(str(b), float(rb), str(w), float(rw))
                                       for k, b, rb, w, rw in state["cards"]}


COUNTS = ("pats_added", "pats_revised", "pats_retired", "pats_too_long")


def merge_stats(stats: list[dict]) -> dict:
  """The Pats stats of a batch of async groups (each group's `update` + `apply` stats): counts summed, the carded
  share and the carded / bare rewards averaged over the groups that have them, the cards held the latest count."""
  out = {k: sum(int(s.get(k, 0)) for s in stats) for k in COUNTS}
  for k in ("pats_carded_frac", "pats_reward_carded", "pats_reward_bare"):
    vals = [float(s[k]) for s in stats if k in s]
    if vals:
      out[k] = float(np.mean(vals))
  out["pats_cards"] = max((int(s.get("pats_cards", 0)) for s in stats), default=0)
  return out
