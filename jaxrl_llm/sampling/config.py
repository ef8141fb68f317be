"""SamplerConfig: how tokens are drawn (temperature, truncation, stopping)."""

import dataclasses

KV_CACHES = ("full", "int8", "window")
SPEC_LAYOUTS = ("min", "rows")  # = speculative.LAYOUTS (a test pins it)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static sampling settings (hashable: a static argument of the jitted `generate`).

  Attributes:
    max_new_tokens: N, completion width; generation stops earlier once every row hit a stop id.
    stop_ids: every token id that ends a completion (the tokenizer's `stop_ids`: EOS, a chat
      end-of-turn token, ...); the stop token is included in the completion mask. Empty: never stop
      before N.
    temperature: softmax temperature; 0 means greedy (argmax).
    top_k: keep only the k most likely tokens (0 = off).
    top_p: nucleus sampling; keep the smallest set of most likely tokens with mass >= top_p (1 = off).
    pad_id: id written at every position that is not a real token.
    group_size: G, rows per prompt group (GRPO). With G > 1 and rows g·G .. g·G+G-1 holding one
      prompt (`np.repeat(prompts, G, 0)`), the prompt is prefilled once per group and its KV cache
      copied to the G rows (B/G rows of prefill work instead of B). Checked at run time: a batch
      whose groups do not hold equal prompts is prefilled row by row, so the result never depends
      on it beyond rounding. B must be a multiple of G.
    behavior_topk: k > 0 also records μ's k most likely ids at every completion position and their
      log μ (`sampling.record`): `behavior_topk_ids_BNk`, `behavior_topk_logp_BNk` (DPPO's top-k
      divergence, S²D's student candidates). 0 = off.
    mc_samples: J > 0 also records J Monte-Carlo candidates per position (AsyncOPD): column 0 the
      sampled token, columns 1..J-1 drawn i.i.d. from μ with replacement, and log μ at all of them:
      `mc_ids_BNJ`, `mc_behavior_logp_BNJ`. 0 = off. Needs temperature > 0.
    With both 0 `generate` compiles and returns exactly what it does without them; either on leaves
    the sampled tokens unchanged (the candidates draw from their own key stream).
    kv_cache: the decode KV cache: "full" (compute dtype), "int8" (keys/values stored int8 with
      per-token-per-head scales) or "window" (attention sinks + sliding window; `models.cache`). A
      compressed cache makes μ differ from the learner's full-context π (the KV-compression mismatch).
    kv_sinks, kv_window: the "window" cache's sink positions and sliding-window length (its own token
      included); ignored otherwise.
    spec_gamma: speculative decoding (`sampling.speculative`): γ tokens drafted per policy call, 0 = off, "auto" =
      ReSpec's adaptive choice: per call from measured cost (`speculative.GammaTuner`, in `Generation.sample` of a
      one-process run), else by batch size (`speculative.AUTO_GAMMA`). The tokens keep the policy's sampling distribution exactly and μ
      its log-probs; needs spec_draft_layers. Composes with the μ records, every kv_cache and MoE routes.
    spec_draft_layers: k, the drafter is the policy's first k layers (sharing its embedding and head).
    spec_layout: how rows accepting different numbers of drafts share the KV cache (`speculative.LAYOUTS`): "min"
      (every row emits the batch's common minimum per call) or "rows" (each keeps what it accepted; cache holes).
  """

  max_new_tokens: int
  stop_ids: tuple[int, ...] = ()
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  pad_id: int = 0
  group_size: int = 1
  behavior_topk: int = 0
  mc_samples: int = 0
  kv_cache: str = "full"
  kv_sinks: int = 4
  kv_window: int = 64
  spec_gamma: int | str = 0
  spec_draft_layers: int = 0
  spec_layout: str = "min"

  def __post_init__(self):
    try:
      stop = tuple(sorted({int(i) for i in self.stop_ids}))
    except (TypeError, ValueError):
      raise ValueError(f"sampler stop_ids must be a sequence of ints, got {self.stop_ids!r}") from None
    object.__setattr__(self, "stop_ids", stop)  # canonical: equal stop sets hash (and compile) alike
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"sampler.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
    if not self.temperature >= 0:
      raise ValueError(f"sampler.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"sampler.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"sampler.top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.group_size, int) or self.group_size < 1:
      raise ValueError(f"sampler.group_size must be an int >= 1 (1 = no shared prompts), got {self.group_size!r}")
    if not isinstance(self.behavior_topk, int) or self.behavior_topk < 0:
      raise ValueError(f"sampler.behavior_topk must be an int >= 0 (0 = off), got {self.behavior_topk!r}")
    if not isinstance(self.mc_samples, int) or self.mc_samples < 0:
      raise ValueError(f"sampler.mc_samples must be an int >= 0 (0 = off), got {self.mc_samples!r}")
    if self.mc_samples and self.temperature == 0:
      raise ValueError(f"sampler.mc_samples={self.mc_samples} needs temperature > 0: greedy decoding has no "
                       "distribution to draw candidates from")

    if self.kv_cache not in KV_CACHES:
      raise ValueError(f"sampler.kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
    if not isinstance(self.kv_sinks, int) or self.kv_sinks < 0:
      raise ValueError(f"sampler.kv_sinks must be an int >= 0, got {self.kv_sinks!r}")
    if not isinstance(self.kv_window, int) or self.kv_window < 1:
      raise ValueError(f"sampler.kv_window must be an int >= 1 (a token always sees itself), got {self.kv_window!r}")
    self._check_spec()

  def _check_spec(self):
    """`spec_gamma` / `spec_draft_layers` / `spec_layout`: types and values."""
    g, k = self.spec_gamma, self.spec_draft_layers
    if g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or g < 0):
      raise ValueError(f"sampler.spec_gamma must be an int >= 0 (0 = off) or 'auto', got {g!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"sampler.spec_draft_layers must be an int >= 0, got {k!r}")
    if self.spec_layout not in SPEC_LAYOUTS:
      raise ValueError(f"sampler.spec_layout must be one of {SPEC_LAYOUTS}, got {self.spec_layout!r}")
    if g and not k:
      raise ValueError(f"sampler.spec_gamma={g!r} needs sampler.spec_draft_layers >= 1 (the drafter's depth)")

  @property
  def kv_dtype(self) -> str:
    """`models.cache.init_cache`'s kv_dtype: "int8" for the int8 cache, else "compute"."""
    return "int8" if self.kv_cache == "int8" else "compute"

  @property
  def kv_window_arg(self) -> tuple[int, int] | None:
    """(sinks, window) of the "window" cache, None for the others (`models.hidden_with_cache`'s kv_window)."""
    return (self.kv_sinks, self.kv_window) if self.kv_cache == "window" else None

  @property
  def truncated(self) -> bool:
    """Whether top-k or top-p removes tokens from the sampled distribution."""
    return self.top_k > 0 or self.top_p < 1

  @property
  def records(self) -> bool:
    """Whether `generate` records more than the sampled token (μ's top-k or Monte-Carlo candidates)."""
    return self.behavior_topk > 0 or self.mc_samples > 0
