"""Generates docs/config.md from the shipped configs: `python -m jaxrl_llm.config_doc > docs/config.md`.

Every field reachable from configs/*.py (the union over all of them), grouped by section, with its type, default,
allowed values (the closed sets `jaxrl_llm.config` and `model_fields` validate against, read from their constants),
feature and one line of meaning. The meaning is the trailing `# comment` on the line that sets the field in its
home file: configs/default.py, or for a section default.py lacks the config that introduces it (`HOME`), so the
defaults and their documentation live in one place. Fields of those optional sections show the value a run uses
when a config lacks them (`config.ABSENT_DEFAULTS`, `distill.extras`) and the shipped configs that set them.
tests/test_docs_config.py fails when the committed page is stale or a reachable field has no meaning line.
"""

from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize
from typing import Any, Iterable, Mapping

import ml_collections

from jaxrl_llm import config as config_lib

COMMAND = "python -m jaxrl_llm.config_doc > docs/config.md"
CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
BASE = "default.py"
# The file whose comments document a section configs/default.py does not have (longest matching prefix wins).
HOME = {"env": "agent_tiny.py", "distill": "opd_default.py", "distill.adwin": "opd_adwin_tiny.py",
        "distill.mopd": "opd_mopd_tiny.py", "distill.teachers": "opd_mopd_tiny.py",
        "distill.topk_cache": "opd_topk_cache_tiny.py"}
# Free-form mappings documented as one field each (their keys belong to a task, an environment or a loss).
OPAQUE = ("task.kwargs", "env.kwargs", "loss.hparams", "distill.teachers", "serve.harness_kwargs")
# The feature a field belongs to, by dotted prefix (the longest matching prefix wins; "" = every field).
FEATURES = {
    "": "run", "task": "task and prompts", "model": "policy model", "model.num_experts": "MoE",
    "model.experts_per_token": "MoE", "model.capacity_factor": "MoE", "model.router_aux_coef": "MoE",
    "model.routing_replay": "MoE (R2 / R3)", "model.pr2_horizon": "MoE (R2 / R3)", "model.remat": "memory",
    "model.memory_budget_gb": "memory",
    "model.layer_unroll": "compile time", "model.decode_unroll": "decode speed", "model.init_from": "pretrained init",
    "model.lora": "LoRA",
    "sampler": "sampling", "sampler.quantize": "train/inference mismatch", "sampler.dtype": "train/inference mismatch",
    "sampler.behavior_topk": "records of μ", "sampler.mc_samples": "records of μ",
    "sampler.kv_": "KV-compressed rollouts", "sampler.spec_": "speculative decoding",
    "sampler.spec_drafter": "speculative decoding (drafter)", "sampler.spec_distill": "speculative decoding (drafter)",
    "sampler.spec_head": "speculative decoding (drafter)",
    "rollout": "rollout schedule", "rollout.dynamic_sampling": "DAPO", "rollout.old_logp": "π_old",
    "rollout.ewma_beta": "π_old", "rollout.prox_in_worker": "π_old", "rollout.score_at_switch": "π_old",
    "rollout.num_workers": "async rollouts",
    "rollout.sampler_devices": "sampler devices", "rollout.partial_chunk": "partial rollouts",
    "rollout.slot": "continuous batching", "rollout.weight_sync": "weight sync", "rollout.replay": "experience replay",
    "rollout.echo": "ECHO co-evolving critic", "rollout.pats": "Pats evidence cards",
    "serve": "agent harness (rollout.mode=harness)", "loss": "policy loss", "loss.kl_": "KL to the reference",
    "advantage": "advantages", "optim": "optimiser", "optim.grad_accum": "micro-batching",
    "optim.minibatches": "update schedule", "optim.epochs": "update schedule", "optim.max_skips": "fault tolerance",
    "optim.pack_width": "packed learner", "sft": "SFT warm start", "sft.save_to": "SFT export",
    "sft.demo": "SFT on demonstration episodes", "eval": "evaluation", "mesh": "sharding", "dist": "multi-process",
    "checkpoint": "checkpoints and resume", "reward": "reward calls", "log": "logging", "env": "multi-turn episodes",
    "env.evict": "context eviction", "env.context_budget": "context eviction", "env.keep_last_turns": "context eviction",
    "distill": "on-policy distillation", "distill.ref_teacher": "S²D reference teacher",
    "distill.adwin": "ADWIN horizons", "distill.mopd": "Open-MOPD", "distill.teachers": "Open-MOPD",
    "distill.topk_cache": "teacher top-k cache",
}


