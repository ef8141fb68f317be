"""The typed settings a batch source reads: the `rollout.*` fields it needs, resolved once from the run config.

Nothing under `jaxrl_llm.rollout` reads the run config: the loop's setup builds these (`jaxrl_llm.wiring`),
and a test or notebook can build them directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from jaxrl_llm.rollout.cascade import EchoSettings
from jaxrl_llm.rollout.episodes import EnvSettings
from jaxrl_llm.rollout.scaffold import PatsSettings, Scaffold
from jaxrl_llm.rollout.generation import Generation


@dataclasses.dataclass(frozen=True)
class ReplaySettings:
  """`rollout.replay.*` with `fresh_per_step` resolved (0 -> prompts_per_step); see `rollout/replay.py`."""
  capacity: int
  fresh_per_step: int
  reuse_limit: int = 0
  recency: float = 1.0
  stale_policy: str = "keep"
  max_lag: int = -1
  decay: float = 1.0


@dataclasses.dataclass(frozen=True)
class ServeSettings:
  """`serve.*`: the OpenAI-compatible endpoint of `rollout.mode="harness"` (`jaxrl_llm.serve`)."""
  harness: str  # "module:function", called as fn(base_url, episode_id, seed, **harness_kwargs)
  harness_kwargs: dict = dataclasses.field(default_factory=dict)  # `serve.harness_kwargs` (JSON-able)
  concurrency: int = 8
  max_batch: int = 8
  batch_window_s: float = 0.01
  timeout_s: float = 60.0
  max_context: int = 1024
  prompt_width: int = 768
  max_tokens: int = 16
  model_name: str = "jaxrl-policy"
  sandbox: Any = None  # envs.sandbox.Limits for each episode's harness process; None = in-process threads


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """What decides which version generates which batch, and how π_old is scored (`rollout.*`)."""
  mode: str  # the registered batch source of `rollout.mode`
  prompts_per_step: int
  group_size: int
  seed: int
  lag: int = 0  # fixed_lag's k, staged's stage length, async's η
  old_logp: str = "recompute"  # `rollout.old_logp`; "none" when the loss reads no π_old (`config.old_logp_strategy`)
  num_workers: int = 1  # async rollout threads
  partial_chunk: int = 0  # async partial rollouts: decode steps between parameter switches (0 = off)
  prox_in_worker: bool = False  # async + recompute: the workers score π_old
  score_at_switch: bool = False  # ... each version's tokens when a partial rollout switches (interruption route)
  routing_replay: bool = False  # MoE R3: the batch carries the sampler's expert ids
  replay: Optional[ReplaySettings] = None  # experience replay (None = off)
  env: Optional[EnvSettings] = None  # multi-turn episodes in a text environment (None = single completions)
  serve: Optional[ServeSettings] = None  # rollout.mode="harness": the served endpoint (None otherwise)
  echo: Optional[EchoSettings] = None  # ECHO's cascaded rollout with a co-evolving critic (None = off)
  pats: Optional[PatsSettings] = None  # Pats' evidence-card scaffold (None = off)


@dataclasses.dataclass(frozen=True)
class SourceContext:
  """What a batch source is built from (with the run's ParamStore): settings, the generation home, the
  learner's scorer of π_old (`learner.make_score_fn`) and, with Pats, the run's evidence cards (host state the
  loop checkpoints)."""
  settings: RolloutSettings
  gen: Generation
  score: Callable[..., Any]
  scaffold: Optional[Scaffold] = None
