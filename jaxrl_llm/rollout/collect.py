"""Host side of one rollout: prompts -> sampler (pinned snapshot) -> rewards -> advantages -> Batch.

A GRPO group (all completions of one prompt) is generated together by one version, so group
advantages never mix policies.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import advantages
from jaxrl_llm.tasks import tokenizer as tok
from jaxrl_llm.tasks.base import Task
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder
from jaxrl_llm.tasks.reward import RewardPolicy, score_batch

ADVANTAGE_FNS: dict[str, Callable] = {
    "grpo": lambda r, g, n, std: advantages.grpo(r, g, n, std_normalize=std),
    "dr_grpo": lambda r, g, n, std: advantages.dr_grpo(r, g, n),
    "rloo": lambda r, g, n, std: advantages.rloo(r, g, n),
    "reinforce_pp": lambda r, g, n, std: advantages.reinforce_pp(r, g, n),
}


class Prompts(NamedTuple):
  tokens_BP: np.ndarray  # left-padded
  len_B: np.ndarray
  examples: list  # dicts with prompt / answer / example_id


def encode_prompts(examples: list[dict], width: int, encoder: Encoder = CHAR_ENCODER) -> Prompts:
  """The examples' prompts through the run's `Encoder` (raw or chat template), left-padded to `width`."""
  tokens, lens = encoder.pad_prompts([ex["prompt"] for ex in examples], width)
  return Prompts(tokens, lens, examples)


def load_split(task_name: str, split: str, task_kwargs: dict, source: str, data_dir: str | None, seed: int,
               num_train: int = 5000, num_test: int = 500):
  """A random-access grain `MapDataset` of `{"prompt": str, "answer": str, "example_id": int}`.

  `source="tfds"` builds the task's TFDS dataset locally (ArrayRecord) on first use and reads it
  through grain; `source="memory"` generates the identical records in memory.
  """
  import grain
  from jaxrl_llm.tasks import pipeline

  records = pipeline.SOURCES[source](task_name, split, task_kwargs, data_dir=data_dir or None, seed=seed,
                                     num_train=num_train, num_test=num_test)
  text = lambda x: x.decode() if isinstance(x, bytes) else str(x)
  return grain.MapDataset.source(records).map(
      lambda r: {"prompt": text(r["prompt"]), "answer": text(r["answer"]), "example_id": int(r["example_id"])})


def prompts_for_step(train_examples, step: int, n: int, seed: int, width: int, call: int = 0,
                     encoder: Encoder = CHAR_ENCODER) -> Prompts:
  """The prompts of learner step `step` (its sampler call `call`, replay): a pure function of
  (seed, step, call), so resume is exact. Call 0 draws what a step always drew."""
  rng = np.random.default_rng([seed, 7, step] + ([call] if call else []))
  idx = rng.choice(len(train_examples), size=n, replace=len(train_examples) < n)
  return encode_prompts([train_examples[int(i)] for i in idx], width, encoder)


def score_completions(task: Task, examples: list[dict], tokens_BN: np.ndarray,
                      policy: RewardPolicy = RewardPolicy(), *,
                      tokenizer: tok.Tokenizer) -> tuple[np.ndarray, dict, list[str]]:
  """Rewards of completions decoded with `tokenizer` (the sampler's: no default, since ids decoded by another
  tokenizer score as garbage without an error) up to their first stop id, and the counts of `ok` / `error` /
  `timeout` calls: a reward fn that raises, hangs or returns a non-finite or out-of-bound value costs
  that sample (reward 0). `policy`: the run's `reward.*` settings (`loop.reward_policy`); its "auto"
  executor is the task's `reward_executor`, and the task's own `reward_timeout_s` may shorten its limit."""
  texts = [tok.completion_text(tokenizer, row) for row in tokens_BN]
  args = [(ex["prompt"], ex["answer"], t) for ex, t in zip(examples, texts)]
  if task.reward_timeout_s is not None and task.reward_timeout_s < policy.timeout_s:  # one limit: the smaller
    policy = dataclasses.replace(policy, timeout_s=task.reward_timeout_s)
  rb = score_batch(task.reward, args, policy, preferred=task.reward_executor)
  return rb.reward_B.astype(np.float32), rb.counts, texts


def group_advantages(reward_B: np.ndarray, group_size: int, name: str, std_normalize: bool,
                     mask_BN: jax.Array | None = None) -> jax.Array:
  """Advantages of consecutive groups of `group_size` rows: [B], or [B, N] tokens (× mask_BN) when a mask is given."""
  # A numpy array goes to the jitted call as is: an eager jnp.asarray costs more than the whole call.
  return _group_advantages(np.asarray(reward_B, np.float32), group_size, name, std_normalize, mask_BN)


def turn_advantages(reward_B, turn_reward_BK, turn_BN, adv_B, group_size: int, name: str,
                    std_normalize: bool) -> np.ndarray:
  """[B, N] turn-level credit of multi-turn episodes (`advantage.turn_level`): each policy token's advantage with
  its turn's return-to-go G_k = Σ_{j ≥ k} r_j in place of the episode's return R, against the same group baseline:
  A_bt = A_b + (G_{b,k(t)} − R_b) / s_b, with A_b the episode's group advantage (`adv_B`, of estimator `name`)
  and s_b its group's reward std when GRPO normalises by it (else 1). An action gets no credit for rewards that came
  before it; with only a final reward every G_k = R and this is the sequence advantage exactly. Tokens of no turn
  (environment, padding: turn index < 0) get 0."""
  reward_B, turn_reward_BK = np.asarray(reward_B, np.float64), np.asarray(turn_reward_BK, np.float64)
  turn_BN, adv_B = np.asarray(turn_BN), np.asarray(adv_B, np.float64)
  togo_BK = np.cumsum(turn_reward_BK[:, ::-1], axis=1)[:, ::-1]
  togo_BN = np.take_along_axis(togo_BK, np.clip(turn_BN, 0, togo_BK.shape[1] - 1), axis=1)
  delta_BN = togo_BN - reward_B[:, None]
  if name == "grpo" and std_normalize:  # `advantages.grpo`: divided by the group std + eps; a group of equal returns
    std_B = (np.repeat(reward_B.reshape(-1, group_size).std(axis=1, ddof=1), group_size) if group_size > 1
             else np.ones_like(reward_B))  # has no signal (GRPO's 0), so no turn correction either
    delta_BN = np.where(std_B[:, None] > 0, delta_BN / (std_B[:, None] + 1e-6), 0.0)
  return np.where(turn_BN >= 0, adv_B[:, None] + delta_BN, 0.0).astype(np.float32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _group_advantages(reward_B: jax.Array, group_size: int, name: str, std_normalize: bool, mask_BN) -> jax.Array:
  # Jitted: run eagerly, the few dozen small ops cost ~10 ms of host dispatch per learner step.
  B = reward_B.shape[0]
  group_id_B = jnp.arange(B, dtype=jnp.int32) // group_size
  adv_B = ADVANTAGE_FNS[name](reward_B, group_id_B, B // group_size, std_normalize)
  return adv_B if mask_BN is None else adv_B[:, None] * mask_BN