def _allowed() -> dict[str, Iterable]:
  """Closed sets of values the code validates a field against, from the code's own constants."""
  from jaxrl_llm import envs, losses, model_fields, tasks
  from jaxrl_llm.distill import extras, mopd
  from jaxrl_llm.rollout import sources  # noqa: F401 -- registers the rollout modes beyond the built-in ones
  from jaxrl_llm.tasks import encoder, reward
  c = config_lib
  return {
      "task.name": tasks.task_names(), "task.source": c.TASK_SOURCES, "task.chat_template": encoder.CHAT_MODES,
      "model.dtype": c.DTYPES, "model.remat": model_fields.REMAT,
      "model.routing_replay": (False, True, *c.ROUTING_REPLAY),
      "model.lora.targets": [f"comma-separated {', '.join(model_fields.LORA_TARGETS)}"],
      "model.lora.base_quantize": model_fields.LORA_BASE_QUANTIZE,
      "sampler.dtype": c.DTYPES, "sampler.quantize": c.SAMPLER_QUANTIZE, "sampler.kv_cache": c.KV_CACHES,
      "sampler.spec_layout": c.SPEC_LAYOUTS, "sampler.spec_drafter": c.SPEC_DRAFTERS,
      "rollout.mode": c.rollout_modes(), "rollout.old_logp": c.OLD_LOGP, "rollout.weight_sync": c.WEIGHT_SYNC,
      "rollout.replay.stale_policy": c.REPLAY_STALE_POLICIES,
      "loss.name": losses.names(), "loss.agg_mode": losses.MODES, "loss.kl_estimator": c.KL_ESTIMATORS,
      "advantage.name": c.ADVANTAGES, "checkpoint.config_change": c.CONFIG_CHANGE, "reward.executor": reward.EXECUTORS,
      "env.name": envs.names(), "env.evict": c.EVICT_POLICIES, "distill.mopd.gap_stat": mopd.STATS,
      "distill.mopd.gap_reference": extras.GAP_REFERENCES,
  }


def _absent_defaults() -> dict[str, Any]:
  """The value a run uses for each field a config may lack (`config.ABSENT_DEFAULTS`, the distill options')."""
  from jaxrl_llm.distill import extras
  out = dict(config_lib.ABSENT_DEFAULTS)
  for section, defaults in (("adwin", extras.ADWIN_DEFAULTS), ("mopd", extras.MOPD_DEFAULTS),
                            ("topk_cache", extras.CACHE_DEFAULTS)):
    out.update({f"distill.{section}.{k}": v for k, v in defaults.items()})
  out["distill.teachers"] = []
  return out


# --- Reading the config files: their fields and the comments on the lines that set them ---


def leaves(c, prefix: str = "") -> dict[str, tuple[Any, str]]:
  """{dotted field: (value, type name)} of a config, `OPAQUE` mappings as single fields."""
  out = {}
  for k, v in c.items():
    name = f"{prefix}{k}"
    if isinstance(v, ml_collections.ConfigDict) and name not in OPAQUE:
      out.update(leaves(v, f"{name}."))
    else:
      t = c.get_type(k) if isinstance(c, ml_collections.ConfigDict) else type(v)
      out[name] = (v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v, _type_name(t, v))
  return out


