"""Shared measurement helpers: wall-clock timing of jitted work, FLOP models, compile counting."""

from __future__ import annotations

import contextlib
import os
import statistics
import resource
import sys
import time
from typing import Any, Callable

import jax

from jaxrl_llm import memory as memory_lib
from jaxrl_llm.models import ModelConfig

# The duration event JAX records once per XLA backend compilation.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compile_count = [0]
_listening = [False]


def block(tree: Any) -> Any:
  """Waits until every array in `tree` is computed (timings must include the device work)."""
  return jax.block_until_ready(tree)


def minor_faults() -> int:
  """Minor page faults of this process so far (each maps one fresh page; see jaxrl_llm/hugepages.py)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_calls(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 3) -> dict:
  """Wall seconds of `fn()` (blocked on its result) after `warmup` untimed calls: best and median,
  and the median minor page faults per call."""
  for _ in range(warmup):
    block(fn())
  times, faults = [], []
  for _ in range(repeats):
    f0, t0 = minor_faults(), time.perf_counter()
    block(fn())
    times.append(time.perf_counter() - t0)
    faults.append(minor_faults() - f0)
  return {"best_s": min(times), "median_s": statistics.median(times), "repeats": repeats,
          "page_faults": statistics.median(faults)}


def in_fresh_process(fn: Callable[..., Any], *args, **kwargs) -> Any:
  """`fn(*args, **kwargs)` run in a fresh Python interpreter (multiprocessing "spawn"), its result sent back.

  Why: a measurement that reports the process's memory or runs after other sections shares their allocator
  state (freed buffers glibc keeps, compiled programs, page mappings). `make bench` measures workload R so,
  as `--only-real` does. `fn`, its arguments and its result must pickle; the child inherits the environment
  (XLA_FLAGS, GLIBC_TUNABLES) and `sys.path`.
  """
  import multiprocessing
  with multiprocessing.get_context("spawn").Pool(1) as pool:
    return pool.apply(fn, args, kwargs)


def log_stderr(line: str) -> None:
  """A `log` callable that pickles (for `in_fresh_process`): the line to stderr."""
  print(line, file=sys.stderr, flush=True)


def _on_duration(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  if event == _COMPILE_EVENT:
    _compile_count[0] += 1


def compile_events() -> int:
  """XLA backend compilations seen in this process since the first call (a monotone counter)."""
  if not _listening[0]:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _listening[0] = True
  return _compile_count[0]


@contextlib.contextmanager
def count_compiles():
  """`with count_compiles() as n: ...` then `n[0]` is the number of XLA compilations inside the block."""
  out = [0]
  start = compile_events()
  try:
    yield out
  finally:
    out[0] = compile_events() - start


def matmul_params(cfg: ModelConfig) -> int:
  """N: parameters that take part in a matmul per token (attention and MLP projections, lm-head).

  The embedding lookup is a gather, not a matmul, so it is left out unless it doubles as the lm-head.
  """
  D, H, K, hd, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  per_layer = D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F  # q, k, v, o, SwiGLU gate/up/down
  return cfg.n_layers * per_layer + D * cfg.vocab_size


def attention_flops_per_token(cfg: ModelConfig, context: int, causal: bool = True) -> float:
  """Forward FLOPs of q·kᵀ and p·v per token at `context` keys (halved when causal, mean over positions)."""
  full = 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
  return full / 2 if causal else full


def train_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
  """Training FLOPs of one step over `batch` × `seq_len` tokens: 6·N·tokens + 3× causal attention."""
  tokens = batch * seq_len
  return tokens * (6.0 * matmul_params(cfg) + 3 * attention_flops_per_token(cfg, seq_len))


def skipped_train_flops(cfg: ModelConfig, batch: int, query_start: int) -> float:
  """Training FLOPs of `train_flops` the learner does not execute: with `query_start` = q0 (the
  prompt positions 0..q0-1 are never scored) the last layer computes no query / attention output /
  MLP and the lm-head no logits there (`models.hidden_with_routing`)."""
  D, H, hd, F, V = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
  per_pos = 6.0 * (2 * D * H * hd + 3 * D * F + D * V)  # q and o projections, SwiGLU, lm-head
  attention = 3 * 4.0 * H * hd * query_start * (query_start + 1) / 2  # causal q·kᵀ and p·v, positions < q0
  return batch * (query_start * per_pos + attention)


def forward_flops(cfg: ModelConfig, tokens: int, context: float, causal: bool = True) -> float:
  """Forward FLOPs of `tokens` tokens each attending to `context` keys: 2·N·tokens + attention."""
  return tokens * (2.0 * matmul_params(cfg) + attention_flops_per_token(cfg, context, causal))


def prefill_flops(cfg: ModelConfig, batch: int, prompt_len: int) -> float:
  """Forward FLOPs of a prefill: every prompt position through the layers, the lm-head on the last one only."""
  head = cfg.d_model * cfg.vocab_size
  body = batch * prompt_len * (2.0 * (matmul_params(cfg) - head) + attention_flops_per_token(cfg, prompt_len))
  return body + batch * 2.0 * head


# Bytes of the parameters / of the KV cache from shapes: the library's estimator (one home for both).
param_bytes, kv_cache_bytes = memory_lib.param_bytes, memory_lib.kv_cache_bytes


def run_header() -> dict:
  """What a profile script records before it measures: the machine (`bench.run.machine_info`: the commit of the code
  that runs, read before it runs, with " (dirty)" for tracked changes) and the load average (1 min)."""
  from bench.run import _git, machine_info
  m = machine_info()
  m["dirty"] = " (dirty)" if _git("status", "--porcelain", "--untracked-files=no") else ""
  return {**m, "load_start": os.getloadavg()[0]}


def measured_line(module: str, argv: list[str] | None, head: dict) -> str:
  """'Measured by `python -m module args` · commit · date · cores · load at start and now · huge pages' for a
  profile written by `module` (`head` from `run_header`; `argv` None: this process's own arguments)."""
  command = " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])
  return (f"Measured by `{command}` · commit {head['commit']}{head['dirty']} · {head['date_utc']} · "
          f"{head['cpu_count']} cores · load average {head['load_start']:.1f} at start, {os.getloadavg()[0]:.1f} at "
          f"end · huge pages {'on' if head['huge_pages'] else 'off'}")


def write_profile(path: str | None, title: str, module: str, argv: list[str] | None, head: dict, body: str) -> None:
  """Prints `body`; with `path`, also writes it there under "## title" and `measured_line`."""
  print(body)
  if path:
    with open(path, "w") as f:
      f.write(f"## {title}\n\n{measured_line(module, argv, head)}\n\n{body}\n")
