"""Held-out multi-turn evaluation: greedy episodes of the current policy on seeds no training episode uses.

`evaluate_episodes` plays n episodes (G = 1, temperature 0: `wiring.sampler_config(c, greedy=True)`)
through the same runner as training (`rollout.episodes.run_episodes`) on the seeds `eval_seeds(n)` =
2**31 + i: training seeds (`episodes.episode_seeds`) and demonstration seeds (`sft.demo_seeds`) are drawn
below 2**31 - 1, so the sets are disjoint, and every run (any seed) is evaluated on the same episodes.
Metrics: `eval_episode_success` (fraction of episodes with return >= 1) and `eval_episode_turns`
(mean turns played).

`evaluate_run` is what the loop calls: single-turn runs get `eval_accuracy` (`wiring.evaluate`);
runs with an environment get the two episode metrics and `eval_accuracy` = `eval_episode_success`, so
the keep-best checkpoint, the summaries of `experiments.common` and the report read episode success
where they read accuracy. The episode count is `eval.num_prompts`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm.rollout import episodes
from jaxrl_llm.wiring import Run, env_settings, evaluate, sampler_config

EVAL_SEED_BASE = 2**31  # above every training and demonstration seed (drawn in [0, 2**31 - 1))


def eval_seeds(n: int) -> list[int]:
  """The seeds of n held-out evaluation episodes (module docstring)."""
  return [EVAL_SEED_BASE + i for i in range(n)]


def evaluate_episodes(r: Run, params, n: int) -> dict:
  """{"eval_episode_success", "eval_episode_turns"} of n greedy episodes with the learner's `params`
  (its model config, as `wiring.evaluate` uses) on `eval_seeds(n)`, sampling key `r.k_eval`."""
  c, s = r.c, env_settings(r.c)
  gen = dataclasses.replace(r.ctx.gen, model_cfg=r.model_cfg, sampler_cfg=sampler_config(c, True, r.encoder.tokenizer))
  ro = episodes.run_episodes(gen, params, eval_seeds(n), 1, s, r.k_eval, version=0, width=s.prompt_width)
  return {"eval_episode_success": float(np.mean(np.asarray(ro.reward_B) >= 1.0)),
          "eval_episode_turns": float(ro.stats["env_turns_mean"])}


def evaluate_run(r: Run, params) -> dict:
  """The run's held-out metrics (module docstring): `eval_accuracy`, plus the episode metrics with an env."""
  c = r.c
  if not config_lib.env_on(c):
    return {"eval_accuracy": evaluate(params, r.model_cfg, c, r.test, r.task, r.k_eval, r.encoder.tokenizer, r.mesh)}
  out = evaluate_episodes(r, params, c.eval.num_prompts)
  return {"eval_accuracy": out["eval_episode_success"], **out}
