"""ECHO's cascaded rollout: a critic co-evolving with the policy (Evolving Critic for Hindsight-Guided Optimization).

ECHO (abstract in `../shared/seeds/`; no released code was found) trains a policy and a natural-language critic
together. One step, for each task of the step (`rollout.prompts_per_step / 2` tasks):

  1. the policy answers the task once: the attempt y0, scored r0 by the task's reward;
  2. the critic writes G = `rollout.group_size` diagnoses c_1..c_G of that attempt in hindsight, conditioned on
     `prompt + y0 + ":" + r0 + CRITIC` (the attempt's outcome included, `hindsight`);
  3. the policy refines the attempt once per diagnosis, conditioned on `y0 + ":" + r0 + CRITIC + c_k + RETRY +
     prompt` (the task's prompt last: the policy answers the task in its own format, with the attempt, its
     outcome and the diagnosis as context): y_k, scored r_k.

Dual-track GRPO: the batch holds, per task, the G diagnoses (the critic's track, each row's reward the shaped gain
g_k = `echo_gain(r_k, r0)` its refinement earned) then the G refinements (the policy's track, reward r_k): two
groups of G adjacent rows, so the run's group advantages give each track its own baseline, and the batch keeps
`prompts_per_step × group_size` rows (the mesh's batch sharding and the minibatch rule see nothing new).

[GUESS] where the abstract is silent:
- the critic is the policy's own weights in the critic role (the CRITIC / RETRY markers in the prompt): one
  parameter set, one optimiser, so "synchronized co-evolution" is exact by construction and every learner
  feature (mesh, LoRA, checkpoints, lag) applies to the critic unchanged. The paper may use a separate model;
- the attempt y0 is not trained on (it has no group);
- the critic reads the attempt's reward (rendered with one decimal): hindsight, as the name says; the
  abstract does not say what feedback the critic sees;
- the layout of the two prompts (markers `CRITIC` / `RETRY`, the task's prompt last in a refinement). A first
  layout that appended the retry marker after the diagnosis left the tiny model, which only knows the task's
  format, without a single correct refinement in 150 steps (no reward variance, no gradient on either track);
- saturation-aware gain shaping (`echo_gain`): an improvement is scaled by the headroom the attempt left,
  g = (r_k − r0) / (r_max − r0 + τ), so the same step up counts more from a high-performing attempt; a regression
  is the plain difference r_k − r0. With GRPO's std normalisation a group whose gains all share a sign is
  rescaled back (the scale is per group); the shaping then acts through the asymmetry between gains and
  regressions, and fully with `advantage.std_normalize=False`.

The three sampler calls of a step draw with `fold_in(step key, 1 / 2 / 3)` and pinned parameters, so a step is a
pure function of (seed, version, step): resume and lag behave as for single completions. In `async` a request is
one task (`async_engine.make_echo_rollout`): its three calls with the admitted snapshot, one record of 2G rows, so
a batch of `prompts_per_step` groups holds half as many requests. Rewards of every row
are scored as usual (a diagnosis's own task reward is scored and discarded); the record's stats add
`echo_reward_initial` (mean r0), `echo_reward_refined` (mean r_k), `echo_gain` (mean r_k − r0) and
`echo_improved_frac` (share of refinements with r_k > r0), per step.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxrl_llm.keys import fold_in
from jaxrl_llm.record import Rollout, concat, rows
from jaxrl_llm.rollout import collect, generation
from jaxrl_llm.tasks import tokenizer as tok

CRITIC = ";critic:"  # after the attempt: the critic's turn (characters of the built-in vocabulary)
RETRY = ";retry:"  # after a diagnosis: the policy's refinement


@dataclasses.dataclass(frozen=True)
class EchoSettings:
  """`rollout.echo.*` resolved (`wiring.echo_settings`): the prompt width of diagnosis and refinement rows (the task's
  P + the attempt + the diagnosis + markers by default, `config.echo_width`) and the gain shaping's τ."""
  prompt_width: int
  gain_tau: float = 0.1


def echo_gain(r_B: np.ndarray, r0_B: np.ndarray, tau: float, r_max: float = 1.0) -> np.ndarray:
  """Saturation-aware gain of refinements r over their attempts r0: (r − r0) / (r_max − r0 + τ) where r ≥ r0,
  r − r0 where r < r0 (module docstring, [GUESS])."""
  r, r0 = np.asarray(r_B, np.float64), np.asarray(r0_B, np.float64)
  d = r - r0
  return np.where(d >= 0, d / (np.maximum(r_max - r0, 0.0) + tau), d).astype(np.float32)


def hindsight(reward: float) -> str:
  """What the critic and the refinement see of the attempt's outcome: `:` and its reward with one decimal."""
  return f":{float(reward):.1f}"


def _texts(tokenizer, tokens_BN: np.ndarray) -> list[str]:
  return [tok.completion_text(tokenizer, row) for row in np.asarray(tokens_BN)]


def _encode(gen, texts: list[str], width: int, examples: list[dict]) -> collect.Prompts:
  try:
    tokens, lens = gen.encoder.pad_prompts(texts, width)
  except ValueError:
    longest = max(len(gen.encoder.prompt_ids(t)) for t in texts)
    raise ValueError(f"config.rollout.echo.prompt_width={width}: an ECHO prompt (task + attempt + diagnosis) "
                     f"needs {longest} tokens; raise it (0 = P + 2N + 24)") from None
  return collect.Prompts(tokens, lens, examples)


