"""Probe for tests/test_async_mesh.py (run it in a process that sees 8 forced CPU devices):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/async_mesh_probe.py WORKDIR [STEPS]

runs `async` with η = 1 on a 6-device learner mesh (data=3 × fsdp=2) and 2 sampler devices of its own,
and prints one JSON object: where a published snapshot lives and whether it equals the learner's
parameters, the same per step of the run (the newest snapshot, read in `on_step`), and the run's rows.
"""

import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxrl_llm import loop, policy_init  # noqa: E402
from test_loop import tiny  # noqa: E402

ETA = 1


def config(steps: int):
  c = tiny(rollout__mode="async", rollout__lag=ETA, rollout__num_workers=2, rollout__sampler_devices=2,
           rollout__prompts_per_step=6, mesh__data=3, mesh__fsdp=2, sampler__dtype="bfloat16")
  c.num_steps, c.eval.every, c.sft.steps = steps, 0, 30  # bf16 sampler: the store also keeps the learner copy
  return c


def devices(tree) -> list[int]:
  return sorted({d.id for x in jax.tree.leaves(tree) for d in x.devices()})


def same(sampler_params, learner_params) -> bool:
  """The sampler copy equals the learner's parameters cast to the sampler's dtype, leaf by leaf."""
  return all(np.array_equal(np.asarray(s), np.asarray(l.astype(s.dtype)))
             for s, l in zip(jax.tree.leaves(sampler_params), jax.tree.leaves(learner_params)))


def main(workdir: str, steps: int) -> None:
  c = config(steps)
  r = loop.setup(c)
  state, _ = loop.fresh_state(r, policy_init.initial_policy(c, r.model_cfg, r.k_init)[1])
  store = loop.new_store(r)
  snap = store.acquire(store.publish(state.params))
  out = {"unit": {"sampler_devices": devices(snap.params), "learner_devices": devices(state.params),
                  "equal": same(snap.params, state.params)}}
  store.release(snap)
  per_step = []

  def on_step(row, store):
    s = store.acquire()
    try:
      per_step.append({"version": s.version, "sampler_devices": devices(s.params),
                       "learner_devices": devices(s.learner_params), "equal": same(s.params, s.learner_params)})
    finally:
      store.release(s)

  out["rows"] = loop.run(c, workdir, on_step=on_step)
  out["per_step"] = per_step
  print("PROBE " + json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
