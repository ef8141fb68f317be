"""Bytes of one training step from shapes, and the `model.remat="auto"` decision built on them.

One estimator for the library and the benchmarks (`bench/grpo_real.py` reports its phases against
`phase_bytes(..., whole_logits=True)`). Everything is counted from the model's parameter layout
(`models.param_shapes`) and the step's shapes (`StepShape`); nothing is compiled or allocated.

A step holds, besides the runtime itself:
  resident   the policy (base + adapters for LoRA), its frozen copies (reference, EWMA proximal), the AdamW
             moments of what is trained (LoRA: the adapters only), and the sampler's published copy;
  prefill /  the sampler's KV cache of the step's rows and the decode view's output-major copy of the dense
  decode     weights (`decode_view_bytes`; none with `model.decode_unroll=False`); decode adds one position's logits;
  reference  the scorer's lm-head chunk (reference / π_old scoring; `models.token_logprobs` forms
             [B, C, V] logits C positions at a time, `vocab_chunks.chunk_positions`);
  train      gradients + the activations the backward keeps at the learner's micro-batch, which depend
             on `model.remat` (`activation_bytes`), + the scorer's chunk (the reference is scored inside
             the train step, `learner.fuse_reference`).
`step`, what `model.remat="auto"` compares with the budget, is `train` with its gradients + activations scaled by
`XLA_TEMP_FACTOR[remat]` (what the shape count leaves out, measured per mode) plus the sampler's KV cache and decode
view: in the async modes the sampler decodes while the learner trains, and a sync run that frees them first only gets
a margin. The phases are an estimate, meant to decide "does a step fit" with room, not to size a heap.

`model.remat="auto"` (`choose_remat`): the first mode of the platform's speed order (`REMAT_ORDER`) whose step fits
the budget, "full" (each layer recomputed, the smallest) when none does. The budget is `model.memory_budget_gb`, or
from the machine (`machine_budget_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import ModelConfig, param_shapes
from jaxrl_llm.models.lora import dims as lora_dims
from jaxrl_llm.models.transformer import decode_view_copies
from jaxrl_llm.vocab_chunks import chunk_positions

GB = 1e9  # model.memory_budget_gb and the logged numbers are decimal gigabytes
# Positions per lm-head chunk the learner and the scorers ask for (`models.token_logprobs`' default
# chunk_size; a test pins the two together). `chunk_positions` caps it at 2^22 logits per chunk.
LM_HEAD_CHUNK = 256
# Share of the host's available memory a CPU run may plan for: the process also holds the Python runtime,
# XLA's compiled programs and their temporaries, the task data and the sampler's host buffers, none of which
# the estimate counts, and other processes may grow while the run starts.
HOST_MEMORY_FRACTION = 0.8
# XLA's temporaries of a learner step over the gradients + activations `activation_bytes` counts, by remat mode.
# Without recomputation the residuals of the norms, SiLU and the softmax input, the backward's cotangents and the
# optimizer's update are not in the shape count; "dots" recomputes those from the matmul outputs it keeps.
# Measured on XLA:CPU, SmolLM2-135M (fp32, AdamW, ppo_clip), 32 x (32 + 256) tokens, at ba8b5ba (the update in
# place): 22.8 GiB of temps without recomputation (1.90x the 12.0 GiB counted), 9.7 GiB with "dots" (0.95x of
# 10.2 GiB) and 1.99 GiB with "full" (1.24x of 1.60 GiB); "dots" and "full" are given a margin. Before the update
# ran in place, "full" was 2.78 GiB (1.74x). Command (one --remat each):
#   JAX_PLATFORMS=cpu python -m bench.real_model_memory --what learner --compile-only --max-gib 200 --remat none
XLA_TEMP_FACTOR = {"none": 2.0, "dots": 1.25, "full": 1.5}


def _itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def _norm_remat(remat) -> str:
  """False/True -> "none"/"full"; the strings as they are."""
  return {False: "none", True: "full"}.get(remat, remat) if isinstance(remat, bool) else remat


# ----------------------------------------------------------------------------- shapes


def param_count(cfg: ModelConfig) -> int:
  """Elements of all parameters (embedding, every layer, final norm, untied lm-head)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(cfg)))


def param_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
  """Bytes of all parameters (embedding included) at `dtype_bytes` per element."""
  return dtype_bytes * param_count(cfg)


def kv_cache_bytes(cfg: ModelConfig, batch: int, length: int, dtype_bytes: int) -> int:
  """Bytes of the K and V caches of every layer for `batch` rows of `length` positions."""
  return dtype_bytes * 2 * cfg.n_layers * batch * length * cfg.n_kv_heads * cfg.head_dim


def decode_view_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
  """Bytes of the weight copies a sampling call holds while it runs: the unstacked decode view's output-major
  dense projections of every layer, and an untied head (`transformer.unstack_layers`, `model.decode_unroll`,
  the default: a faster decode step for one more copy of those weights); 0 through the layer scan."""
  if not cfg.decode_unroll:
    return 0
  shapes = param_shapes(cfg)
  copied = [shapes["layers"][name] for name in decode_view_copies(cfg)]
  if not cfg.tie_embeddings:
    copied.append(shapes["lm_head"])
  return dtype_bytes * sum(math.prod(s.shape) for s in copied)


