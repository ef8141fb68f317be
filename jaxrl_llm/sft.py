"""Teacher-forced SFT warm start on a task's reference answers, and the sequence layout it trains on.

Used by the loop (the student's warm start) and by `distill.teacher` (training an SFT teacher).
With an environment (`config.env_on`), the warm start trains on scripted demonstration episodes
(`envs.demos`) laid out exactly as `rollout.episodes.run_episodes` lays out a played episode
(`episode_record`, `episode_batch`): the loss is on the policy's tokens only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_llm import learner, sft_cache
from jaxrl_llm.envs import demos as demos_lib
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.rollout import collect, episodes
from jaxrl_llm.tasks import tokenizer as tok
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder


def full_sequence(p: collect.Prompts, tokens_BN, mask_BN, pad_id: int = tok.pad_id):
  """(sequence, positions, segment ids) of left-padded prompts followed by completions (sampler layout);
  `pad_id` (the tokenizer's) fills every position that is not a real token."""
  P = p.tokens_BP.shape[1]
  N = tokens_BN.shape[1]
  first = P - p.len_B
  col = np.arange(P)
  real = col[None, :] >= first[:, None]
  pos_P = np.where(real, col[None, :] - first[:, None], 0)
  pos_N = p.len_B[:, None] + np.arange(N)[None, :]
  seq = np.concatenate([np.where(real, p.tokens_BP, pad_id), np.where(mask_BN, tokens_BN, pad_id)], 1)
  seg = np.concatenate([real, mask_BN], 1).astype(np.int32)
  return (jnp.asarray(seq, jnp.int32), jnp.asarray(np.concatenate([pos_P, pos_N], 1), jnp.int32), jnp.asarray(seg))


@dataclasses.dataclass(frozen=True)
class SftSchedule:
  """What an SFT run does: `steps` AdamW steps of `batch_size` examples at `lr`, targets cut at
  `max_new_tokens`, examples drawn by `seed`."""
  steps: int
  batch_size: int
  lr: float
  max_new_tokens: int
  seed: int

  @classmethod
  def from_config(cls, c, steps: int | None = None) -> "SftSchedule":
    """The run's schedule (`sft.*`, `sampler.max_new_tokens`, `seed`); `steps` overrides `sft.steps`
    (an SFT teacher trains `distill.teacher_sft_steps`)."""
    return cls(steps=c.sft.steps if steps is None else steps, batch_size=c.sft.batch_size, lr=c.sft.lr,
               max_new_tokens=c.sampler.max_new_tokens, seed=c.seed)


def sft_warm_start(schedule: SftSchedule, model_cfg: ModelConfig, params, train, P: int,
                   encoder: Encoder = CHAR_ENCODER) -> tuple[Any, float]:
  """Teacher-forced SFT on reference answers so the policy starts with non-zero accuracy; prompts and
  targets (answer + EOS, or the chat end-of-turn id) through the run's `encoder`, cut at N tokens."""
  N = schedule.max_new_tokens

  def batches():
    rng = np.random.default_rng([schedule.seed, 11])
    for _ in range(schedule.steps):
      exs = [train[int(i)] for i in rng.choice(len(train), schedule.batch_size)]
      p = collect.encode_prompts(exs, P, encoder)
      tgt, len_B = encoder.pad_targets([ex["answer"] for ex in exs], N, truncate=True)
      mask_BN = np.arange(N)[None, :] < len_B[:, None]
      seq, pos, seg = full_sequence(p, tgt, mask_BN, encoder.tokenizer.pad_id)
      yield seq, pos, seg, jnp.asarray(mask_BN, jnp.float32)

  return _sft(schedule, model_cfg, params, batches)


def _sft(schedule: SftSchedule, model_cfg: ModelConfig, params, batches) -> tuple[Any, float]:
  """`schedule.steps` AdamW steps of `learner.make_sft_step` over `batches()` (a fresh iterator of
  (sequence, positions, segment ids, mask) per call); the result is read from `sft_cache` when an earlier
  run computed it from the same inputs."""
  if schedule.steps <= 0:
    return params, float("nan")

  def train():
    tx = learner.make_optimizer(schedule.lr, grad_clip=1.0, warmup_steps=min(20, schedule.steps // 10))
    step_fn = learner.make_sft_step(model_cfg, tx)
    state, opt_state, loss = params, tx.init(params), float("nan")
    for batch in batches():
      state, opt_state, loss = step_fn(state, opt_state, *batch)
    return state, float(loss)

  return sft_cache.cached(sft_cache.settings_of(model_cfg, schedule), params, batches(), train)


def episode_record(encoder: Encoder, first: str, steps, max_turns: int,
                   N: int) -> tuple[list[int], list[int], list[int]]:
  """(prompt ids, response ids, policy mask) of one demonstration episode as `run_episodes` packs it.

  `steps`: `(action_text, observation_text)` pairs (`envs.demos`). Each turn appends the action's ids
  and the stop id (`encoder.target_ids`: EOS for the char tokenizer; mask 1), then the observation
  (`episodes.render_env_message`; mask 0) unless nothing follows it (the last step played, or turn
  `max_turns`), as the runner does. The runner's budget rule too: a turn cut by the budget N ends the
  record there (its policy tokens kept), an observation that leaves no room for a further policy
  token ends it before the observation.
  """
  resp, mask = [], []
  for t, (act, obs) in enumerate(steps[:max_turns]):
    ids = encoder.target_ids(act)
    k = min(len(ids), N - len(resp))
    resp += ids[:k]
    mask += [1] * k
    if k < len(ids) or t == len(steps) - 1 or t == max_turns - 1:
      break
    env_ids = episodes.render_env_message(encoder, obs)
    if len(resp) + len(env_ids) >= N:
      break
    resp += env_ids
    mask += [0] * len(env_ids)
  return encoder.episode_prompt_ids(first), resp, mask


def episode_batch(records, P: int, N: int, pad_id: int):
  """(sequence_BT, positions_BT, segment_ids_BT, mask_BN) of `episode_record`s in the record layout of
  `run_episodes`: prompts left-padded to P, responses compact and right-padded to N, positions counting
  from the first real prompt token, segment 1 on every real token (`episodes.record_layout`)."""
  prompt_BP, plen_B = tok.pad_left([r[0] for r in records], P, pad_id)
  resp_BN, used_B = tok.pad_right([r[1] for r in records], N, pad_id)
  mask_BN, _ = tok.pad_right([r[2] for r in records], N, 0)
  positions_BT, segment_ids_BT = episodes.record_layout(plen_B, used_B, P, N)
  return (jnp.asarray(np.concatenate([prompt_BP, resp_BN], 1), jnp.int32), jnp.asarray(positions_BT),
          jnp.asarray(segment_ids_BT), jnp.asarray(mask_BN, jnp.float32))


def demo_seeds(seed: int, n: int) -> list[int]:
  """The environment seeds of a run's n demonstration episodes: a stream of their own (not the training
  seeds' `episodes.episode_seeds`; evaluation seeds are >= 2**31, outside both)."""
  rng = np.random.default_rng([seed, 0xDE305])
  return [int(s) for s in rng.integers(0, 2**31 - 1, size=n)]


def demo_records(encoder: Encoder, settings: episodes.EnvSettings, player: str, n: int, seed: int) -> list:
  """`episode_record`s of n demonstration episodes of the scripted `player` in the run's environment."""
  eps = demos_lib.demo_episodes(settings.name, dict(settings.kwargs), player, demo_seeds(seed, n), settings.max_turns)
  N = settings.max_episode_tokens
  return [episode_record(encoder, first, steps, settings.max_turns, N) for first, steps in eps]


def sft_on_demos(schedule: SftSchedule, model_cfg: ModelConfig, params, records, P: int, N: int,
                 encoder: Encoder = CHAR_ENCODER) -> tuple[Any, float]:
  """Teacher-forced SFT on demonstration episodes (`demo_records`): `schedule.steps` AdamW steps, each on
  `schedule.batch_size` records drawn with replacement by `schedule.seed`; the loss (`learner.make_sft_step`)
  is the mean NLL of the policy tokens only (environment tokens are context)."""

  def batches():
    rng = np.random.default_rng([schedule.seed, 12])
    for _ in range(schedule.steps):
      yield episode_batch([records[int(i)] for i in rng.choice(len(records), schedule.batch_size)], P, N,
                          encoder.tokenizer.pad_id)

  return _sft(schedule, model_cfg, params, batches)
