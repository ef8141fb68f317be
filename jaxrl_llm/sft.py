"""Teacher-forced SFT warm start on a task's reference answers, and the sequence layout it trains on.

Used by the loop (the student's warm start) and by `distill.teacher` (training an SFT teacher).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_llm import learner
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.rollout import collect
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
  if schedule.steps <= 0:
    return params, float("nan")
  tx = learner.make_optimizer(schedule.lr, grad_clip=1.0, warmup_steps=min(20, schedule.steps // 10))
  opt_state = tx.init(params)
  step_fn = learner.make_sft_step(model_cfg, tx)
  N = schedule.max_new_tokens
  rng = np.random.default_rng([schedule.seed, 11])
  loss = float("nan")
  for _ in range(schedule.steps):
    exs = [train[int(i)] for i in rng.choice(len(train), schedule.batch_size)]
    p = collect.encode_prompts(exs, P, encoder)
    tgt, len_B = encoder.pad_targets([ex["answer"] for ex in exs], N, truncate=True)
    mask_BN = np.arange(N)[None, :] < len_B[:, None]
    seq, pos, seg = full_sequence(p, tgt, mask_BN, encoder.tokenizer.pad_id)
    params, opt_state, loss = step_fn(params, opt_state, seq, pos, seg, jnp.asarray(mask_BN, jnp.float32))
  return params, float(loss)
