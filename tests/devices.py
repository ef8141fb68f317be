"""The environment of a test's subprocess that forces `n` host CPU devices (set before jax is imported)."""

import os


def with_devices(n: int, env: dict | None = None) -> dict:
  """`env` (default: this process's) with `n` forced CPU devices added to its XLA_FLAGS (others kept)."""
  env = dict(os.environ if env is None else env)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
  env["JAX_PLATFORMS"] = "cpu"
  return env
