"""Pats' evidence-card scaffold (`jaxrl_llm.rollout.scaffold`): the card rules by hand, resume, validation."""

import numpy as np
import pytest

from experiments.common import apply_overrides
from jaxrl_llm.config import ConfigError, load_file, validate
from jaxrl_llm.rollout import collect
from jaxrl_llm.rollout.scaffold import Card, PatsSettings, Scaffold, carded_rows
from jaxrl_llm.tasks import tokenizer as tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER

G = 4


def _prompts(texts):
  examples = [{"prompt": t, "answer": "0", "example_id": i} for i, t in enumerate(texts) for _ in range(G)]
  tokens, lens = CHAR_ENCODER.pad_prompts([e["prompt"] for e in examples], 8)
  return collect.Prompts(tokens, lens, examples)


def _completions(texts):
  return tok.pad_right([tok.encode(t) + [tok.eos_id] for t in texts], 4, tok.pad_id)[0]


def test_carded_rows_keep_both_kinds():
  assert [carded_rows(4, f) for f in (0.01, 0.5, 0.99)] == [1, 2, 3]
  assert carded_rows(2, 0.5) == 1


def test_apply_puts_the_card_in_front_of_the_first_rows_of_its_group_only():
  sc = Scaffold(PatsSettings(prompt_width=32))
  sc.cards["3*4="] = Card("12", 1.0, "7", 0.0)
  p, carded, st = sc.apply(CHAR_ENCODER, _prompts(["3*4=", "2*2="]), G)
  text = [tok.decode(row) for row in p.tokens_BP]
  assert text[:4] == ["12:1.0,7:0.0;3*4="] * 2 + ["3*4="] * 2 and text[4:] == ["2*2="] * 4
  assert carded.tolist() == [True, True, False, False] + [False] * 4 and st == {"pats_too_long": 0}
  assert p.tokens_BP.shape == (8, 32) and p.examples[0]["prompt"] == "3*4="  # rewards still see the task's prompt
  # a card that would not fit the width is left out and counted
  narrow = Scaffold(PatsSettings(prompt_width=8))
  narrow.cards = dict(sc.cards)
  _, carded, st = narrow.apply(CHAR_ENCODER, _prompts(["3*4="]), G)
  assert not carded.any() and st == {"pats_too_long": 1}


def test_update_adds_revises_and_retires_by_hand():
  sc = Scaffold(PatsSettings(prompt_width=32, add_below=1.0, retire_margin=0.0))
  no = np.zeros(G, bool)
  # a failing group with differing rewards becomes a card: its best and worst completions
  st = sc.update(_prompts(["3*4="]).examples, _completions(["11", "12", "2", "13"]), np.array([.25, 1., 0., .25]), no,
                 G, tok.CHAR_TOKENIZER)
  assert sc.cards["3*4="] == Card("12", 1.0, "2", 0.0) and st["pats_added"] == 1 and st["pats_cards"] == 1
  # equal rewards carry no evidence; a solved group (mean >= add_below) needs no card
  for r in ([0.0] * 4, [1.0] * 4):
    st = sc.update(_prompts(["2*2="]).examples, _completions(["1"] * 4), np.array(r), no, G, tok.CHAR_TOKENIZER)
    assert st["pats_added"] == 0 and "2*2=" not in sc.cards
  half = np.array([True, True, False, False])
  # carded rows above the bare ones: the card helps and stays; a better best would revise it
  sc.cards["3*4="] = Card("11", 0.25, "2", 0.0)
  st = sc.update(_prompts(["3*4="]).examples, _completions(["12", "11", "5", "6"]), np.array([1., .25, 0., 0.]), half,
                 G, tok.CHAR_TOKENIZER)
  assert st["pats_revised"] == 1 and sc.cards["3*4="] == Card("12", 1.0, "5", 0.0)
  assert st["pats_reward_carded"] == pytest.approx(0.625) and st["pats_reward_bare"] == 0.0
  # bare rows as good as carded ones: the card is redundant and retired
  st = sc.update(_prompts(["3*4="]).examples, _completions(["12"] * 4), np.array([1., 0., 1., 0.]), half, G,
                 tok.CHAR_TOKENIZER)
  assert st["pats_retired"] == 1 and "3*4=" not in sc.cards and st["pats_carded_frac"] == 0.5


def test_state_round_trips_as_plain_data():
  sc = Scaffold(PatsSettings(prompt_width=32))
  sc.cards = {"3*4=": Card("12", 1.0, "2", 0.0), "1*1=": Card("1", 1.0, "", 0.0)}
  import json
  other = Scaffold(PatsSettings(prompt_width=32))
  other.restore(json.loads(json.dumps(sc.state())))
  assert other.cards == sc.cards
  other.restore(None)
  assert other.cards == {}


def _pats_config(**over):
  c = load_file("configs/pats_tiny.py")
  c.log.tensorboard, c.log.progress, c.eval.every = False, False, 0
  return apply_overrides(c, over)


@pytest.mark.parametrize("field,value", [("rollout.pats.card_frac", 1.0), ("rollout.pats.prompt_width", -1),
                                         ("rollout.group_size", 1),
                                         ("rollout.echo.on", True)])
def test_validation_names_the_field(field, value):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    validate(_pats_config(**{field: value}))


def test_shipped_config_resumes_with_its_cards(tmp_path):
  """configs/pats_tiny.py, 6 steps at lag 1, against 3 steps then a resume to 6: the cards travel in the checkpoint,
  so the resumed steps see the cards, draw the tokens and train as the uninterrupted run (a scaffold restarted empty
  changes pats_cards at once). Learner rows are the scaffold's width + N; μ equals the learner's recomputation."""
  from jaxrl_llm import loop
  c = _pats_config(**{"num_steps": 6, "rollout.mode": "fixed_lag", "rollout.lag": 1, "checkpoint.every": 3})
  whole = loop.run(c, str(tmp_path / "whole"))
  loop.run(_pats_config(**{"num_steps": 3, "rollout.mode": "fixed_lag", "rollout.lag": 1, "checkpoint.every": 3}),
           str(tmp_path / "split"))
  resumed = loop.run(c, str(tmp_path / "split"))
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]
  assert strip(resumed) == strip(whole[3:])
  assert whole[2]["pats_cards"] > 0 and any(r["pats_carded_frac"] > 0 for r in whole), whole
  assert all(r["mismatch_abs_max"] < 1e-4 for r in whole)


@pytest.mark.parametrize("slots", [0, 4])
def test_async_workers_scaffold_their_groups(tmp_path, slots):
  """pats_tiny in async mode (η = 1), by the group workers and by the slot worker: cards are made and shown as
  groups are scored, a batch's stats merge its groups', and μ still equals the learner's recomputation on the
  scaffold-wide rows."""
  from jaxrl_llm import loop
  c = _pats_config(**{"num_steps": 8, "rollout.mode": "async", "rollout.lag": 1, "rollout.slots": slots})
  rows = loop.run(c, str(tmp_path))
  assert rows[-1]["pats_cards"] > 0 and sum(r["pats_added"] for r in rows) >= rows[-1]["pats_cards"], rows
  assert any(r["pats_carded_frac"] > 0 for r in rows), rows
  assert all(r["mismatch_abs_max"] < 1e-4 for r in rows), rows
