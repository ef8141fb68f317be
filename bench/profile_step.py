"""Where a compiled step's time goes, op by op: XLA:CPU's own trace of one call mapped onto the compiled HLO.

`jax.profiler` records every thunk the CPU runtime executes (a fusion, a dot, a copy) under its HLO instruction's
name; the compiled module's text gives each instruction's shape, the JAX op it came from (`op_name` metadata) and,
for a dot or a fusion around one, its FLOPs (2 · output elements · contracted size). `profile` joins the two and
groups the time by where an op came from (the innermost named `jit`, forward or backward of a `grad`) and what it
is (dots against everything else), with each dot's FLOP rate.

Thunks with no data dependence between them run at the same time on XLA:CPU's thread pool, so op times summed
can exceed the wall time of the call (`concurrency` in the summary), and a dot's rate here is per second of its
own span: two dots that overlap each show about half of what they reach alone. Compare a dot's rate with the
same product timed alone (`bench/decode_matmul.py`, `bench/peak.py`) before calling it slow.

On the real model (SmolLM2-135M-Instruct, workload R_small's batch; `make smollm2` first):

    python -m bench.profile_step --what train       # the fused reference + train step
    python -m bench.profile_step --what decode      # generate (prefill + decode loop) at the workload's batch
    python -m bench.profile_step --what reference   # the reference scoring alone

`--model DIR` takes any Hugging Face folder (tests use a tiny one); `--json PATH` writes every row, `--markdown PATH`
the tables with the command, commit and load above them (bench/profiles/ holds those of the real model).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import gzip
import json
import math
import os
import re
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench import common

_CONTROL = ("while", "conditional", "call")  # their spans hold their bodies' thunks: counted there, not twice
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^=]*\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^\w+\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Op:
  """One instruction of a compiled module: its output shape (text), opcode, the JAX op it came from and its dot
  FLOPs (0 when it holds no dot)."""
  name: str
  shape: str
  opcode: str
  op_name: str
  flops: float


def _dims(shape: str) -> list[int] | None:
  m = _SHAPE.match(shape)
  return None if m is None else [int(d) for d in m.group(1).split(",") if d]


def _dot_flops(shape: str, rest: str, shape_of: dict[str, str]) -> float:
  """2 · output elements · contracted size of a `dot` whose output is `shape` and whose text after the opcode is
  `rest` (operands, then attributes)."""
  out, lhs = _dims(shape), _dims(shape_of.get(re.match(r"\s*%?([\w.\-]+)", rest).group(1), ""))
  contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
  if out is None or lhs is None or contract is None:
    return 0.0
  k = math.prod(lhs[int(i)] for i in contract.group(1).split(",") if i)
  return 2.0 * math.prod(out) * k


def hlo_ops(text: str) -> dict[str, Op]:
  """Every instruction of a compiled module's text (`jitted.lower(...).compile().as_text()`) by name; a fusion's
  FLOPs are those of the dots in the computation it calls (nested fusions included)."""
  comps: dict[str, list[tuple]] = {}
  shape_of: dict[str, str] = {}
  current = None
  for line in text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      current = re.match(r"(?:ENTRY )?%?([\w.\-]+)", line).group(1)
      comps[current] = []
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      comps[current].append(m.groups())
      shape_of[m.group(1)] = m.group(2)

  @functools.lru_cache(maxsize=None)
  def comp_flops(comp: str) -> float:
    return sum(own_flops(*ins) for ins in comps.get(comp, []))

  def own_flops(name, shape, opcode, rest) -> float:
    if opcode in ("dot", "convolution"):
      return _dot_flops(shape, rest, shape_of)
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    return comp_flops(called.group(1)) if opcode == "fusion" and called else 0.0

  ops = {}
  for instrs in comps.values():
    for name, shape, opcode, rest in instrs:
      op_name = re.search(r'op_name="([^"]*)"', rest)
      ops[name] = Op(name, shape, opcode, op_name.group(1) if op_name else "", own_flops(name, shape, opcode, rest))
  return ops


def trace_call(call: Callable[[], object], out_dir: str) -> tuple[float, dict[str, list[float]]]:
  """(wall seconds of `call()` blocked on its result, {event name: [total µs, count]}) from `jax.profiler`'s trace
  of that one call."""
  jax.profiler.start_trace(out_dir, create_perfetto_trace=True)
  try:
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    wall = time.perf_counter() - t0
  finally:
    jax.profiler.stop_trace()
  files = glob.glob(os.path.join(out_dir, "**", "*.json.gz"), recursive=True)
  if not files:
    raise RuntimeError(f"jax.profiler wrote no perfetto trace under {out_dir}")
  with gzip.open(max(files, key=os.path.getmtime)) as f:
    trace = json.load(f)
  events: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for e in trace["traceEvents"] if isinstance(trace, dict) else trace:
    if e.get("ph") == "X":
      events[e["name"]][0] += e.get("dur", 0.0)
      events[e["name"]][1] += 1
  return wall, dict(events)


def origin(op_name: str) -> str:
  """Where an op came from: the jitted function the compiled program called first thing (`jit(step)/jit(score)/...`
  is `score`), else the program itself (helpers jitted deeper, such as `jax.nn.silu` in a layer, count for their
  caller), and whether it is a backward pass (`transpose(jvp(...))`) or the forward of a `grad` (`jvp(...)`)."""
  m = re.match(r"jit\(([^)]*)\)(?:/jit\(([^)]*)\))?", op_name)
  scope = "-" if m is None else m.group(2) or m.group(1)
  if "transpose(" in op_name:
    return f"{scope} backward"
  return f"{scope} forward" if "jvp(" in op_name else scope


def kind(op: Op) -> str:
  """"dot" for a dot or a fusion around one, else the instruction's name less its number (e.g. `copy_fusion`)."""
  return "dot" if op.flops else re.sub(r"\.\d+$", "", op.name)


