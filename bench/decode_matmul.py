"""A decode step's weight matmuls as x_MD @ w_DR against the output-major w_RD @ x_DM (`layers.OutIn`).

  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python -m bench.decode_matmul [--batch 1 4 16 64] [--layers 30] [--head]

The dense matmuls of SmolLM2-135M's layers (d 576, query and output 576 × 576, gate / up 576 × 1536, down
1536 × 576; random fp32 weights), chained through every layer with M = batch rows: "rows-major" multiplies the
weights as stored ([in, out], what the learner uses), "output-major" through `layers.project` with `layers.OutIn`
weights (what the decode view holds). Best of 5 after a compiling call, the two taking turns in one process.
Prints one JSON object per batch. `--head` times the vocabulary head instead (SmolLM2's tied embedding, 49,152 ×
576, as `transformer.logits_from_hidden` multiplies it: x @ embedᵀ, or output-major embed @ xᵀ), which sets
`transformer.HEAD_OUT_MAJOR_ROWS`.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from bench import common
from jaxrl_llm.models import layers

D, F, V = 576, 1536, 49152  # SmolLM2-135M


def _chain(weights: list[dict]):
  def run(ws, x):
    for w in ws:
      x = x + layers.project(layers.project(x, w["q"]), w["o"])
      x = x + layers.project(jax.nn.silu(layers.project(x, w["g"])) * layers.project(x, w["u"]), w["d"])
    return x
  return jax.jit(run)


def _best(fn, *args) -> float:
  return common.time_calls(lambda: fn(*args), repeats=5)["best_s"]


def measure(batches: list[int], n_layers: int, d: int = D, f: int = F) -> list[dict]:
  key = jax.random.key(0)
  shapes = {"q": (d, d), "o": (d, d), "g": (d, f), "u": (d, f), "d": (f, d)}
  stored = [{k: jax.random.normal(jax.random.fold_in(key, 10 * i + j), s) * 0.02
             for j, (k, s) in enumerate(shapes.items())} for i in range(n_layers)]
  out_major = [{k: layers.OutIn.of(w) for k, w in ws.items()} for ws in stored]
  flops = 2 * sum(w.size for ws in stored for w in ws.values())
  run = _chain(stored)
  rows = []
  for B in batches:
    x = jax.random.normal(key, (B, d)) * 0.1
    t_rows, t_out = _best(run, stored, x), _best(run, out_major, x)
    diff = float(jnp.max(jnp.abs(run(stored, x) - run(out_major, x))))
    rows.append({"batch": B, "rows_major_ms": round(1e3 * t_rows, 1), "output_major_ms": round(1e3 * t_out, 1),
                 "speedup": round(t_rows / t_out, 2), "output_major_GFLOP_per_s": round(flops * B / t_out / 1e9),
                 "max_abs_diff": diff})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def measure_head(batches: list[int], d: int = D, v: int = V) -> list[dict]:
  """The vocabulary head's product at each batch, rows-major against output-major (`layers.OutIn`)."""
  key = jax.random.key(0)
  embed_VD = jax.random.normal(key, (v, d)) * 0.02
  run = jax.jit(lambda w, x: layers.project(x, w, preferred_element_type=jnp.float32))
  rows = []
  for B in batches:
    x = jax.random.normal(jax.random.fold_in(key, B), (B, d))
    stored, out_major = embed_VD.T, layers.OutIn(embed_VD, (v,))
    t_rows, t_out = _best(run, stored, x), _best(run, out_major, x)
    diff = float(jnp.max(jnp.abs(run(stored, x) - run(out_major, x))))
    rows.append({"batch": B, "head_rows_major_ms": round(1e3 * t_rows, 2),
                 "head_output_major_ms": round(1e3 * t_out, 2), "speedup": round(t_rows / t_out, 2),
                 "max_abs_diff": diff})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
  ap.add_argument("--layers", type=int, default=30)
  ap.add_argument("--head", action="store_true", help="time the vocabulary head instead of the layers")
  a = ap.parse_args()
  if a.head:
    measure_head(a.batch)
  else:
    measure(a.batch, a.layers)


if __name__ == "__main__":
  main()