def cascade(gen, params, examples: list[dict], G: int, key, v_b: int, echo: EchoSettings, sample=None
            ) -> tuple[Rollout, np.ndarray]:
  """(the record of `examples`' tasks, each as its G diagnoses then its G refinements; the attempts' rewards r0 per
  task): the three sampler calls of the module docstring with parameters `params` of version v_b, drawing with
  `fold_in(key, 1 / 2 / 3)`. `sample(prompts, key, group_size) -> (sampler output, row owners)`: how a call samples
  (default `gen.sample`, on the run's sampler mesh; an async worker passes its own)."""
  if sample is None:
    sample = lambda p, k, g: dataclasses.replace(
        gen, sampler_cfg=dataclasses.replace(gen.sampler_cfg, group_size=g)).sample(params, p, k)
  W, enc, m = echo.prompt_width, gen.encoder, len(examples)
  p0 = collect.encode_prompts(examples, gen.width, enc)  # one attempt per task: no shared-prompt groups
  out0, owners0 = sample(p0, fold_in(key, 1), 1)
  attempts = gen.finish(out0, p0.examples, np.full(out0["mask_BN"].shape, v_b, np.int32), owners0)
  seen = [a + hindsight(r) for a, r in zip(_texts(enc.tokenizer, out0["tokens_BN"]), attempts.reward_B)]
  base = [ex["prompt"] + a + CRITIC for ex, a in zip(examples, seen)]
  ex_G = [ex for ex in examples for _ in range(G)]
  pc = _encode(gen, [b for b in base for _ in range(G)], W, ex_G)
  out_c, owners_c = sample(pc, fold_in(key, 2), G)
  diag = _texts(enc.tokenizer, out_c["tokens_BN"])
  refine_texts = [a + CRITIC + d + RETRY + ex["prompt"] for a, d, ex in zip((a for a in seen for _ in range(G)),
                                                                          diag, ex_G)]
  pr = _encode(gen, refine_texts, W, ex_G)
  out_r, owners_r = sample(pr, fold_in(key, 3), G)
  versions = np.full(out_c["mask_BN"].shape, v_b, np.int32)
  critic = gen.finish(out_c, ex_G, versions, owners_c)
  refine = gen.finish(out_r, ex_G, versions, owners_r)
  r0_B = np.repeat(np.asarray(attempts.reward_B, np.float32), G)
  critic = critic.replace(reward_B=echo_gain(refine.reward_B, r0_B, echo.gain_tau))
  parts = [x for i in range(m) for x in (rows(critic, i * G, (i + 1) * G), rows(refine, i * G, (i + 1) * G))]
  # the three calls' reward errors and sampler stats (cache format, speculation, slot-steps): counts summed, per-call
  # values averaged, as several processes' shares are
  calls = [x.stats or {} for x in (attempts, critic, refine)]
  common = set(calls[0]).intersection(*calls[1:])
  stats = generation.join_shares([{k: c[k] for k in common} for c in calls])
  return concat(parts, stats=stats), np.asarray(attempts.reward_B, np.float32)


def task_stats(record: Rollout, r0_m: np.ndarray, G: int) -> dict:
  """The echo metrics of a cascade's record (module docstring) from its refinement rows and the attempts' r0."""
  r = np.asarray(record.reward_B, np.float64).reshape(-1, 2, G)[:, 1]  # [tasks, G] refinement rewards
  r0 = np.asarray(r0_m, np.float64)[:, None]
  return {"echo_reward_initial": float(np.mean(r0)), "echo_reward_refined": float(np.mean(r)),
          "echo_gain": float(np.mean(r - r0)), "echo_improved_frac": float(np.mean(r > r0))}


def merge_stats(stats: list[dict]) -> dict:
  """The echo metrics of a batch of async records (one task each): their means."""
  keys = ("echo_reward_initial", "echo_reward_refined", "echo_gain", "echo_improved_frac")
  return {k: float(np.mean([s[k] for s in stats])) for k in keys if all(k in s for s in stats)}


def echo_rollout(gen, params, steps: list[int], n: int, G: int, v_b: int, call: int, echo: EchoSettings
                 ) -> tuple[Rollout, list[dict], float]:
  """(the record of learner steps `steps`, each step's echo stats, seconds spent sampling and scoring): n/2 tasks
  per step (each a critic group and a policy group, `cascade`), drawn as the step's prompts are."""
  if n % 2:
    raise ValueError(f"ECHO needs an even number of prompts per step (a critic group and a policy group per task), "
                     f"got {n}")
  m = n // 2
  t0 = time.perf_counter()
  examples = gen.step_prompts(steps, m, 1, call).examples
  whole, r0_m = cascade(gen, params, examples, G, gen.step_key(v_b, steps[0], call), v_b, echo)
  time_gen = time.perf_counter() - t0
  per_step = [task_stats(rows(whole, j * 2 * m * G, (j + 1) * 2 * m * G), r0_m[j * m:(j + 1) * m], G)
              for j in range(len(steps))]
  return whole, per_step, time_gen
