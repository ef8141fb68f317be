"""Multi-host start-up: `jax.distributed` from arguments (config) or the environment.

One process per host (one per GPU, or per TPU VM worker) runs the same program; after
`maybe_initialize`, `jax.devices()` lists every device of every process and a mesh built from them
(`jaxrl_llm.sharding.make_mesh`) spans hosts. Single-process runs (no coordinator anywhere) skip it.

Sources, first found wins, per field:
  coordinator    argument, else $JAX_COORDINATOR_ADDRESS   ("host:port" of process 0)
  num_processes  argument, else $JAX_NUM_PROCESSES
  process_id     argument, else $JAX_PROCESS_ID
With `auto=True` and no coordinator, `jax.distributed.initialize()` is called without arguments and
detects the cluster itself (TPU pod slices, SLURM, Open MPI, Kubernetes).

This module only reads the environment when called: importing it has no side effects.
"""

from __future__ import annotations

import os

import jax

ENV_VARS = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
            "process_id": "JAX_PROCESS_ID"}


def settings(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
             environ=None) -> dict:
  """The resolved {coordinator, num_processes, process_id} (None where neither source gives one)."""
  environ = os.environ if environ is None else environ
  given = {"coordinator": coordinator or None, "num_processes": num_processes, "process_id": process_id}
  out = {}
  for field, value in given.items():
    if value is None and environ.get(ENV_VARS[field]):
      value = environ[ENV_VARS[field]]
      value = value if field == "coordinator" else int(value)
    out[field] = value
  if out["coordinator"] is not None and (out["num_processes"] is None or out["process_id"] is None):
    raise ValueError(f"distributed: coordinator {out['coordinator']!r} given but num_processes={out['num_processes']} "
                     f"process_id={out['process_id']}: set both (arguments or ${ENV_VARS['num_processes']}, "
                     f"${ENV_VARS['process_id']})")
  if out["num_processes"] is not None and out["process_id"] is not None and not 0 <= out["process_id"] < out["num_processes"]:
    raise ValueError(f"distributed: process_id={out['process_id']} must be in [0, num_processes={out['num_processes']})")
  return out


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                     *, auto: bool = False, cpu_collectives: str | None = None, local_device_ids=None) -> bool:
  """Initialises `jax.distributed` when a multi-process run is configured; returns whether it is now initialised.

  Call it first thing in the program, before anything touches a device. Idempotent.

  Args:
    coordinator, num_processes, process_id: override the environment (see the module docstring).
    auto: with no coordinator anywhere, let JAX detect the cluster (TPU pods, SLURM, ...).
    cpu_collectives: e.g. "gloo": the CPU backend's cross-process collectives (CPU-only runs and
      tests; GPUs use NCCL and TPUs their ICI/DCN without this).
    local_device_ids: restrict this process to some local devices (e.g. one GPU per process).
  """
  if jax.distributed.is_initialized():
    return True
  s = settings(coordinator, num_processes, process_id)
  if s["coordinator"] is None and not auto:
    return False
  if s["num_processes"] == 1 and not auto:
    return False  # one process: nothing to coordinate
  if cpu_collectives:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if s["coordinator"] is None:
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(s["coordinator"], s["num_processes"], s["process_id"], local_device_ids=local_device_ids)
  return True


def is_coordinator() -> bool:
  """True on process 0: the one that writes metrics, plots and logs (every process saves checkpoints)."""
  return jax.process_index() == 0
