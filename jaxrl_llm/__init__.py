"""jaxrl_llm: RL and on-policy distillation of language models under asynchrony, in JAX.

Importing the package has no side effects: no device initialisation, no logging or jax config.
Subpackages are imported on use (`jaxrl_llm.losses`, `jaxrl_llm.models`, ...).
"""

__version__ = "0.1.0"
