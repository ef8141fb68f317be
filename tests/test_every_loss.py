"""Every registered loss trains 2 learner steps from the config that `loss_configs` names for it (on the tiny
model), or is listed as pending with the reason no run provides its inputs yet."""

import math

import pytest

from jaxrl_llm import loop, loss_configs, losses

NAMES = losses.names()


def test_every_loss_has_a_config_or_a_stated_reason():
  no_config = {n for n in NAMES if loss_configs.config_for(n) is None}
  assert no_config == set(loss_configs.PENDING), (
      f"registered without a config that runs them: {sorted(no_config - set(loss_configs.PENDING))}; "
      f"pending but runnable now: {sorted(set(loss_configs.PENDING) - no_config)}")


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
  return tmp_path_factory.mktemp("teachers")


@pytest.mark.parametrize("name", [n for n in NAMES if n not in loss_configs.PENDING])
def test_loss_trains_two_steps_from_its_config(name, teachers, tmp_path):
  f = loss_configs.config_for(name)
  c = loss_configs._load(f).copy_and_resolve_references()  # pylint: disable=protected-access
  c.loss.name = name
  c.num_steps, c.eval.every, c.checkpoint.every = 2, 0, 0
  c.log.tensorboard, c.log.progress = False, False
  if c.get("distill") is not None:  # plumbing needs a teacher, not a good one (cached for the module)
    c.distill.teacher_cache_dir = str(teachers)
    if c.distill.get("teacher_sft_steps"):
      c.distill.teacher_sft_steps = 20
  rows = loop.run(c, str(tmp_path / "run"))
  assert [r["step"] for r in rows] == [0, 1]
  assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
  assert sum(r["updates_applied"] for r in rows) >= 1