def _type_name(t, v) -> str:
  if t is object:
    return "any"
  if isinstance(v, ml_collections.ConfigDict) or t is ml_collections.ConfigDict:
    return "mapping"
  return t.__name__


def _dotted(node) -> str | None:
  """`c.a.b` -> "a.b" (the config variable `c`), else None."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  return ".".join(reversed(parts)) if isinstance(node, ast.Name) and node.id == "c" and parts else None


def _dict_literal(node) -> ast.Dict | None:
  """The `{...}` of `ConfigDict({...})` or of a bare dict literal."""
  if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Dict):
    return node.args[0]
  return node if isinstance(node, ast.Dict) else None


def _assigned(tree: ast.AST) -> list[tuple[str, int]]:
  """(dotted field, line) of every `c.x.y = ...` and of the keys of a `ConfigDict({...})` assigned to one."""
  out = []

  def visit(name: str, line: int, value) -> None:
    out.append((name, line))
    d = _dict_literal(value) if name not in OPAQUE else None
    for k, v in zip(d.keys, d.values) if d is not None else ():
      if isinstance(k, ast.Constant) and isinstance(k.value, str):
        visit(f"{name}.{k.value}", k.lineno, v)

  for node in ast.walk(tree):
    if isinstance(node, ast.Assign):
      for t in node.targets:
        name = _dotted(t)
        if name is not None:
          visit(name, t.lineno, node.value)
  return sorted(out, key=lambda x: x[1])


def _trailing_comments(src: str) -> dict[int, str]:
  """{line: text} of the comments that follow code on their line."""
  out, code_lines = {}, set()
  for tok in tokenize.generate_tokens(io.StringIO(src).readline):
    if tok.type == tokenize.COMMENT and tok.start[0] in code_lines:
      out[tok.start[0]] = tok.string.lstrip("#").strip()
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
      code_lines.update(range(tok.start[0], tok.end[0] + 1))
  return out


def field_comments(src: str) -> list[tuple[str, str]]:
  """(dotted field, its trailing comment or "") in the order a config file's source sets them."""
  comments = _trailing_comments(src)
  return [(name, comments.get(line, "")) for name, line in _assigned(ast.parse(src))]


def _home(field: str) -> str:
  return next((HOME[p] for p in sorted(HOME, key=len, reverse=True) if field == p or field.startswith(p + ".")), BASE)


def meaning(field: str, comments: Mapping[str, Mapping[str, str]]) -> str:
  """The field's comment in its home file (`HOME`, else configs/default.py); "" when it has none."""
  return comments.get(_home(field), {}).get(field, "")


def undocumented(fields: Iterable[str], comments: Mapping[str, Mapping[str, str]]) -> list[str]:
  """The fields without a meaning line in their home file (what tests/test_docs_config.py refuses)."""
  return sorted(f for f in fields if not meaning(f, comments))


def _by_longest_prefix(table: Mapping[str, Any], field: str) -> Any:
  return table[max((p for p in table if field.startswith(p)), key=len)]


# --- The page ---


def _cell(x) -> str:
  return str(x).replace("|", "\\|").replace("\n", " ")


def _code(v) -> str:
  return f"`{_cell(repr(v))}`"


def _allowed_cell(values) -> str:
  values = list(values) if values is not None else []
  return ", ".join(f"`{v}`" if not (isinstance(v, str) and " " in v) else v for v in values) or ""


