"""`sampling.generate`: plain decoding (`sampler.generate`) or speculative decoding (`speculative`), by config.

One jitted entry point for every caller (sources, evaluation, benches count its compilations), so a run turns
speculative decoding on with `sampler.spec_gamma` alone. Here rather than in `sampler.generate` because
`speculative` builds on the sampler's pieces: the sampler must not import it back (no import cycles).
"""

from __future__ import annotations

import functools

import jax

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling import sampler, speculative
from jaxrl_llm.sampling.config import SamplerConfig


@functools.partial(jax.jit, static_argnames=("model_cfg", "sampler_cfg"))
def generate(params: dict, prompt_tokens_BP: jax.Array, prompt_len_B: jax.Array, key: jax.Array,
             model_cfg: ModelConfig, sampler_cfg: SamplerConfig, draft_params: dict | None = None) -> dict:
  """`sampler.generate`'s contract. With `sampler_cfg.spec_gamma` (γ > 0, or "auto" giving γ > 0 for the batch
  size B) speculative decoding (`speculative.generate`): the same fields and distribution (not the same bits for
  a key), plus spec_calls, spec_accept_rate and spec_tokens_per_call. The drafter: `draft_params` (a distilled
  drafter of `spec_draft_layers` layers, `distill.drafter`, or a head, `head_drafter`), or None for the policy's
  first `spec_draft_layers` layers (`speculative.layers_drafter`). Without speculation `draft_params` is ignored."""
  if sampler_cfg.spec_gamma:
    gamma = speculative.gamma_of(sampler_cfg, prompt_tokens_BP.shape[0])
    if gamma:
      draft_params, _ = speculative.resolve_drafter(params, draft_params, model_cfg, sampler_cfg.spec_draft_layers)
      return speculative.generate(params, draft_params, prompt_tokens_BP, prompt_len_B, key, model_cfg, sampler_cfg,
                                  gamma, sampler_cfg.spec_layout)
  return sampler.generate(params, prompt_tokens_BP, prompt_len_B, key, model_cfg, sampler_cfg)
