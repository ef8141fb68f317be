"""The learner's optimiser update on SmolLM2-135M's parameter shapes: in place, against the form it replaced.

  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python -m bench.optimizer_update [--rounds 8]

Both forms apply `learner.make_optimizer(1e-5)`'s transformation (global-norm clip at 1.0, then AdamW) to donated
parameters and moments, given the gradients, and skip the update when a gradient is not finite:
- "select", the train step's form until 2026-12-08: `optax.clip_by_global_norm`, finiteness as `all(isfinite(g))`
  per leaf, the skip as a select of the new state against the old;
- "in place", the train step's now: `learner.clip_by_global_norm` (the same clip as one scale factor),
  finiteness from the gradient norm, the skip as a branch (`learner.update_if`).

The two take turns for `--rounds` calls each (the first compiles); prints one JSON line with each form's median
time after two warm calls, XLA's temporaries, and the bytes the update must at least move (read parameters,
moments and gradients, write parameters and moments) over that time. The parameters are one array per kind of
SmolLM2's weights, stacked over its 30 layers (embedding tied), all fp32.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm import learner

SMOLLM2 = {"embed": (49152, 576), "w_gate": (30, 576, 1536), "w_up": (30, 576, 1536), "w_down": (30, 1536, 576),
           "wq": (30, 576, 9, 64), "wo": (30, 9, 64, 576), "wk": (30, 576, 3, 64), "wv": (30, 576, 3, 64),
           "attn_norm": (30, 576), "mlp_norm": (30, 576), "final_norm": (576,)}


def _select_form(lr: float):
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, b1=0.9, b2=0.98, weight_decay=0.0))

  def update(params, opt_state, grads):
    apply = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    updates, new_opt = tx.update(grads, opt_state, params)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
    return keep(optax.apply_updates(params, updates), params), keep(new_opt, opt_state)

  return update, tx


def _in_place_form(lr: float):
  tx = learner.make_optimizer(lr)

  def update(params, opt_state, grads):
    return learner.update_if(jnp.isfinite(optax.global_norm(grads)), tx, params, opt_state, grads)

  return update, tx


def measure(shapes: dict = SMOLLM2, rounds: int = 8, lr: float = 1e-5, grad_scale: float = 0.01) -> dict:
  """Each form's median seconds per update, XLA temps, and both forms' parameters after one update from the same
  state (`max_abs_diff`). `grad_scale`: every gradient entry (the clip acts when the norm exceeds 1)."""
  forms = {"select": _select_form(lr), "in_place": _in_place_form(lr)}
  params = lambda: {k: jnp.full(s, 0.1, jnp.float32) for k, s in shapes.items()}
  grads = lambda: {k: jnp.full(s, grad_scale, jnp.float32) for k, s in shapes.items()}
  fns = {n: jax.jit(f, donate_argnums=(0, 1)) for n, (f, _) in forms.items()}
  state = {n: (params(), tx.init(params())) for n, (_, tx) in forms.items()}
  out = {"param_bytes": sum(int(np.prod(s)) * 4 for s in shapes.values())}
  out["min_bytes"] = 7 * out["param_bytes"]  # read p, m, v, g; write p, m, v
  times = {n: [] for n in fns}
  first = {}
  for _ in range(rounds):
    for n, fn in fns.items():
      g = jax.block_until_ready(grads())
      t0 = time.perf_counter()
      state[n] = jax.block_until_ready(fn(*state[n], g))
      times[n].append(time.perf_counter() - t0)
      if n not in first:  # a host copy: the next call donates these buffers
        first[n] = jax.tree.map(lambda x: np.array(x, copy=True), state[n][0])
  for n, fn in fns.items():
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (*state[n], grads()))
    out[n] = {"median_s": float(np.median(times[n][2:] if rounds > 2 else times[n])),
              "xla_temp_bytes": fn.lower(*abstract).compile().memory_analysis().temp_size_in_bytes}
    out[n]["min_bytes_per_s"] = out["min_bytes"] / out[n]["median_s"]
  out["max_abs_diff"] = max(float(np.max(np.abs(first["select"][k] - first["in_place"][k]))) for k in shapes)
  out["select_over_in_place"] = out["select"]["median_s"] / out["in_place"]["median_s"]
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=8)
  a = ap.parse_args(argv)
  print(json.dumps(measure(rounds=a.rounds)), flush=True)


if __name__ == "__main__":
  main()
