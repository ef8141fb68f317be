"""The speed features our side of a GRPO bench can turn on: `--features NAME=VALUE,...` and `--variants` of bench.run.

A feature set is a plain dict over `DEFAULTS`' names (the values there mean "off" / the workload's own):
  - slots, slot_chunk: continuous batching (`sampling.continuous.generate_slots`, config `rollout.slots`,
    `rollout.slot_chunk`); slots = 0 decodes the whole batch at once (`sampling.generate`);
  - pack_width: the packed learner (`jaxrl_llm.packing`, config `optim.pack_width`); 0 = padded rows, "auto" =
    the padded row width P + N;
  - spec_gamma, spec_draft_layers: speculative decoding (`sampler.spec_gamma`, `sampler.spec_draft_layers`);
    γ = 0 is off, "auto" picks γ by batch size; draft layers 0 = `DEFAULT_DRAFT_LAYERS` capped at the depth;
  - remat: the learner's layer rematerialisation (`model.remat`): "none", "full" or "dots"; "" = the workload's.

`parse` turns "slots=16,slot_chunk=8" into a dict and refuses unknown names and bad values with a message that
lists the known ones; `label` is the short text the tables show.
"""

from __future__ import annotations

DEFAULTS = {"slots": 0, "slot_chunk": 8, "pack_width": 0, "spec_gamma": 0, "spec_draft_layers": 0, "remat": ""}
REMAT = ("none", "full", "dots")
DEFAULT_DRAFT_LAYERS = 8  # bench/speculative.py's drafter depth for SmolLM2 (30 layers)


def _int(name: str, lo: int, auto: bool = False):
  def conv(text: str):
    if auto and text == "auto":
      return "auto"
    try:
      v = int(text)
    except ValueError:
      v = None
    if v is None or v < lo:
      raise ValueError(f"feature {name}={text!r}: an int >= {lo}{' or auto' if auto else ''}")
    return v
  return conv


def _remat(text: str) -> str:
  if text not in REMAT:
    raise ValueError(f"feature remat={text!r}: one of {', '.join(REMAT)}")
  return text


_PARSE = {"slots": _int("slots", 0), "slot_chunk": _int("slot_chunk", 1), "pack_width": _int("pack_width", 0, True),
          "spec_gamma": _int("spec_gamma", 0, True), "spec_draft_layers": _int("spec_draft_layers", 0),
          "remat": _remat}


def parse(text: str) -> dict:
  """`NAME=VALUE,...` → the features it sets (only those); ValueError on an unknown name or a bad value."""
  out = {}
  for item in (x.strip() for x in text.split(",")):
    if not item:
      continue
    name, eq, value = item.partition("=")
    name = name.strip()
    if name not in _PARSE:
      raise ValueError(f"unknown feature {name!r} in {text!r}: known features are {', '.join(DEFAULTS)}")
    if not eq or not value.strip():
      raise ValueError(f"feature {name!r} in {text!r}: give it a value, NAME=VALUE")
    out[name] = _PARSE[name](value.strip())
  return out


def complete(features: dict | None) -> dict:
  """`features` over every name of `DEFAULTS` (missing ones at their default); ValueError on unknown names."""
  unknown = set(features or {}) - set(DEFAULTS)
  if unknown:
    raise ValueError(f"unknown feature(s) {sorted(unknown)}: known features are {', '.join(DEFAULTS)}")
  return {**DEFAULTS, **(features or {})}


def draft_layers(features: dict, n_layers: int) -> int:
  """The drafter's depth: the feature's, else `DEFAULT_DRAFT_LAYERS`, capped at the policy's depth."""
  return features.get("spec_draft_layers") or min(DEFAULT_DRAFT_LAYERS, n_layers)


def label(features: dict | None) -> str:
  """The features set away from their defaults, as `parse` reads them ("baseline" when none)."""
  f = complete(features)
  # away from the defaults; the chunk whenever slots are on, and neither knob without its feature
  on = {k: v for k, v in f.items() if v != DEFAULTS[k] or (k == "slot_chunk" and f["slots"])}
  if not f["slots"]:
    on.pop("slot_chunk", None)
  if not f["spec_gamma"]:
    on.pop("spec_draft_layers", None)
  return ",".join(f"{k}={v}" for k, v in on.items()) or "baseline"


def parse_variants(texts: list[str] | None) -> dict[str, dict]:
  """`--variants` values (each may hold several feature sets separated by ';') → {label: features}."""
  out = {}
  for text in texts or []:
    for part in (p.strip() for p in text.split(";")):
      if part:
        f = parse(part)
        out[label(f)] = f
  return out