def summarize(wall_s: float, events: dict[str, list[float]], ops: dict[str, Op], top: int = 25) -> dict:
  """The trace's HLO ops (control flow left out: its span holds its body's ops) grouped by (origin, kind), the top
  ops by time, and totals: op seconds, wall seconds, their ratio (concurrency) and the dots' share and FLOP rate."""
  rows = []
  for name, (us, n) in events.items():
    op = ops.get(name)
    if op is None or op.opcode in _CONTROL:
      continue
    s = us / 1e6
    rows.append({"name": name, "seconds": s, "calls": n, "origin": origin(op.op_name), "kind": kind(op),
                 "shape": op.shape, "flops": op.flops * n, "flops_per_s": op.flops * n / s if s > 0 else 0.0,
                 "op_name": op.op_name})
  rows.sort(key=lambda r: -r["seconds"])
  groups: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
  for r in rows:
    g = groups[(r["origin"], "dot" if r["flops"] else "other")]
    g[0] += r["seconds"]
    g[1] += r["flops"]
  op_s = sum(r["seconds"] for r in rows)
  dot_s, dot_flops = sum(r["seconds"] for r in rows if r["flops"]), sum(r["flops"] for r in rows)
  return {
      "wall_s": wall_s, "op_s": op_s, "concurrency": op_s / wall_s if wall_s else 0.0, "dot_s": dot_s,
      "dot_share": dot_s / op_s if op_s else 0.0, "dot_flops": dot_flops,
      "dot_flops_per_op_s": dot_flops / dot_s if dot_s else 0.0,
      "groups": [{"origin": o, "kind": k, "seconds": s, "share": s / op_s if op_s else 0.0, "flops": f}
                 for (o, k), (s, f) in sorted(groups.items(), key=lambda x: -x[1][0])],
      "top": rows[:top], "ops": rows}


def profile(call: Callable[[], object], hlo_text: str, *, warmup: int = 1, top: int = 25) -> dict:
  """`summarize` of one traced `call()` after `warmup` untimed ones; `hlo_text` is the compiled module `call`
  runs (its instruction names are the trace's event names)."""
  for _ in range(warmup):
    jax.block_until_ready(call())
  with tempfile.TemporaryDirectory(prefix="profile_step_") as d:
    wall, events = trace_call(call, d)
  return summarize(wall, events, hlo_ops(hlo_text), top)