def render_from(configs: Mapping[str, ml_collections.ConfigDict], sources: Mapping[str, str],
                allowed: Mapping[str, Iterable], absent: Mapping[str, Any]) -> str:
  """The page for `configs` ({file name: config}) and their `sources` ({file name: text}); pure."""
  comments = {f: dict(field_comments(src)) for f, src in sources.items()}
  per_file = {f: leaves(c) for f, c in configs.items()}
  union = {}
  for f in sorted(per_file, key=lambda f: (f != BASE, f)):
    for k, v in per_file[f].items():
      union.setdefault(k, v)
  base = per_file.get(BASE, {})
  homes = [BASE] + list(dict.fromkeys(HOME.values())) + sorted(sources)
  order = {}
  for f in homes:
    for name, _ in field_comments(sources[f]) if f in sources else ():
      order.setdefault(name, len(order))
  fields = sorted(union, key=lambda k: (order.get(k, len(order)), k))
  sections: dict[str, list[str]] = {}
  for k in fields:
    sections.setdefault(k.rpartition(".")[0], []).append(k)

  lines = [
      "# Config reference",
      "",
      f"<!-- Generated from configs/*.py and jaxrl_llm/config.py by `{COMMAND}`. Do not edit by hand. -->",
      "",
      "Every field reachable from the shipped configs (`configs/*.py`), by section. Set any of them on the command",
      "line: `python -m jaxrl_llm --config=configs/<file> --config.<section>.<field>=<value>`. The meaning is the",
      "comment on the field's line in `configs/default.py` (or, for a section it lacks, in the config that",
      "introduces it); `allowed` lists the values validation accepts (`jaxrl_llm/config.py`, `model_fields.py`).",
      "A config may lack a field of `ABSENT_DEFAULTS` (`jaxrl_llm/config.py`): the run then uses the default shown.",
      "Loss hyper-parameters (`loss.hparams.*`) are in [losses.md](losses.md).",
      "",
      "Sections: " + ", ".join(f"[`{s or '(top level)'}`](#{_anchor(s)})" for s in sections),
      "",
  ]
  for s, names in sections.items():
    optional = not any(k in base for k in names)
    lines += [f"## `{s or '(top level)'}`", ""]
    if optional:
      lines += [f"Not in `configs/default.py`: only the configs listed set it; a config without it runs without the "
                f"feature. Documented in `configs/{_home(names[0])}`.", ""]
      lines += ["| field | type | default when absent | allowed | feature | meaning | set in |",
                "|---|---|---|---|---|---|---|"]
    else:
      lines += ["| field | type | default | allowed | feature | meaning |", "|---|---|---|---|---|---|"]
    for k in names:
      value, type_name = base[k] if k in base else union[k]
      set_in = ", ".join(f"`{f}`" for f in sorted(per_file) if k in per_file[f])
      if k in base:
        default = "each unset (`None`)" if _all_unset(value) else _code(value)
      else:  # only some configs set it (in a section default.py has, the configs follow the default)
        default = _code(absent[k]) if k in absent else "required in the section"
        default += "" if optional else f" (set in {set_in})"
      keys = [f"keys: {', '.join(value)}"] if k in OPAQUE and isinstance(value, dict) and value else None
      row = [f"`{k}`", type_name, default, _allowed_cell(allowed.get(k, keys)), _by_longest_prefix(FEATURES, k),
             _cell(meaning(k, comments))]
      if optional:
        row.append(set_in)
      lines.append("| " + " | ".join(row) + " |")
    lines.append("")
  return "\n".join(lines).rstrip("\n") + "\n"


def _all_unset(value) -> bool:
  return isinstance(value, dict) and bool(value) and all(v is None for v in value.values())


def _anchor(section: str) -> str:
  return (section or "top-level").replace(".", "")


def shipped() -> tuple[dict[str, ml_collections.ConfigDict], dict[str, str]]:
  """({file name: config}, {file name: source}) of every configs/*.py."""
  files = sorted(CONFIG_DIR.glob("*.py"))
  return ({p.name: config_lib.load_file(p) for p in files}, {p.name: p.read_text(encoding="utf-8") for p in files})


def render() -> str:
  """The page for the shipped configs, deterministic."""
  configs, sources = shipped()
  return render_from(configs, sources, _allowed(), _absent_defaults())


def main() -> None:
  sys.stdout.write(render())


if __name__ == "__main__":
  main()