def lora_param_count(cfg: ModelConfig, rank: int, weights: tuple[str, ...]) -> int:
  """Elements of the LoRA adapters (fp32: A [L, r, in] and B [L, out, r] per target weight)."""
  return sum(cfg.n_layers * rank * sum(lora_dims(cfg, w)) for w in weights)


def _layer_floats(cfg: ModelConfig, T: int) -> dict:
  """Per token and layer: what the backward keeps of one layer under each remat mode (floats).

  all:   the layer input, both norm outputs and the o-projection output (4·D), q and the attention
         output (2·H·hd), k and v (2·K·hd), gate, up and their product (3·F), the attention probabilities (H·T);
  dots:  the matmul outputs only (`checkpoint_dots`): q, k, v, the scores, the attention output, the
         o-projection, gate, up and down, plus the layer input (the scan's carry);
  input: the layer input alone ("full": everything else is recomputed, one layer at a time).
  """
  D, F, H, K, hd = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  return {"all": 4 * D + 2 * H * hd + 2 * K * hd + 3 * F + H * T,
          "dots": 3 * D + 2 * H * hd + 2 * K * hd + 2 * F + H * T,
          "input": D}


# remat mode -> (what each of the L layers keeps, whether one layer's full set is recomputed on top)
_KEEPS = {"none": ("all", False), "dots": ("dots", True), "full": ("input", True)}


def activation_bytes(cfg: ModelConfig, B: int, T: int, remat, N: int, *, head_positions: int | None = None,
                     lora_weights: tuple[str, ...] = ()) -> int:
  """Bytes the backward pass keeps from the forward of B rows of T tokens (N of them scored), from shapes.

  Layers: per token, `_layer_floats` under `remat` (False/"none", "dots", True/"full"), in the compute dtype;
  a recomputing mode adds one layer's full set while it recomputes. LoRA (`lora_weights`): each layer's merged
  target weights are kept like activations (the backward of x @ W needs W). The lm-head: fp32 logits and their
  gradient over `head_positions` positions per row at once: the chunk `models.token_logprobs` forms
  (`chunk_positions`, the default), or N for a head that forms all [B, N, V] logits.
  """
  mode = _norm_remat(remat)
  if mode not in _KEEPS:
    raise ValueError(f"remat={remat!r}: must be one of False, True, {', '.join(_KEEPS)} (resolve 'auto' first)")
  kept, recomputes = _KEEPS[mode]
  floats = _layer_floats(cfg, T)
  per_token = cfg.n_layers * floats[kept] + (floats["all"] if recomputes else 0)
  merged = sum(math.prod(lora_dims(cfg, w)) for w in lora_weights)
  per_step = (cfg.n_layers if kept != "input" else 1) * merged if merged else 0
  C = chunk_positions(B, N, cfg.vocab_size, LM_HEAD_CHUNK) if head_positions is None else head_positions
  return _itemsize(cfg.dtype) * (B * T * per_token + per_step) + 4 * 2 * B * C * cfg.vocab_size