def render(s: dict, title: str) -> str:
  lines = [f"## {title}", "",
           f"wall {s['wall_s'] * 1e3:.1f} ms · op time {s['op_s'] * 1e3:.1f} ms (concurrency {s['concurrency']:.2f}) · "
           f"dots {100 * s['dot_share']:.1f} % of op time, {s['dot_flops'] / 1e9:.1f} GFLOP at "
           f"{s['dot_flops_per_op_s'] / 1e9:.1f} GFLOP/s per op-second", "",
           "| origin | kind | op time | share | GFLOP/s |", "|---|---|---|---|---|"]
  for g in s["groups"]:
    rate = f"{g['flops'] / g['seconds'] / 1e9:.1f}" if g["flops"] and g["seconds"] else "–"
    lines.append(f"| {g['origin']} | {g['kind']} | {g['seconds'] * 1e3:.1f} ms | {100 * g['share']:.1f} % | {rate} |")
  lines += ["", "| op | calls | op time | GFLOP/s | shape | origin |", "|---|---|---|---|---|---|"]
  for r in s["top"]:
    rate = f"{r['flops_per_s'] / 1e9:.1f}" if r["flops"] else "–"
    lines.append(f"| {r['name']} | {r['calls']} | {r['seconds'] * 1e3:.1f} ms | {rate} | {r['shape'][:40]} | "
                 f"{r['origin']} |")
  return "\n".join(lines)


def _real_call(what: str, variant: str, model_dir: str | None):
  """(call, compiled HLO text, title) for phase `what` of workload `variant` (`bench/grpo_real.py`'s context)."""
  from bench import grpo_real, grpo_step
  from jaxrl_llm.sampling import generate
  ctx = grpo_real.build(variant, model_dir)
  cfg, scfg = ctx["cfg"], ctx["sampler_cfg"]
  p, key = grpo_real._batch_of(ctx, 0)
  params = ctx["state"].params
  title = f"{what}, workload {variant} ({len(p.len_B)} rows, prompt width {ctx['P']}, remat {cfg.remat})"
  if what == "decode":
    args = (params, p.tokens_BP, p.len_B, key, cfg, scfg)
    return (lambda: generate(*args)), generate.lower(*args).compile().as_text(), title
  gen = grpo_step.sample(ctx, params, p, key)[0]
  mask_BN = gen["mask_BN"]
  if what == "reference":
    args = (ctx["ref_params"], gen["sequence_BT"], gen["positions_BT"], gen["segment_ids_BT"], mask_BN)
    return (lambda: ctx["score"](*args)), ctx["score"].lower(*args).compile().as_text(), title
  adv_BN = jnp.asarray(np.random.default_rng(0).standard_normal((mask_BN.shape[0], 1)), jnp.float32) * mask_BN
  batch, _ = grpo_step.learner_batch(ctx, gen, adv_BN)
  step = ctx["train_step"]
  text = step.lower(ctx["state"], batch, key, ctx["ref_params"]).compile().as_text()

  def train():  # the step donates its state, as the loop's does: carry the updated one
    ctx["state"], m = step(ctx.pop("state"), batch, key, ctx["ref_params"])
    return m
  return train, text, title


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--what", choices=("train", "decode", "reference"), default="train")
  ap.add_argument("--variant", default="R_small", help="bench.workloads.REAL's workload (batch, lengths, remat)")
  ap.add_argument("--model", default=None, help="a Hugging Face folder (default: the imported SmolLM2)")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--json", default=None, help="write the summary (every op) here")
  ap.add_argument("--markdown", default=None, help="write the tables here, the command and the machine above them")
  a = ap.parse_args(argv)
  call, text, title = _real_call(a.what, a.variant, a.model)
  header = common.run_header()
  s = profile(call, text, top=a.top)
  table = render(s, title)
  print(table)
  if a.markdown:
    head, rest = table.split("\n", 1)
    with open(a.markdown, "w") as f:
      f.write(f"{head}\n\n{common.measured_line('bench.profile_step', argv, header)}\n{rest}\n")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"what": a.what, "variant": a.variant, "title": title, **s}, f, indent=1)
  return s


if __name__ == "__main__":
  from jaxrl_llm import hugepages
  hugepages.reexec_with_huge_pages()  # with JAXRL_LLM_HUGE_PAGES=1, as the CLI
  main()
