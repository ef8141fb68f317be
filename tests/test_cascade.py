"""ECHO's cascaded rollout (`jaxrl_llm.rollout.cascade`): gain shaping, the record's two tracks, validation, a run."""

import numpy as np
import pytest

from experiments.common import apply_overrides
from jaxrl_llm.config import ConfigError, load_file, validate
from jaxrl_llm.rollout import cascade
from jaxrl_llm.tasks import tokenizer as tok


def _echo_config(**over):
  c = load_file("configs/echo_tiny.py")
  c.log.tensorboard, c.log.progress, c.sft.steps, c.eval.every = False, False, 40, 0
  return apply_overrides(c, over)


def test_saturation_aware_gain_golden():
  """(r − r0) / (1 − r0 + τ) for improvements, r − r0 for regressions, by hand at τ = 0.1."""
  r = np.array([1.0, 0.5, 0.0, 0.2, 1.0])
  r0 = np.array([0.5, 0.5, 0.5, 0.0, 1.0])
  want = [0.5 / 0.6, 0.0, -0.5, 0.2 / 1.1, 0.0]
  np.testing.assert_allclose(cascade.echo_gain(r, r0, 0.1), want, rtol=1e-6)
  # the same step up counts more from a high-performing attempt (saturation-aware)
  lo, hi = cascade.echo_gain(np.array([0.3, 1.0]), np.array([0.0, 0.7]), 0.1)
  assert hi > lo


def test_record_holds_a_critic_group_then_a_policy_group_per_task():
  """Step 0 of echo_tiny: 2 tasks × (4 diagnoses + 4 refinements). A diagnosis row's prompt is the task's prompt,
  the attempt with its reward (hindsight) and the critic marker; the refinement row at the same index is the attempt
  with its reward, the marker, that row's diagnosis, the retry marker and the task's prompt; the diagnosis rows'
  rewards are the shaped gains of their refinements over the attempt, whose reward is re-scored here from the text
  in the prompt."""
  from jaxrl_llm.rollout.sources.common import sync_rollout
  from tests.test_loop import fresh_run
  c = _echo_config()
  r, _, _, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  G, W = c.rollout.group_size, r.ctx.settings.echo.prompt_width
  assert ro.num_rows == c.rollout.prompts_per_step * G and ro.sequence_BT.shape[1] == W + c.sampler.max_new_tokens
  prompt = [tok.decode(row[:W]) for row in ro.sequence_BT]
  completion = [tok.completion_text(tok.CHAR_TOKENIZER, row) for row in ro.sequence_BT[:, W:]]
  for task in range(c.rollout.prompts_per_step // 2):
    crit, ref = range(2 * task * G, (2 * task + 1) * G), range((2 * task + 1) * G, (2 * task + 2) * G)
    base = prompt[crit[0]]
    assert base.endswith(cascade.CRITIC) and all(prompt[i] == base for i in crit)
    task_prompt = base[:-len(cascade.CRITIC)]
    example = next(ex for ex in r.train_examples if task_prompt.startswith(ex["prompt"]))
    attempt, _, shown = task_prompt[len(example["prompt"]):].rpartition(":")
    r0 = r.task.reward(example["prompt"], example["answer"], attempt)
    assert shown == f"{r0:.1f}"  # hindsight: the critic reads the attempt's outcome
    attempt += ":" + shown
    for i, j in zip(crit, ref):
      assert prompt[j] == attempt + cascade.CRITIC + completion[i] + cascade.RETRY + example["prompt"]
      r_j = r.task.reward(example["prompt"], example["answer"], completion[j])
      assert ro.reward_B[j] == pytest.approx(r_j)
      assert ro.reward_B[i] == pytest.approx(float(cascade.echo_gain(np.array([r_j]), np.array([r0]), 0.1)[0]))
  assert np.all(ro.versions_BN == 0) and np.all(ro.group_B == np.arange(ro.num_rows) // G)
  assert ro.stats["echo_reward_refined"] == pytest.approx(float(np.mean(ro.reward_B.reshape(-1, 2, G)[:, 1])))


@pytest.mark.parametrize("field,value,words", [
    ("rollout.prompts_per_step", 3, "even"),
    ("rollout.echo.gain_tau", 0.0, "> 0"),
    ("rollout.echo.prompt_width", -1, ">= 0"),
])
def test_validation_names_the_field(field, value, words):
  c = _echo_config(**{field: value})
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
    validate(c)
  assert words in str(e.value)


def test_prompt_width_too_small_is_a_clear_error(tmp_path):
  from jaxrl_llm import loop
  c = _echo_config(**{"rollout.echo.prompt_width": 8, "num_steps": 1, "sft.steps": 0})
  with pytest.raises(ValueError, match=r"rollout\.echo\.prompt_width=8"):
    loop.run(c, str(tmp_path))


def test_shipped_config_runs_two_steps_with_mu_equal_to_the_learner(tmp_path):
  """configs/echo_tiny.py for 2 steps (fixed_lag 1, so step 1 trains on version-0 rows): both tracks learn in one
  update (a non-zero gradient), the sampler's μ equals the learner's recomputation on the long rows, and the echo
  metrics reach metrics.jsonl."""
  from jaxrl_llm import loop
  c = _echo_config(**{"num_steps": 2, "rollout.mode": "fixed_lag", "rollout.lag": 1})
  rows = loop.run(c, str(tmp_path))
  assert len(rows) == 2 and all(r["mismatch_abs_max"] < 1e-4 for r in rows), rows
  assert any(r["grad_norm"] > 0 for r in rows), rows
  for r in rows:
    assert {"echo_reward_initial", "echo_reward_refined", "echo_gain", "echo_improved_frac"} <= set(r)
    assert r["echo_gain"] == pytest.approx(r["echo_reward_refined"] - r["echo_reward_initial"])


def test_async_echo_requests_are_whole_tasks(tmp_path):
  """echo_tiny in async mode (η = 1, two workers): each request is one task, a record of its 4 diagnoses then its
  4 refinements from one version, so a batch of 4 prompts is 2 records; every lag stays within η, μ equals the
  learner's π_old recomputed at the generating version, and the echo metrics reach the rows."""
  from jaxrl_llm import loop
  c = _echo_config(**{"num_steps": 4, "rollout.mode": "async", "rollout.lag": 1, "rollout.num_workers": 2})
  rows = loop.run(c, str(tmp_path))
  assert all(len(r["request_ids"]) == 2 and r["lag_max"] <= 1 for r in rows), rows
  assert all(r["mismatch_abs_max"] < 1e-4 for r in rows), rows
  assert all(r["echo_gain"] == pytest.approx(r["echo_reward_refined"] - r["echo_reward_initial"]) for r in rows)
  with pytest.raises(ConfigError, match=r"rollout\.partial_chunk"):
    validate(_echo_config(**{"rollout.mode": "async", "rollout.lag": 1, "rollout.partial_chunk": 2}))
  with pytest.raises(ConfigError, match=r"rollout\.slots"):
    validate(_echo_config(**{"rollout.mode": "async", "rollout.lag": 1, "rollout.slots": 4}))
