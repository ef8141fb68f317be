"""Sampling: jitted prefill + decode with temperature / top-k / top-p and behaviour log-probs."""

from jaxrl_llm.sampling.config import SamplerConfig
from jaxrl_llm.sampling.dispatch import generate
from jaxrl_llm.sampling.sample import sample_token
from jaxrl_llm.sampling.sampler import prompt_layout

__all__ = ["SamplerConfig", "generate", "prompt_layout", "sample_token"]
