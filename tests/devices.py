"""The environment of a test's subprocess that forces `n` host CPU devices (set before jax is imported)."""

import os


def with_devices(n: int) -> dict:
  """This process's environment with `n` forced CPU devices in its XLA_FLAGS (its other flags kept)."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
  env["JAX_PLATFORMS"] = "cpu"
  return env
