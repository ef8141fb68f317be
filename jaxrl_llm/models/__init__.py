"""Transformer policy/teacher models: config, params, forward passes, KV cache, chunked log-probs.

`load_hf` / `save_hf` (Hugging Face safetensors import/export) live in `jaxrl_llm.models.hf` and are
imported on first use, so `import jaxrl_llm.models` does not pull in safetensors.
"""

from jaxrl_llm.models.cache import init_cache
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.logprobs import logprobs_from_logits, token_logprobs
from jaxrl_llm.models.transformer import (
    forward,
    forward_with_cache,
    hidden,
    hidden_with_cache,
    hidden_with_routing,
    init_params,
    init_params_per_leaf,
    lm_head_weights,
    logits_from_hidden,
    param_axes,
    param_shapes,
)

_LAZY_HF = ("load_hf", "save_hf")

__all__ = [
    "ModelConfig",
    "forward",
    "forward_with_cache",
    "hidden",
    "hidden_with_cache",
    "hidden_with_routing",
    "init_cache",
    "init_params",
    "init_params_per_leaf",
    "lm_head_weights",
    "logits_from_hidden",
    "logprobs_from_logits",
    "param_axes",
    "param_shapes",
    "token_logprobs",
    *_LAZY_HF,
]


def __getattr__(name):
  # PEP 562 lazy attribute: `from jaxrl_llm.models import load_hf` imports `.hf` only then.
  if name in _LAZY_HF:
    from jaxrl_llm.models import hf
    return getattr(hf, name)
  raise AttributeError(f"module 'jaxrl_llm.models' has no attribute {name!r}")
