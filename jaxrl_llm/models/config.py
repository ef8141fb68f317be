"""ModelConfig: the static description of a Llama/Qwen-style decoder.

The config is a frozen (hashable) dataclass so it can be a static argument of `jax.jit`.
A sampler config that differs only in compute dtype is derived with
`dataclasses.replace(cfg, dtype="bfloat16")`.
"""

import dataclasses

import jax.numpy as jnp

from jaxrl_llm import model_fields


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a dense decoder-only transformer.

  Attributes:
    vocab_size: V, number of token ids.
    d_model: D, width of the residual stream.
    n_layers: L, number of decoder layers (stacked on a leading axis of the params).
    n_heads: H, query heads.
    n_kv_heads: K, key/value heads (GQA: each shared by H // K query heads).
    head_dim: hd, width of one attention head.
    d_ff: F, hidden width of the SwiGLU MLP.
    rope_theta: RoPE base frequency.
    rms_eps: RMSNorm epsilon.
    tie_embeddings: the lm-head is `embed.T` (no "lm_head" parameter).
    qk_norm: Qwen3-style RMSNorm over head_dim on q and k before RoPE.
    attn_bias: Qwen2-style biases on the q/k/v projections.
    param_dtype: storage dtype of the parameters created by `init_params`.
    dtype: compute dtype; params are cast to it inside `forward`. Logits are always float32.
    max_seq_len: longest sequence the model is meant for (sizes caches by default).
    init_std: std of the normal initialiser of weight matrices.
    remat: rematerialisation of each layer in the backward pass: False / "none" (store
      activations), True / "full" (recompute everything; `jax.checkpoint`), "dots" (save the
      matmul outputs, recompute the cheap elementwise ops; `checkpoint_dots`). "auto" is a run's setting
      (`model.remat="auto"`, resolved to "none" or "full" by `policy_init.resolve_remat` from
      `jaxrl_llm.memory`'s estimate): a forward refuses it unresolved.
    num_experts: E; 0 = dense SwiGLU MLP, > 0 = a mixture-of-experts MLP in every layer
      (`jaxrl_llm.models.moe`).
    experts_per_token: k, experts each token is routed to (MoE only).
    capacity_factor: expert capacity per batch row, 0 = dropless (see `jaxrl_llm.models.moe`).
    layer_unroll: layers per iteration of the layer scan (`lax.scan(unroll=...)`). 1 keeps one
      compiled layer body (short compiles, the right choice for deep models on accelerators);
      n_layers unrolls fully, which lets XLA schedule across layers: faster for small models on CPU
      (compare rows "M" and "M, layer_unroll=1" in bench/README.md). The same math; XLA may fuse and round
      differently, so results can differ in the last bits (tested to 1e-5).
    decode_unroll: decode loops (`transformer.decode_view`) read each layer's weights and KV cache in place, a
      Python loop over layers compiled into the loop body, instead of going through the layer scan, whose
      per-layer slices XLA:CPU copies at every decode step. Measured on SmolLM2-135M (30 layers, `layer_unroll=1`,
      `python -m bench.decode_unroll`): about a third less time per decode step at batch 16 and 64, for a longer
      first compile at small batches, and a copy of the layer weights for the loop (output-major). False keeps the
      scan (one compiled layer body, no weight copy: the choice for very deep models where compile time dominates,
      or where memory matters more than decode speed). Every cache format decodes either way.
    family: the Hugging Face family the config was read from ("llama", "qwen2", "qwen3"; set by
      `config_from_hf`), None for a model built from config fields (`models.hf.family_for` then names
      the one family that expresses its features). Not compared or hashed: it changes no computation.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  qk_norm: bool = False
  attn_bias: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"
  max_seq_len: int = 2048
  init_std: float = 0.02
  remat: bool | str = False
  num_experts: int = 0
  experts_per_token: int = 2
  capacity_factor: float = 0.0
  layer_unroll: int = 1
  decode_unroll: bool = True
  family: str | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    bad = model_fields.check({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
    if bad is not None:
      name, value, why = bad
      raise ValueError(f"model.{name}={value!r}: {why}")

  @property
  def is_moe(self) -> bool:
    """Whether every layer's MLP is a mixture of experts."""
    return self.num_experts > 0

  @property
  def compute_dtype(self) -> jnp.dtype:
    """The compute dtype as a numpy dtype."""
    return jnp.dtype(self.dtype)

  @property
  def heads_per_kv(self) -> int:
    """H // K, query heads per key/value head (GQA; not a GRPO group: that is `SamplerConfig.group_size`)."""
    return self.n_heads // self.n_kv_heads
