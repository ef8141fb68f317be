"""The rules of a model's architecture fields, written once: `ModelConfig` checks itself with them and
config validation checks `config.model.*` with them (it may not import the models package).

`check(fields)` reads only the fields present in the mapping and returns the first violation as
(field, value, why), or None. Pure Python: no JAX, nothing of the package.
"""

from __future__ import annotations

from typing import Any, Mapping

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
REMAT = (False, True, "none", "full", "dots")
_POSITIVE_INTS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len")
_POSITIVE = ("rope_theta", "rms_eps", "init_std")


def _int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def check(fields: Mapping[str, Any]) -> tuple[str, Any, str] | None:
  """The first field of `fields` that breaks a rule: (name, value, why); None when all hold."""
  f = fields
  for name in _POSITIVE_INTS:
    if name in f and not (_int(f[name]) and f[name] > 0):
      return name, f[name], "must be a positive int"
  if "n_heads" in f and "n_kv_heads" in f and f["n_heads"] % f["n_kv_heads"]:
    return "n_kv_heads", f["n_kv_heads"], f"must divide model.n_heads={f['n_heads']}"
  if "head_dim" in f and f["head_dim"] % 2:
    return "head_dim", f["head_dim"], "must be even (RoPE rotates pairs)"
  for name in _POSITIVE:
    if name in f and not f[name] > 0:
      return name, f[name], "must be > 0"
  for name in ("param_dtype", "dtype"):
    if name in f and f[name] not in FLOAT_DTYPES:
      return name, f[name], f"must be one of {FLOAT_DTYPES}"
  if "remat" in f and f["remat"] not in REMAT:
    return "remat", f["remat"], f"must be one of {REMAT}"
  if "num_experts" in f and not (_int(f["num_experts"]) and f["num_experts"] >= 0):
    return "num_experts", f["num_experts"], "must be an int >= 0 (0 = dense MLP)"
  if f.get("num_experts") and "experts_per_token" in f and not 1 <= f["experts_per_token"] <= f["num_experts"]:
    return "experts_per_token", f["experts_per_token"], f"must be in [1, model.num_experts={f['num_experts']}]"
  if "layer_unroll" in f and not (_int(f["layer_unroll"]) and f["layer_unroll"] >= 1):
    return "layer_unroll", f["layer_unroll"], "must be an int >= 1"
  if "capacity_factor" in f and not f["capacity_factor"] >= 0:
    return "capacity_factor", f["capacity_factor"], "must be >= 0 (0 = dropless)"
  return None
