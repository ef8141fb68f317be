"""docs/losses.md must be the current output of the generator (regenerate: see jaxrl_llm.docs_gen.COMMAND)."""

import pathlib

from jaxrl_llm import docs_gen, losses

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "losses.md"


def test_losses_page_is_current():
  assert PAGE.exists(), f"docs/losses.md is missing; run `{docs_gen.COMMAND}`"
  assert PAGE.read_text(encoding="utf-8") == docs_gen.render(), (
      f"docs/losses.md is stale; run `{docs_gen.COMMAND}`")


def test_page_covers_every_loss_and_its_hparams():
  text = docs_gen.render()
  for name in losses.names():
    spec = losses.get(name)
    assert f"## `{name}`" in text
    for f in spec.Hparams.__dataclass_fields__:
      assert f"`{f}`" in text, (name, f)


def test_field_comments_are_extracted():
  from jaxrl_llm.losses import ppo_clip
  c = docs_gen._field_comments(ppo_clip.Hparams)
  assert c["eps_low"] == "PPO paper."
