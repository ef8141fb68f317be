"""The rules of a model's architecture fields, written once: `ModelConfig` checks itself with them and
config validation checks `config.model.*` with them (it may not import the models package).

`check(fields)` reads only the fields present in the mapping and returns the first violation as
(field, value, why), or None. Pure Python: no JAX, nothing of the package.
"""

from __future__ import annotations

from typing import Any, Mapping

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
REMAT = (False, True, "none", "full", "dots", "auto")  # "auto": decided by a run (policy_init.resolve_remat)
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


# LoRA (`model.lora.*`, `jaxrl_llm.models.lora`): the rules of its fields, on the architecture's fields.
LORA_TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
                "up_proj": "w_up", "down_proj": "w_down"}  # PEFT / Hugging Face module name -> our weight
LORA_BASE_QUANTIZE = ("none", "int8")


def parse_lora_targets(targets) -> tuple[str, ...]:
  """"q_proj, v_proj" (or a sequence) -> ("q_proj", "v_proj"), order kept, duplicates dropped."""
  items = targets.split(",") if isinstance(targets, str) else list(targets)
  return tuple(dict.fromkeys(t.strip() for t in items if t.strip()))


def lora_dims(f: Mapping[str, Any], weight: str) -> tuple[int, int]:
  """(in, out) features of one layer's `weight` viewed as a matrix, from the architecture fields `f`."""
  D, H, K, hd, F = f["d_model"], f["n_heads"], f["n_kv_heads"], f["head_dim"], f["d_ff"]
  return {"wq": (D, H * hd), "wk": (D, K * hd), "wv": (D, K * hd), "wo": (H * hd, D), "w_gate": (D, F),
          "w_up": (D, F), "w_down": (F, D)}[weight]


def check_lora(f: Mapping[str, Any] | None, rank, alpha, targets, dropout=0.0,
               base_quantize="none") -> tuple[str, Any, str] | None:
  """The first bad LoRA field as (name under model.lora, value, why), None when all hold. `f`: the architecture
  fields (d_model, n_heads, n_kv_heads, head_dim, d_ff, num_experts), None to skip the rules needing them."""
  if not (_int(rank) and rank >= 0):
    return "rank", rank, "must be an int >= 0 (0 = LoRA off)"
  if rank == 0:
    return None
  if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and alpha > 0):
    return "alpha", alpha, "must be > 0 (the adapter scale is alpha / rank)"
  names = parse_lora_targets(targets) if isinstance(targets, (str, tuple, list)) else ()
  if not names:
    return "targets", targets, f"must name at least one module of {', '.join(LORA_TARGETS)}"
  unknown = [t for t in names if t not in LORA_TARGETS]
  if unknown:
    return "targets", targets, f"unknown module {unknown[0]!r}; valid: {', '.join(LORA_TARGETS)}"
  if dropout != 0:
    return "dropout", dropout, "must be 0: the adapters are merged into the weights of every forward, which " \
                               "leaves no separate adapter input to drop"
  if base_quantize not in LORA_BASE_QUANTIZE:
    return "base_quantize", base_quantize, f"must be one of {LORA_BASE_QUANTIZE}"
  if f is not None:  # an MoE model's MLP targets are its experts: one adapter pair each (`models.lora`)
    for t in names:
      n_in, n_out = lora_dims(f, LORA_TARGETS[t])
      if rank > min(n_in, n_out):
        return "rank", rank, f"is larger than {t}'s smaller dimension ({n_in} in x {n_out} out)"
  return None
