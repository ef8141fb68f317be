"""Physical references of this machine measured with JAX: matmul peak (FLOP/s) and copy bandwidth (B/s)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench import common


def matmul_peak(dtype: str, sizes: tuple[int, ...], repeats: int = 5) -> dict:
  """Best FLOP/s of square matmuls `n×n @ n×n` (2·n³ FLOPs) over `sizes`, best of `repeats` each."""
  mm = jax.jit(jnp.matmul)
  best = {"flops_per_s": 0.0, "n": 0}
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    t = common.time_calls(lambda: mm(a, b), warmup=1, repeats=repeats)
    rate = 2.0 * n ** 3 / t["best_s"]
    if rate > best["flops_per_s"]:
      best = {"flops_per_s": rate, "n": n, "best_s": t["best_s"]}
  return {"dtype": dtype, **best}


def copy_bandwidth(n_floats: int, repeats: int = 3, in_place: bool = True) -> dict:
  """Bytes/s of `x + 1` over `n_floats` float32 (one read and one write per element), written over x (its
  buffer donated) unless `in_place` is False (a fresh output every call, as before 2026-12-07).

  `x + 1` rather than a plain copy: XLA may elide a copy, never an add. In place because a fresh output maps fresh
  pages at every call, so the old reference measured how fast the kernel hands out zeroed pages (it rose with
  glibc's huge pages), not the memory: `python -m bench.peak` measures both, with the page faults per call.
  """
  fn = jax.jit(lambda v: v + 1.0, donate_argnums=0 if in_place else ())
  x = [jnp.zeros((n_floats,), jnp.float32)]

  def call():
    y = fn(x[0])
    if in_place:
      x[0] = y
    return y

  t = common.time_calls(call, warmup=1, repeats=repeats)
  moved = 2 * 4 * n_floats
  return {"bytes_per_s": moved / t["best_s"], "bytes_moved": moved, "best_s": t["best_s"],
          "page_faults": t["page_faults"], "in_place": in_place}


def measure(quick: bool) -> dict:
  """fp32 / bf16 matmul peaks and copy bandwidth (small shapes when `quick`)."""
  fp32_sizes = (128, 256) if quick else (1024, 2048)
  bf16_sizes = (128,) if quick else (1024, 2048)
  return {
      "matmul_fp32": matmul_peak("float32", fp32_sizes),
      "matmul_bf16": matmul_peak("bfloat16", bf16_sizes),
      "copy": copy_bandwidth(1 << 16 if quick else 1 << 25),
  }


def main() -> None:
  """Both copy references, in turn: a fresh output per call against the output written over the input."""
  import json
  for _ in range(3):
    for in_place in (False, True):
      print(json.dumps(copy_bandwidth(1 << 25, in_place=in_place)), flush=True)


if __name__ == "__main__":
  main()