# ----------------------------------------------------------------------------- one step


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What one training step holds besides the model's shapes.

  rows: B, sequences per step (prompts × group size): the sampler's batch and the scorer's.
  prompt, new: P and N; the learner's rows are T = P + N tokens, N of them scored.
  micro_rows: rows of one learner forward/backward (B / grad_accum / minibatches).
  frozen_copies: resident copies of the (base) weights besides the policy: the reference, the EWMA proximal.
  lora_rank, lora_weights: LoRA adapters (rank 0: full fine-tuning); only they get gradients and moments.
  sampler_dtype: dtype of the sampler's weights and KV cache.
  sampler_copy: the ParamStore holds a published copy of the weights at `sampler_dtype` (a run: yes).
  """
  rows: int
  prompt: int
  new: int
  micro_rows: int
  frozen_copies: int = 0
  lora_rank: int = 0
  lora_weights: tuple[str, ...] = ()
  sampler_dtype: str = "float32"
  sampler_copy: bool = True


def phase_bytes(cfg: ModelConfig, shape: StepShape, remat, *, whole_logits: bool = False) -> dict:
  """Bytes each phase of one step needs (module docstring): resident state plus what the phase adds.

  Keys: params (the policy's weights), resident, prefill, decode, reference, train, step, and the parts
  (kv_cache, score_logits, gradients, activations). `whole_logits`: count the scorer's and the learner's
  logits as whole [B, N, V] arrays instead of the lm-head chunk (the bench's bound of its phases).
  """
  B, T, N, V = shape.rows, shape.prompt + shape.new, shape.new, cfg.vocab_size
  params = param_bytes(cfg, _itemsize(cfg.param_dtype))
  adapters = 4 * lora_param_count(cfg, shape.lora_rank, shape.lora_weights) if shape.lora_rank else 0
  trained = adapters or params
  resident = params + adapters + shape.frozen_copies * params + 2 * trained  # + AdamW m and v
  if shape.sampler_copy:
    resident += param_bytes(cfg, _itemsize(shape.sampler_dtype))
  kv = kv_cache_bytes(cfg, B, T, _itemsize(shape.sampler_dtype))
  view = decode_view_bytes(cfg, _itemsize(shape.sampler_dtype))  # while sampling, beside the KV cache
  score_logits = 4 * B * V * (N if whole_logits else chunk_positions(B, N, V, LM_HEAD_CHUNK))
  acts = activation_bytes(cfg, shape.micro_rows, T, remat, N, head_positions=N if whole_logits else None,
                          lora_weights=shape.lora_weights if shape.lora_rank else ())
  train = resident + trained + score_logits + acts
  return {"params": params, "resident": resident, "prefill": resident + kv + view,
          "decode": resident + kv + view + 4 * B * V, "reference": resident + score_logits, "train": train,
          "step": train + kv + view + math.ceil((XLA_TEMP_FACTOR[_norm_remat(remat)] - 1) * (trained + acts)),
          "kv_cache": kv, "decode_view": view, "score_logits": score_logits, "gradients": trained,
          "activations": acts}


def step_bytes(cfg: ModelConfig, shape: StepShape, remat) -> int:
  """The estimated peak of one step: `phase_bytes(...)["step"]`."""
  return phase_bytes(cfg, shape, remat)["step"]


# ----------------------------------------------------------------------------- budget and the auto decision


def host_available_bytes() -> int:
  """The host's available physical memory: /proc/meminfo MemAvailable (page cache counts as available),
  else free pages (`os.sysconf`)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return 1024 * int(line.split()[1])
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine_budget_bytes() -> int:
  """Memory one device may plan for: the accelerator's allocator limit (`memory_stats()["bytes_limit"]`),
  else `HOST_MEMORY_FRACTION` of the host's available memory shared by the local devices (CPU). Several
  processes take the smallest of theirs: all must decide alike, since they run one SPMD program."""
  devices = jax.local_devices()
  try:
    stats = devices[0].memory_stats() or {}
  except (RuntimeError, NotImplementedError):  # a backend without allocator statistics
    stats = {}
  if stats.get("bytes_limit"):
    budget = int(stats["bytes_limit"])
  else:
    budget = int(HOST_MEMORY_FRACTION * host_available_bytes() / len(devices))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    budget = int(np.min(multihost_utils.process_allgather(np.array([budget], np.int64))))
  return budget


def budget_bytes(memory_budget_gb: float) -> int:
  """`model.memory_budget_gb` in bytes; 0 = from the machine (`machine_budget_bytes`)."""
  return int(memory_budget_gb * GB) if memory_budget_gb > 0 else machine_budget_bytes()


# The modes `model.remat="auto"` tries, fastest first, by platform (`jax.default_backend()`); it takes the first whose
# step fits. cpu: measured in the GRPO loop (workload R_small on SmolLM2-135M, each mode's step taking turns,
# bench/profiles/R_small_remat_loop.md): "full" and "dots" level, "none" 0.84x. Timed back to back, without the
# sampling between them, the train step alone ranks "dots" first (bench/profiles/R_small_remat.md); the loop is what
# a run does. Other platforms: not measured here (bench/gpu.sh runs bench.remat); the usual order, least
# recomputation first.
REMAT_ORDER = {"cpu": ("full", "dots", "none")}
REMAT_ORDER_DEFAULT = ("none", "dots", "full")


def remat_order(platform: str) -> tuple[str, ...]:
  """The modes "auto" tries on `platform`, fastest first (`REMAT_ORDER`)."""
  return REMAT_ORDER.get(platform, REMAT_ORDER_DEFAULT)


@dataclasses.dataclass(frozen=True)
class RematChoice:
  """The `model.remat="auto"` decision: the mode, the order it was chosen by, the estimated step of each mode, the
  budget."""
  remat: str
  order: tuple[str, ...]
  estimates: dict  # mode -> bytes of one step (`step_bytes`)
  budget_bytes: int

  def line(self) -> str:
    """What the run prints once at setup."""
    est = ", ".join(f"{m} {self.estimates[m] / GB:.3g} GB" for m in self.order)
    return (f"remat_auto -> {self.remat} (est. {self.estimates[self.remat] / GB:.3g} GB of "
            f"{self.budget_bytes / GB:.3g} GB budget; fastest first: {est})")

  def record(self) -> dict:
    """Plain data for run_info.json."""
    return {"remat": self.remat, "order": list(self.order), "budget_gb": self.budget_bytes / GB,
            "estimate_gb": {m: self.estimates[m] / GB for m in self.order}}


def choose_remat(cfg: ModelConfig, shape: StepShape, budget: int, platform: str | None = None) -> RematChoice:
  """The first mode of `remat_order(platform)` (default: this process's backend) whose step fits `budget` bytes;
  "full" (layer-wise, the smallest) when none does."""
  order = remat_order(platform or jax.default_backend())
  estimates = {m: step_bytes(cfg, shape, m) for m in order}
  mode = next((m for m in order if estimates[m] <= budget), "full")
  return RematChoice(mode, order, estimates, budget)
