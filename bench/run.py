"""`make bench` entry point: runs every benchmark once, prints Markdown tables, writes JSON (+ README).

  python -m bench.run [--quick] [--no-peers] [--out bench/results.json] [--readme bench/README.md]
                      [--real R_small|R|none] [--only-real] [--model DIR] [--shared-prefill]
                      [--features NAME=VALUE,...] [--variants 'NAME=VALUE,...;...'] [--only-tail]

Order: machine references (matmul peak, copy bandwidth) → learner MFU (S, M) → sampler throughput →
full GRPO step, ours and Tunix's in alternating blocks (Tunix in a subprocess of the bench virtualenv,
paused while ours runs: never both at once) → loop and system costs → workload R on the real
SmolLM2-135M-Instruct (`bench/grpo_real.py`; R_small by default, `--real R` for the full size), ours
against Tunix, TRL and plain PyTorch taking turns, with its per-phase roofline and memory. `--quick`
shrinks every shape (a smoke run, numbers meaningless) and skips peers and R. `--only-real` measures
the machine references and R only and merges them into the existing `--out` (the toy rows stay).

Speed features of ours on workload R (`bench/features.py`): `--features` sets ours' (continuous batching,
packed learner, speculative decoding, remat), `--variants` adds versions of ours with other feature sets that
take turns with ours and the peers in the same rounds (each with its ratios from those rounds). The long-tail
rollout section (`bench/continuous.py`: static batches against continuous batching on geometric and
episode-like completion lengths) runs in the full bench, or alone with `--only-tail` (merged into `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_PYTHON = os.path.join(ROOT, "bench", ".venv-bench", "bin", "python")
TUNIX_SCRIPT = os.path.join(ROOT, "bench", "peers", "tunix_grpo.py")
REAL_PEERS = {  # workload R's peers: name -> script (each speaks bench/peers/turns.py's protocol)
    "tunix": TUNIX_SCRIPT,
    "trl": os.path.join(ROOT, "bench", "peers", "trl_grpo.py"),
    "torch": os.path.join(ROOT, "bench", "peers", "torch_grpo.py"),
}
REAL_STEPS = (1, 1, 2)  # workload R: warm-up steps, steps per block, blocks per side
COMMAND = "make bench"
GRPO_STEPS = (2, 2, 6)  # GRPO step vs Tunix: warm-up steps, then blocks of 2 steps taking turns, 6 blocks per side

# The long-tail rollout section (`bench/continuous.py`): toy decode-only workloads, both distributions.
TAIL = dict(requests=64, slots=16, new_tokens=128, chunk=8, d_model=128, layers=2, repeats=2)
TAIL_QUICK = dict(requests=8, slots=2, new_tokens=12, chunk=4, d_model=32, layers=1, repeats=1)

# --quick: tiny shapes so the whole harness runs in seconds (the smoke test).
_TINY = dict(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, vocab_size=64)
QUICK = {
    "learner": {"S": {"model": _TINY, "batch": 4, "seq_len": 12, "prompt_len": 4}},
    "grpo": {"tiny": _TINY},
    "grpo_steps": (1, 1, 1),  # warm-up, steps per block, blocks
    "sampler": dict(batches=(2,), new_tokens=(3,), model=_TINY, P=4, repeats=1),
}


def _git(*args: str) -> str:
  try:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def machine_info() -> dict:
  """What the numbers were measured on: cores, load, JAX backend and versions, commit."""
  import jax
  from jaxrl_llm import hugepages
  dev = jax.devices()[0]
  return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
          "python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
          "device_kind": dev.device_kind, "device_count": jax.device_count(),
          "loadavg_start": list(os.getloadavg()), "commit": _git("rev-parse", "--short", "HEAD"),
          "huge_pages": hugepages.active(),
          "dirty": bool(_git("status", "--porcelain")),
          "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


class InterleavedPeer:
  """Tunix's GRPO script run with `--rounds`, taking turns with our side (see `bench/peers/tunix_grpo.py`).

  It warms up in the background, then pauses after its warm-up and after each block of steps.
  `turn()` is `grpo_step.measure`'s `between` hook: the first call waits for the warm-up, each later
  call lets the peer run one block and waits for it. `result()` is its summary line, or a dict whose
  `status` says why there is none; a peer that dies or hangs never stops our side's measurement.
  """

  def __init__(self, workload: str, warmup: int, steps: int, rounds: int, python: str = BENCH_PYTHON,
               timeout_s: float = 420, script: str = TUNIX_SCRIPT, extra_args: tuple[str, ...] = (),
               lazy: bool = False):
    self.timeout_s, self.turns, self.final, self.proc = timeout_s, 0, None, None
    if not os.path.exists(python):
      self.final = {"status": f"bench venv missing ({os.path.relpath(python, ROOT)}); `make bench` creates it"}
      return
    self.cmd = [python, script, "--workload", workload, "--warmup", str(warmup), "--steps", str(steps),
                "--rounds", str(rounds), *extra_args]
    if not lazy:  # lazy: the process starts at the first `turn()` (peers warm up one after another)
      self.start()

  def start(self) -> None:
    import queue
    import threading
    env = {**os.environ, "PYTHONPATH": ""}  # the peer must not see the project venv's packages
    self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, text=True, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    self.lines: queue.Queue = queue.Queue()
    self.stderr_tail: list[str] = []
    threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
    threading.Thread(target=self._tail, args=(self.proc.stderr,), daemon=True).start()

  @staticmethod
  def _pump(stream, q) -> None:
    for ln in stream:
      if ln.startswith("{"):
        try:
          msg = json.loads(ln)
        except ValueError:  # a library's own printout (e.g. a Trainer's log dict), not the protocol
          continue
        if isinstance(msg, dict) and "status" in msg:
          q.put(msg)
    q.put(None)  # end of output

  def _tail(self, stream) -> None:
    for ln in stream:
      self.stderr_tail = (self.stderr_tail + [ln.rstrip()])[-5:]

  def _fail(self, status: str) -> None:
    self.final = {"status": status}
    if self.proc is not None and self.proc.poll() is None:
      self.proc.kill()

  def turn(self) -> None:
    import queue
    if self.final is not None:
      return
    if self.proc is None:
      self.start()
    if self.turns > 0:
      try:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
      except OSError:
        pass  # it died: the next line is its end of output
    self.turns += 1
    try:
      msg = self.lines.get(timeout=self.timeout_s)
    except queue.Empty:
      return self._fail(f"timed out after {self.timeout_s:.0f} s")
    if msg is None:
      tail = self.stderr_tail[-1:] or ["no output"]
      rc = self.proc.wait()
      why = f"killed by signal {-rc}{' (SIGKILL: the kernel OOM killer, or a person)' if rc == -9 else ''}" if rc < 0 else f"exit {rc}"
      return self._fail(f"no result ({why}): {tail[0][:200]}")
    if msg.get("status") != "paused":
      self.final = msg

  def result(self) -> dict:
    if self.final is None:  # our side stopped taking turns before the peer finished
      self._fail("peer not finished")
    if self.proc is not None:
      try:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()
    return self.final


def measure_real(variant: str, peak_fp32: float, bandwidth: float, peers: bool, model_dir: str | None = None,
                 shared_prefill: bool = False, steps: tuple[int, int, int] = REAL_STEPS, log=print,
                 peer_timeout_s: float = 1800, only_peers: tuple[str, ...] = (), quick: bool = False,
                 features: dict | None = None, variants: dict[str, dict] | None = None,
                 peer_python: str = BENCH_PYTHON, phases: bool = True) -> dict:
  """Workload `variant` of `bench.workloads.REAL`: ours warms up; then, one peer at a time (only one
  peer process alive: memory), the peer warms up and the two take turns block by block (the peer's
  process paused while ours runs, ours idle while it runs); each ratio is against the ours blocks
  that alternated with that peer. Then ours phase by phase (roofline, peak RSS per phase).

  `features`: speed features of ours (`bench/features.py`); `variants`: {label: features} of further
  versions of ours (sharing the model's weights, each with its own train state) that take turns too: in
  each round every version of ours runs one block, then the peer one; each variant's ratios (against the
  peer, and ours / variant) come from those same rounds. Phases, roofline and memory: ours only; `phases`
  False (a re-measurement of some peers' rows of an existing entry) skips them."""
  from bench import common, grpo_real, grpo_step
  warmup, block, rounds = steps
  model_dir = model_dir or grpo_real.default_model_dir()
  load_start = list(os.getloadavg())
  names = [n for n in REAL_PEERS if not only_peers or n in only_peers] if peers else []
  variants = variants or {}
  log(f"[bench] {variant}: ours{' + ' + str(list(variants)) if variants else ''} (build, {warmup} warm-up step(s)); "
      f"then per peer {names or '(none)'}: the peer warms up, then {rounds} blocks of {block} step(s) per side, "
      "taking turns")
  ctx = grpo_real.build(variant, model_dir, shared_prefill=shared_prefill, features=features)
  ctxs = {"ours": ctx}
  for vname, vf in variants.items():
    ctxs["variant " + vname] = grpo_real.build(variant, model_dir, shared_prefill=shared_prefill, features=vf, base=ctx)
  theirs, paired = {}, {}
  if not names:
    alone = grpo_step.measure_many(ctxs, warmup=warmup, steps=block, rounds=rounds)
  for i, name in enumerate(names):  # one peer alive at a time (memory), each paired with the ours blocks around it
    log(f"[bench] {variant}: ours against {name}")
    peer = InterleavedPeer(variant, warmup, block, rounds, python=peer_python, script=REAL_PEERS[name],
                           timeout_s=peer_timeout_s, extra_args=("--model", model_dir), lazy=True)
    paired[name] = grpo_step.measure_many(ctxs, warmup=warmup if i == 0 else 0, steps=block, rounds=rounds,
                                          between=peer.turn)
    theirs[name] = peer.result()
    log(f"[bench] {variant}: {name}: {theirs[name].get('status')}")
  pooled = {k: _pool([paired[n][k] for n in names]) if names else alone[k] for k in ctxs}
  ours = pooled["ours"]
  ours["prompt_width"] = ctx["P"]
  out = {"variant": variant, "model_dir": model_dir,
         "model": {k: getattr(ctx["cfg"], k) for k in ("n_layers", "d_model", "d_ff", "vocab_size", "n_heads",
                                                          "n_kv_heads", "head_dim", "remat", "layer_unroll")},
         "workload": {**ctx["run"], "rollouts": ctx["run"]["prompts_per_step"] * ctx["run"]["group_size"]},
         "features": ctx["features"], "ours": ours, "loadavg_start": load_start}
  if variants:
    out["variants"] = {}
    for vname in variants:
      v = pooled["variant " + vname]
      entry = {"features": ctxs["variant " + vname]["features"], "ours": v,
               "remat": ctxs["variant " + vname]["cfg"].remat,
               "baseline_over_variant": ours["total_s"] / v["total_s"]}  # > 1: the variant is faster
      for n in names:
        t = theirs[n]
        entry[f"{n}_over_variant"] = t["total_s"] / paired[n]["variant " + vname]["total_s"] if "total_s" in t else None
      out["variants"][vname] = entry
  if phases:  # a peers-only re-measurement keeps the entry's phases
    # The machine's load drifts over a long run: the roofline uses a peak and bandwidth measured again
    # right before the phases (the run's first measurement stays in `peak` / `measured`).
    from bench import peak as peak_lib
    log(f"[bench] {variant}: peak and bandwidth again, then ours phase by phase")
    for k in list(ctxs)[1:]:  # the variants' train states are not needed any more (memory for the phases)
      del ctxs[k]["state"]
    pk = peak_lib.measure(quick)
    peak_fp32, bandwidth = pk["matmul_fp32"]["flops_per_s"], pk["copy"]["bytes_per_s"]
    with common.count_compiles() as n_phase_compiles:
      ph = grpo_real.phases(ctx, 10 ** 6)
    ph["compiles"] = n_phase_compiles[0]
    out.update(phases=ph, roofline=grpo_real.roofline(ctx, ph, ours["total_s"], peak_fp32, bandwidth),
               memory=grpo_real.memory(ctx, ph), peak_at_phases={"fp32": peak_fp32, "bandwidth": bandwidth,
                                                                 "bandwidth_in_place": pk["copy"]["in_place"],
                                                                 "loadavg": list(os.getloadavg())})
  out["loadavg_end"] = list(os.getloadavg())
  for n in REAL_PEERS:
    t = theirs.get(n, {"status": "skipped (--no-peers)" if not peers else "skipped (--peers)"})
    out[n] = t
    # Against the ours blocks that took turns with this peer (the same stretch of machine time).
    mine = paired[n]["ours"] if n in paired else ours
    out[f"{n}_over_ours"] = t["total_s"] / mine["total_s"] if "total_s" in t else None
    out[f"ours_with_{n}_s"] = mine["total_s"]
  return out


def _pool(parts: list[dict]) -> dict:
  """One summary of several `grpo_step.measure` results of the same context (medians over all steps)."""
  import statistics
  each = [t for p in parts for t in p["step_s_each"]]
  out = dict(parts[0])
  out.update(total_s=statistics.median(each), best_total_s=min(each), step_s_each=each,
             steps=sum(p["steps"] for p in parts), rounds=sum(p["rounds"] for p in parts),
             compiles_after_warmup=sum(p["compiles_after_warmup"] for p in parts),
             completion_len_mean=statistics.mean(p["completion_len_mean"] for p in parts),
             loadavg_blocks=[x for p in parts for x in p.get("loadavg_blocks", [])])
  # every part's steps count (a table row of reward_mean from the first part's steps alone read 0.00 for ours)
  for k in ("learner_pad_frac", "slot_wasted", "spec_accept_rate", "reward_mean", "prompt_len_mean"):
    if all(k in p for p in parts):
      out[k] = sum(p[k] * p["steps"] for p in parts) / max(sum(p["steps"] for p in parts), 1)
  for k in ("generate_s", "ref_train_s", "host_s"):  # medians of the parts' medians
    out[k] = statistics.median(p[k] for p in parts)
  return out


def _default_model_dir() -> str:
  from bench import grpo_real
  return grpo_real.default_model_dir()


def collect(quick: bool, peers: bool, log=print, real: str | None = None, only_real: bool = False,
            model_dir: str | None = None, shared_prefill: bool = False, command: str = COMMAND,
            only_peers: tuple[str, ...] = (), features: dict | None = None, variants: dict | None = None,
            only_tail: bool = False, peer_python: str = BENCH_PYTHON, remeasure_peers: bool = False,
            real_blocks: int = REAL_STEPS[2]) -> dict:
  """Runs every section; returns the results dict written to results.json.

  `real`: workload R variant to run after the toy sections (None: none); `only_real`: the machine
  references and R only; `only_tail`: the machine references and the long-tail rollout section only.
  `features` / `variants`: speed features of ours on workload R (`measure_real`); `remeasure_peers`: `only_peers`
  replace their rows of an existing R entry (no phases measured).
  """
  from bench import common, grpo_step, learner_mfu, peak, sampler_tput, system, workloads

  t_start = time.perf_counter()
  res: dict = {"command": command if not quick else "python -m bench.run --quick", "quick": quick,
               "machine": machine_info()}
  log("[bench] matmul peak and copy bandwidth")
  res["peak"] = peak.measure(quick)
  peak_fp32 = res["peak"]["matmul_fp32"]["flops_per_s"]
  bandwidth = res["peak"]["copy"]["bytes_per_s"]
  def measured() -> dict:  # where the R entry came from: it may be merged into an older results.json
    m = res["machine"]
    return {"command": res["command"], "commit": m["commit"], "dirty": m["dirty"], "date_utc": m["date_utc"],
            "peak_fp32": peak_fp32, "bandwidth": bandwidth, "bandwidth_in_place": res["peak"]["copy"]["in_place"],
            "cpu_count": m["cpu_count"], "jax": m["jax"]}

  real_kw = dict(features=features, variants=variants, peer_python=peer_python)
  if only_tail:
    res["rollout_tail"] = measure_tail(quick, log)
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_start
    return res
  if only_real:
    res["grpo"] = {real: {**measure_real(real, peak_fp32, bandwidth, peers and not quick, model_dir, shared_prefill,
                                         steps=QUICK["grpo_steps"] if quick else (*REAL_STEPS[:2], real_blocks),
                                         log=log, only_peers=only_peers, quick=quick, phases=not remeasure_peers,
                                         **real_kw),
                          "measured": measured()}}
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_start
    return res

  res["learner"] = {}
  for name, spec in (QUICK["learner"] if quick else workloads.LEARNER).items():
    log(f"[bench] learner {name}")
    res["learner"][name] = {"model": spec["model"], **learner_mfu.measure(spec, peak_fp32, repeats=1 if quick else 3)}
  if not quick:  # the glibc huge-page tunable acts at process start: the other setting in a fresh process
    from jaxrl_llm import hugepages
    other = not hugepages.active()
    name = f"M, huge pages {'on' if other else 'off'} (fresh process)"
    log(f"[bench] learner {name}")
    res["learner"][name] = _guard(lambda: {"model": workloads.LEARNER["M"]["model"],
                                           **learner_mfu.measure_in_subprocess("M", peak_fp32, huge_pages=other)})

  log("[bench] sampler")
  res["sampler"] = sampler_tput.measure(peak_fp32, bandwidth, **(QUICK["sampler"] if quick else {}))

  warmup, block, rounds = QUICK["grpo_steps"] if quick else GRPO_STEPS
  res["grpo"] = {}
  ctxs = {}
  for name, model in (QUICK["grpo"] if quick else workloads.GRPO).items():
    if peers and not quick:
      log(f"[bench] GRPO step {name}: ours and Tunix (bench venv), {rounds} alternating blocks of {block} steps")
      peer = InterleavedPeer(name, warmup, block, rounds)  # warms up while ours builds and warms up
    else:
      log(f"[bench] GRPO step {name}: ours")
      peer = None
    ctxs[name] = grpo_step.build(model)
    ours = grpo_step.measure(ctxs[name], warmup=warmup, steps=block, rounds=rounds,
                             between=peer.turn if peer is not None else None)
    theirs = peer.result() if peer is not None else {"status": "skipped (--quick / --no-peers)"}
    ratio = theirs["total_s"] / ours["total_s"] if "total_s" in theirs else None
    res["grpo"][name] = {"model": model, "ours": ours, "tunix": theirs, "tunix_over_ours": ratio}

  sys_ctx = ctxs["tiny" if quick else "2L-d128"]  # already compiled and past its first steps
  res["system"] = {}
  if not quick:
    log("[bench] loop.run")
    res["system"]["loop_run"] = _guard(system.loop_run)
  log("[bench] checkpoint save/restore")
  # Two state sizes, so the table shows how save / restore time scales with the state.
  ck_models = {"tiny": _TINY} if quick else {f"learner {k}": workloads.LEARNER[k]["model"] for k in ("S", "M")}
  res["system"]["checkpoints"] = {name: _guard(lambda m=m: system.checkpoint_io(m)) for name, m in ck_models.items()}
  log("[bench] sparse sync")
  res["system"]["sparse_sync"] = _guard(lambda: system.sparse_sync(sys_ctx, sync_every=(1,) if quick else (1, 4)))
  res["system"]["sparse_sync_model"] = "tiny" if quick else "2L-d128"
  res["rollout_tail"] = measure_tail(quick, log)
  if real and not os.path.exists(os.path.join(model_dir or _default_model_dir(), "config.json")):
    res["real_skipped"] = f"workload {real}: no model folder {model_dir or _default_model_dir()} (`make smollm2` imports it)"
    log(f"[bench] {res['real_skipped']}")
  elif real:
    # Not the quick smoke run: in a fresh process, so the sections above leave nothing in its memory or allocator
    # (its phases' peak RSS then counts what R needs, as with --only-real).
    run_real = measure_real if quick else functools.partial(common.in_fresh_process, measure_real)
    res["grpo"][real] = run_real(real, peak_fp32, bandwidth, peers and not quick, model_dir, shared_prefill,
                                 steps=QUICK["grpo_steps"] if quick else (*REAL_STEPS[:2], real_blocks),
                                 log=log if quick else common.log_stderr, quick=quick, **real_kw)
    res["grpo"][real]["measured"] = measured()
  res["machine"]["loadavg_end"] = list(os.getloadavg())
  res["wall_s"] = time.perf_counter() - t_start
  return res


def measure_tail(quick: bool, log=print) -> dict:
  """The long-tail rollout section: `bench/continuous.py`'s static-vs-continuous row for each distribution,
  with the command that measures it alone and the load before and after."""
  from bench import continuous
  size = TAIL_QUICK if quick else TAIL
  out = {"command": "python -m bench.run --only-tail" + (" --quick" if quick else ""), "size": size,
         "loadavg_start": list(os.getloadavg()), "rows": []}
  for dist in continuous.DISTS:
    log(f"[bench] long-tail rollouts: {dist}")
    out["rows"].append(_guard(lambda d=dist: continuous.measure(d, **size)))
  out["loadavg_end"] = list(os.getloadavg())
  return out


def _guard(fn) -> dict:
  """A system measurement that fails (e.g. a module mid-rewrite) is reported, not fatal."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001 -- the table shows the failure instead
    return {"status": f"failed: {type(e).__name__}: {str(e)[:200]}"}


def _g(x: float, unit: str = "") -> str:
  """Three significant digits with an SI prefix: 1.23 G, 456 k."""
  if x is None or not math.isfinite(x):
    return "–"
  for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}".rstrip()


def _ms(x: float) -> str:
  return f"{1e3 * x:.1f} ms" if x < 10 else f"{x:.2f} s"


def _pct(x: float) -> str:
  return f"{100 * x:.1f} %"


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  cell = lambda c: str(c).replace("|", "\\|")  # a peer's stderr line may hold a '|' (progress bars)
  return "\n".join(lines + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows])


def _shape(m: dict) -> str:
  return f"L{m['n_layers']} d{m['d_model']} F{m['d_ff']} V{m['vocab_size']} H{m['n_heads']}/K{m['n_kv_heads']}"


def _toy_tables(res: dict) -> list[str]:
  """Learner, sampler, toy GRPO-vs-Tunix and system tables (the full bench's sections)."""
  out = []
  rows = []
  for name, r in sorted(res["learner"].items(), key=lambda kv: kv[1].get("matmul_params", 0)):
    if "step_s" not in r:
      rows.append([name, "", "", r.get("status", "failed")] + [""] * 6)
      continue
    rows.append([name, _shape(r["model"]), f"{r['batch']}×{r['seq_len']}", _ms(r["step_s"]), _g(r["tokens_per_s"]),
                 _g(r["achieved_flops_per_s"], "FLOP/s"), _pct(r["mfu"]),
                 _pct(r["hfu"]) if "hfu" in r else "–", _g(r["page_faults_per_step"]) if "page_faults_per_step" in r else "–",
                 str(r["compiles_after_warmup"])])
  out += ["**Learner step** (`learner.make_train_step`, ppo_clip; MFU = (6·N·tokens + attention) / time / fp32 peak; "
          "HFU = the FLOPs the step executes / time / fp32 peak)", "",
          _table(["config", "model", "B×T", "step (median)", "tokens/s", "achieved", "MFU", "HFU",
                  "page faults / step", "compiles after warm-up"], rows), ""]
  rows = []
  for r in res["sampler"]:
    rows.append([str(r["batch"]), str(r["new_tokens"]), _g(r["prefill_tokens_per_s"]), _pct(r["prefill_frac_of_bound"]),
                 _g(r["decode_tokens_per_s"]), f"{_pct(r['decode_frac_of_bound'])} ({r['decode_bound_kind']})"])
  s0 = res["sampler"][0]
  out += [f"**Sampler** (`sampling.generate`, prompt {s0['prompt_len']} tokens, fp32; bound = compute for prefill, "
          "max(compute, bytes / bandwidth) per decode step)", "",
          _table(["batch", "new tokens", "prefill tok/s", "of bound", "decode tok/s", "of bound"], rows), ""]
  rows = []
  by_size = lambda kv: (kv[1]["model"]["n_layers"], kv[1]["model"]["d_model"])
  toy = {k: v for k, v in res["grpo"].items() if "variant" not in v}
  for name, r in sorted(toy.items(), key=by_size):
    o, t = r["ours"], r["tunix"]
    rows.append([name, _ms(o["total_s"]), _ms(t["total_s"]) if "total_s" in t else "–",
                 f"{r['tunix_over_ours']:.2f}×" if r["tunix_over_ours"] else "–",
                 f"{o['rollouts_per_step']} × {o['completion_len_mean']:.1f} / "
                 + (f"{t['rollouts_per_step']} × {t['completion_len_mean']:.1f}" if "rollouts_per_step" in t else "–"),
                 f"{_ms(o['generate_s'])} / {_ms(o['ref_train_s'])} / {_ms(o['host_s'])}",
                 str(o["compiles_after_warmup"]),
                 t["status"] + (f" (tunix {t.get('tunix_version')})" if t["status"] == "ok" else "")])
  out += ["**Full GRPO step vs Tunix** (Qwen3-style, 8 prompts × 4, 16 new tokens, β = 0.04, colocated, char "
          "tokenizer, \"ab+cd=\"; median s/step after warm-up; Tunix/ours > 1 means ours is faster)", "",
          _table(["workload", "ours", "Tunix", "Tunix / ours", "rollouts × mean length (ours / Tunix)",
                  "ours: generate / ref + train / host",
                  "compiles after warm-up", "Tunix status"], rows), ""]
  rows = []
  for name, r in sorted(toy.items(), key=by_size):
    o = r["ours"]
    rows.append([f"GRPO step {name}: host time outside jitted work", f"{_ms(o['host_s'])} of {_ms(o['total_s'])} "
                 f"({_pct(o['host_s'] / o['total_s'])})"])
  sysr = res["system"]
  if "loop_run" in sysr:
    lr = sysr["loop_run"]
    rows.append(["`loop.run` step (2L-d128 shape, vocab 64, 8×4, 16 new tokens, β = 0.04)",
                 (f"time_step_s {_ms(lr['time_step_s'])}, time_generate_s {_ms(lr['time_generate_s'])}, "
                  f"compiles train/generate/score {lr['compiles_train_step']}/{lr['compiles_generate']}/"
                  f"{lr['compiles_score']}") if "time_step_s" in lr else lr.get("status", "?")])
  checkpoints = sysr.get("checkpoints") or {sysr.get("checkpoint_model", "?"): sysr.get("checkpoint", {})}
  for name, ck in checkpoints.items():
    rows.append([f"checkpoint save / restore (params + AdamW state, {name})",
                 f"{_g(ck['state_bytes'], 'B')}: save {_ms(ck['save_s'])} ({_g(ck['save_bytes_per_s'], 'B/s')}), "
                 f"restore {_ms(ck['restore_s'])} ({_g(ck['restore_bytes_per_s'], 'B/s')})"
                 if ck.get("status") == "ok" else ck.get("status", "?")])
  sp = sysr.get("sparse_sync", {})
  if sp.get("status") == "ok":
    for k, v in sp.items():
      if k.startswith("every_"):
        rows.append([f"sparse sync bf16 payload / dense ({sysr['sparse_sync_model']}), sync every {k[6:]} step(s)",
                     f"{_pct(v['payload_ratio'])} (changed elements {_pct(v['density'])})"])
  else:
    rows.append(["sparse sync", sp.get("status", "?")])
  out += ["**Loop and system**", "", _table(["measure", "value"], rows)]
  return out


def _copy_kind(copy: dict) -> str:
  """How the copy bandwidth was measured, for its column: in place, or (results before 2026-12-07) a fresh output."""
  return " in place" if copy.get("in_place") else ", a fresh output per call: page-fault bound"


def format_tables(res: dict) -> str:
  """The Markdown tables printed on stdout and embedded in bench/README.md."""
  m, p = res["machine"], res["peak"]
  out = [f"Command: `{res['command']}` · commit {m['commit']}{' (dirty)' if m['dirty'] else ''} · {m['date_utc']} · "
         f"{m['cpu_count']} CPU cores, JAX {m['jax']} ({m['backend']}, {m['device_kind']}) · load average "
         f"{m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end · bench wall {res['wall_s']:.0f} s"
         + (f" · huge pages {'on' if m['huge_pages'] else 'off'} (`jaxrl_llm/hugepages.py`)" if "huge_pages" in m else ""), ""]
  out += ["**Machine references** (measured with JAX in this run)", "",
          _table(["fp32 matmul peak", "bf16 matmul peak", "copy bandwidth (x + 1" + _copy_kind(p["copy"]) + ")"],
                 [[f"{_g(p['matmul_fp32']['flops_per_s'], 'FLOP/s')} (n={p['matmul_fp32']['n']})",
                   f"{_g(p['matmul_bf16']['flops_per_s'], 'FLOP/s')} (n={p['matmul_bf16']['n']})",
                   _g(p["copy"]["bytes_per_s"], "B/s")]]), ""]
  if "learner" in res:  # absent in a results file that `--only-real` started
    out += _toy_tables(res)
  if "rollout_tail" in res:
    out += ["", format_tail(res["rollout_tail"])]
  real = {k: v for k, v in res.get("grpo", {}).items() if "variant" in v}
  for name, r in real.items():
    out += ["", format_real(name, r)]
  if res.get("real_skipped"):
    out += ["", f"Workload R not measured: {res['real_skipped']}."]
  return "\n".join(out)


def _ours_features(feats: dict | None, remat) -> str:
  """What ours ran with: its speed features (`bench/features.py`) and remat."""
  from bench import features as features_lib
  f = features_lib.complete({k: v for k, v in (feats or {}).items() if k in features_lib.DEFAULTS})
  parts = [f"continuous batching ({f['slots']} slots, chunk {f['slot_chunk']})" if f["slots"] else "static batch",
           f"packed learner (width {f['pack_width']})" if f["pack_width"] else "padded learner"]
  if f["spec_gamma"]:
    parts.append(f"speculative decoding (γ {f['spec_gamma']}, {f['spec_draft_layers']} draft layers)")
  parts.append(f"remat {f['remat'] or remat}")
  return ", ".join(parts)


def _peer_features(peer: str, t: dict, w: dict, remat) -> str:
  """What a peer ran with, as far as its script sets it (and what it reported)."""
  ckpt = "gradient checkpointing" if remat in (True, "full") else "no gradient checkpointing"
  text = {"tunix": "static batch (vanilla rollout), padded learner"
                   + (f", remat {t['remat'].lower()}" if t.get("remat") else ""),
          "trl": "static batch (`generate`), padded learner, gradient checkpointing (TRL default)",
          "torch": f"static batch (`generate`), padded learner, {ckpt}"}[peer]
  if t.get("gradient_checkpointing") is not None:
    text = text.replace(ckpt, "gradient checkpointing" if t["gradient_checkpointing"] else "no gradient checkpointing")
  if t.get("device"):
    text += f", {t['device']}"
  if t.get("threads"):
    text += f", {t['threads']} thread(s)"
  return text


def _variants_table(name: str, r: dict) -> str:
  """Feature variants of ours (`--variants`): each took turns with ours and the peers in the same rounds."""
  o = r["ours"]
  peers = [p for p in PEER_LABELS if any(v.get(f"{p}_over_variant") for v in r["variants"].values())]
  rows = [["ours (as above)", _ours_features(r.get("features") or o.get("features"), r["model"]["remat"]),
           _ms(o["total_s"]), "1.00×"] + [f"{r[f'{p}_over_ours']:.2f}×" if r.get(f"{p}_over_ours") else "–"
                                          for p in peers]
          + [_feature_stats(o), f"{o['rollouts_per_step']} × {o['completion_len_mean']:.1f}",
             f"{_ms(o['generate_s'])} / {_ms(o['ref_train_s'])} / {_ms(o['host_s'])}", str(o["compiles_after_warmup"])]]
  for vname, v in r["variants"].items():
    vo = v["ours"]
    rows.append([f"ours + {vname}", _ours_features(v["features"], v.get("remat", r["model"]["remat"])),
                 _ms(vo["total_s"]), f"{v['baseline_over_variant']:.2f}×"]
                + [f"{v[f'{p}_over_variant']:.2f}×" if v.get(f"{p}_over_variant") else "–" for p in peers]
                + [_feature_stats(vo), f"{vo['rollouts_per_step']} × {vo['completion_len_mean']:.1f}",
                   f"{_ms(vo['generate_s'])} / {_ms(vo['ref_train_s'])} / {_ms(vo['host_s'])}",
                   str(vo["compiles_after_warmup"])])
  head = (f"**{name}: feature variants of ours** (`--variants`; each version of ours ran one block per round, the "
          "order rotating, in the same rounds as ours and the peers above; ours / variant > 1 means the variant is "
          "faster; peer / variant from the rounds with that peer; wasted slot-steps: decode slot-steps spent on "
          "finished or free rows; padding: the learner's padding token slots)")
  return "\n".join([head, "", _table(["version", "features", "s / step", "ours / variant"]
                                     + [f"{p} / variant" for p in peers]
                                     + ["wasted slot-steps · padding · spec accept", "rollouts × mean length",
                                        "generate / ref + train / host", "compiles after warm-up"], rows)])


def _feature_stats(o: dict) -> str:
  def pct(k):
    return _pct(o[k]) if k in o else "–"
  return f"{pct('slot_wasted')} · {pct('learner_pad_frac')} · {pct('spec_accept_rate')}"


def format_tail(t: dict) -> str:
  """The long-tail rollout table (`measure_tail`)."""
  rows = []
  for x in t["rows"]:
    if "dist" not in x:
      rows.append([x.get("status", "failed")] + [""] * 8)
      continue
    dist = (f"geometric (stop p = {x['stop_prob']:.3f} / step)" if x["dist"] == "geometric" else
            "episode-like (80 % ≤ N/8, 10 % mid, 10 % at the cap)")
    rows.append([dist, f"{x['requests']} × ≤ {x['new_tokens']}, {x['slots']} slots, chunk {x['chunk']}",
                 f"{x['length_mean']:.1f} ({_pct(x['at_cap'])} at the cap)",
                 f"{_g(x['static_tokens_per_s'])} / {_g(x['continuous_tokens_per_s'])}", f"{x['speedup']:.2f}×",
                 f"{_pct(x['static_wasted'])} / {_pct(x['continuous_wasted'])}",
                 f"{x['static_slot_steps']} / {x['continuous_slot_steps']}",
                 "yes" if x["same_tokens"] and x.get("realised_lengths_ok", True) else "**no**"])
  s = t["size"]
  return "\n".join([
      f"**Long-tail rollouts: static batches vs continuous batching** (`bench/continuous.py`, decode only; toy model "
      f"L{s['layers']} d{s['d_model']} V512; static = `sampling.generate` over batches of S requests, each decoding "
      "until its longest row stops; continuous = `sampling.continuous.generate_slots`, a slot refilled at the chunk "
      "boundary after its request stops; same per-request keys, so the same tokens; best of "
      f"{s['repeats']} after a compiling run; wasted = decode slot-steps on stopped or empty rows)", "",
      f"Measured by `{t['command']}` · load average {t['loadavg_start'][0]:.1f} at start, {t['loadavg_end'][0]:.1f} at end", "",
      _table(["lengths", "requests, slots", "mean length", "tok/s static / continuous", "speedup",
              "wasted static / continuous", "slot-steps static / continuous", "same tokens"], rows)])


PEER_LABELS = {"tunix": "Tunix (`GRPOLearner`, vanilla rollout)", "trl": "TRL (`GRPOTrainer`)",
               "torch": "plain PyTorch (`generate` + hand-written step)"}


def _real_targets(r: dict) -> list[list[str]]:
  """The issue's targets for workload R: [target, measured, met?]."""
  o, rf, mem = r["ours"], r["roofline"], r["memory"]
  yes = lambda ok: "yes" if ok else "**no**"
  # results before 2026-12-07: the bandwidth was the page-fault rate, so memory bounds came out too long
  stale = ("" if r.get("peak_at_phases", {}).get("bandwidth_in_place")
           else " (against the page-fault rate, bounds too long)")
  rows = []
  for peer, want in (("tunix", 1.5), ("trl", 2.0), ("torch", 1.5)):  # issue 46's targets
    got = r.get(f"{peer}_over_ours")
    rows.append([f"GRPO step ≥ {want}× {peer}", f"{got:.2f}×" if got else f"– ({r[peer].get('status', '?')[:60]})",
                 yes(got >= want) if got else "not measured"])
  tr = rf["train"]
  rows.append(["learner step ≥ 75 % of the fp32 peak", _pct(tr["of_peak_flops"]), yes(tr["of_peak_flops"] >= 0.75)])
  # issue 46: a memory-bound decode (batch 16) at >= 50 % of that bound, a compute-bound one (batch 64) at >= 60 %
  for dec in [rf["decode"]] + ([rf["decode_b64"]] if "decode_b64" in rf else []):
    if dec["bound_kind"] == "memory":
      rows.append([f"decode ≥ 50 % of its memory bound at batch {dec['batch']}", _pct(dec["of_bandwidth"]) + stale,
                   yes(dec["of_bandwidth"] >= 0.5)])
    else:
      rows.append([f"decode ≥ 60 % of its compute bound at batch {dec['batch']}", _pct(dec["of_peak_flops"]),
                   yes(dec["of_peak_flops"] >= 0.6)])
  st = rf["step"]
  rows.append(["whole step within 1.5× its lower bound", f"{st['measured_s'] / st['lower_bound_s']:.2f}×" + stale,
               yes(st["measured_s"] <= 1.5 * st["lower_bound_s"])])
  rows.append(["0 compilations after warm-up", str(o["compiles_after_warmup"]), yes(o["compiles_after_warmup"] == 0)])
  host = o["host_s"] / o["total_s"]
  rows.append(["host time ≤ 2 % of the step", f"{_ms(o['host_s'])} ({_pct(host)})", yes(host <= 0.02)])
  worst = max(mem[k]["over_budget"] for k in ("prefill", "decode", "reference", "train"))
  rows.append(["peak RSS ≤ 1.5× the budget from shapes", f"{worst:.2f}× (worst phase)", yes(worst <= 1.5)])
  return rows


def format_real(name: str, r: dict) -> str:
  """The tables of workload R (`measure_real`): peers, roofline per phase, memory, targets."""
  w, o, ms = r["workload"], r["ours"], r.get("measured", {})
  m = r["model"]
  head = (f"**GRPO step on the real model: workload {name}** ({os.path.basename(r['model_dir'].rstrip('/'))}, "
          f"{_shape(m)}, real weights and "
          f"tokenizer; chat-templated `arithmetic_chat` prompts, {o.get('prompt_len_mean', 0):.1f} tokens on average, bucket width {w['prompt_width']}; {w['prompts_per_step']} "
          f"prompts × {w['group_size']}, up to {w['max_new_tokens']} new tokens (stop at EOS), temperature "
          f"{w['temperature']}, k3 KL β = {w['beta']} to the initial weights, one update per batch, AdamW, fp32, "
          f"remat {m['remat']!r}{', shared-prompt prefill' if w.get('shared_prefill') else ''}; median s/step "
          "after warm-up; ours and one peer at a time take turns block by block, and each ratio is against the ours "
          "blocks that alternated with that peer; peer / ours > 1 means ours is faster)")
  if ms:
    head += (f"\n\nMeasured by `{ms['command']}` · commit {ms['commit']}{' (dirty)' if ms.get('dirty') else ''} · "
             f"{ms['date_utc']} · load average (uptime) {r['loadavg_start'][0]:.1f} / {r['loadavg_start'][1]:.1f} / "
             f"{r['loadavg_start'][2]:.1f} at start, {r['loadavg_end'][0]:.1f} at end · fp32 peak "
             f"{_g(ms['peak_fp32'], 'FLOP/s')}, copy bandwidth {_g(ms['bandwidth'], 'B/s')} (same run"
             f"{'' if ms.get('bandwidth_in_place') else '; a fresh output per call: page-fault bound'})")
  feats = r.get("features") or o.get("features")
  blocks = [x for x in o.get("loadavg_blocks", [])] + [x for v in r.get("variants", {}).values()
                                                        for x in v["ours"].get("loadavg_blocks", [])]
  if blocks:
    head += f" · load average during the blocks {min(blocks):.1f}–{max(blocks):.1f}"
  rows = [[f"jaxrl_llm (`bench/grpo_real.py`), {o['steps']} steps", _ms(o["total_s"]), "1.00×",
           f"{o['rollouts_per_step']} × {o['completion_len_mean']:.1f}", f"{o.get('reward_mean', float('nan')):.2f}",
           _ours_features(feats, m["remat"]), f"ok (compiles after warm-up: {o['compiles_after_warmup']})"]]
  for peer, label in PEER_LABELS.items():
    t = r[peer]
    ratio = r.get(f"{peer}_over_ours")
    ver = next((f" ({k.split('_')[0]} {v})" for k, v in t.items() if k.endswith("_version")), "")
    mine = r.get(f"ours_with_{peer}_s")
    if "remeasured" in t:
      rm = t["remeasured"]
      label += (f" (re-measured: `{rm['command']}`, {rm['date_utc']}, commit {rm['commit']}, load average "
                f"{rm['loadavg_start'][0]:.1f})")
    rows.append([label, _ms(t["total_s"]) if "total_s" in t else "–",
                 (f"{ratio:.2f}×" + (f" (ours {_ms(mine)} in those turns)" if mine else "")) if ratio else "–",
                 f"{t['rollouts_per_step']} × {t['completion_len_mean']:.1f}" if "rollouts_per_step" in t else "–",
                 f"{t['reward_mean']:.2f}" if "reward_mean" in t else "–", _peer_features(peer, t, w, m["remat"]),
                 t.get("status", "?") + (ver if t.get("status") == "ok" else "") + (f"; {t['note']}" if t.get("note") else "")])
  out = [head, "", _table(["side", "s / step", "peer / ours", "rollouts × mean length", "reward mean", "features",
                           "status"], rows), ""]
  if r.get("variants"):
    out += [_variants_table(name, r), ""]
  rows = []
  for ph in ("prefill", "decode", "reference", "train", "decode_b64"):
    if ph not in r["roofline"]:
      continue
    x = r["roofline"][ph]
    label = {"decode": f"decode (batch {x.get('batch')})",
             "decode_b64": f"decode at batch {x.get('batch')} (extra run, not in the step)"}.get(ph, ph)
    rows.append([label, _ms(x["seconds"]), _g(x["flops"], "FLOP"), _g(x["flops_per_s"], "FLOP/s"), _pct(x["of_peak_flops"]),
                 _g(x["bytes_per_s"], "B/s"), _pct(x["of_bandwidth"]), f"{_ms(x['bound_s'])} ({x['bound_kind']})",
                 _pct(x["of_bound"])])
  st = r["roofline"]["step"]
  rows.append(["whole step", _ms(st["measured_s"]), "", "", "", "", "", _ms(st["lower_bound_s"]),
               _pct(st["of_lower_bound"])])
  ph = r["phases"]
  pa = r.get("peak_at_phases")
  stale = "" if (pa or {}).get("bandwidth_in_place") else (
      "; that bandwidth wrote a fresh output per call, so it is the page-fault rate and the memory bounds here are "
      "too long: the fractions of bandwidth and of a memory bound overstate how close a phase is")
  against = (f"against the fp32 peak {_g(pa['fp32'], 'FLOP/s')} and bandwidth {_g(pa['bandwidth'], 'B/s')} measured "
             f"again right before the phases (load average {pa['loadavg'][0]:.1f}){stale}" if pa else
             "against the peak and bandwidth measured at the start of the run (the load changed since: a fraction "
             "over 100 % means the phase ran on a quieter machine than the peak)")
  out += [f"**{name}: roofline per phase** (ours, each phase timed alone after the turns, {against}; decode = generate − prefill, "
          f"{r['roofline']['decode']['steps']} decode steps at batch {r['roofline']['decode']['batch']}; train = fused "
          "reference + train step − reference scoring; FLOPs: 2·N per token forward, 6·N train, plus attention; "
          "bytes: parameters (+ KV cache read per decode step, + AdamW state for train); bound = max(FLOPs / peak, "
          "bytes / bandwidth); the step's lower bound is the sum of the four)", "",
          _table(["phase", "time", "model FLOPs", "achieved", "of peak", "bytes/s", "of bandwidth", "bound", "of bound"],
                 rows), ""]
  mem = r["memory"]
  view = mem["budget_parts"].get("decode_view", 0)  # counted since 2026-12-07
  rows = [[ph_name, _g(mem[ph_name]["peak_rss"], "B"), _g(mem[ph_name]["budget"], "B"), f"{mem[ph_name]['over_budget']:.2f}×",
           f"{mem[ph_name].get('over_budget_less_runtime', float('nan')):.2f}×"]
          for ph_name in ("prefill", "decode", "reference", "train")]
  out += [f"**{name}: memory** (peak RSS of the process during each phase, sampled every 10 ms, against the budget "
          f"from shapes: policy + reference + AdamW moments = {_g(mem['budget_parts']['resident'], 'B')}, plus the "
          "phase's KV cache / scoring logits / gradients + activations"
          + (f"; prefill and decode also the decode view's weight copy, {_g(view, 'B')}" if view else "")
          + "; `bench/grpo_real.py` `memory_budget`; the "
          f"runtime before the model was loaded held {_g(mem.get('runtime_rss', 0), 'B')})", "",
          _table(["phase", "peak RSS", "budget", "RSS / budget", "(RSS − runtime) / budget"], rows), ""]
  out += [f"**{name}: targets** (issue 46; reported, not asserted)", "",
          _table(["target", "measured", "met"], _real_targets(r))]
  return "\n".join(out)


README_HEAD = """# Benchmarks

Generated by `{command}` (do not edit by hand: the harness rewrites this file and `bench/results.json`).
Benchmarks are not tests; timings on a shared machine are noisy, so read the ratios (MFU against the
peak measured in the same run, fraction of the sampler bounds, Tunix / ours measured back to back).

What each number is:
- matmul peak: best FLOP/s of square `n×n @ n×n` (2·n³ FLOPs) in JAX; copy bandwidth: `x + 1` over 128 MiB,
  written over its input (donated). Results before 2026-12-07 wrote a fresh output per call, which measured the
  kernel's page faults rather than the memory (`python -m bench.peak` times both): their tables say so, and the
  memory bounds computed from them are too long (docs/performance.md).
- learner: one `learner.make_train_step` (ppo_clip, token-mean, AdamW) on synthetic full-length rows; N counts
  the parameters used in matmuls (embedding lookup excluded, lm-head included); attention adds
  3 · 2·L·H·hd·T FLOPs per token (causal). Compiles after warm-up come from the jitted step's cache
  and `jax.monitoring` compile events (target 0).
- sampler: `sampling.generate` on config M with EOS disabled; prefill = a call with one new token,
  decode = (time(N) − time(1)) / (B·(N − 1)), best-of-k times. A fraction of bound above 100 % means
  contention distorted that row (or the peak measured at the start).
- GRPO step: ours is `bench/grpo_step.py` (generate → reward → GRPO advantages → reference log-probs
  and train step with k3 KL, β = 0.04, in one program as `loop.run` does (`learner.fuse_reference`);
  π_old = sampler log-probs, one iteration per batch); Tunix's is
  `bench/peers/tunix_grpo.py` (`GRPOLearner`, vanilla rollout, same model shape and data, run from the
  separate `bench/.venv-bench`). Both use random-init weights (no hub). After both warm up, the two
  sides take turns: {rounds} blocks of {block} steps each, Tunix's process paused while ours runs and
  the reverse, so a change in machine speed during the run reaches both sides.
- sparse sync: the bf16 payload of `jaxrl_llm/rollout/sparse_sync.py` after real GRPO steps of the
  2L-d128 workload. With random-init weights every reward is 0, so the updates are AdamW-normalised
  noise from the KL term touching almost every weight: a worst case, not a trained-policy figure.
- our models: layers unrolled (`model.layer_unroll` = n_layers, as Tunix's models, which loop over layers in
  Python); the "M, layer_unroll=1" row is M with the layer scan rolled, for comparison.
- huge pages: with `JAXRL_LLM_HUGE_PAGES=1`, `make bench` restarts itself with glibc's `glibc.malloc.hugetlb=1`
  tunable, as the CLI does (`jaxrl_llm/hugepages.py`; off by default since 2026-12-07: slower in the GRPO loop on
  this machine); the Tunix subprocess inherits the setting. The learner row "M, huge pages on/off (fresh process)"
  measures M with the other setting; "page faults / step" counts the minor page faults of one step.
- HFU counts only the FLOPs the learner executes: it skips the last layer's query, attention output,
  MLP and lm-head at prompt positions, whose outputs are never scored (`query_start`); MFU keeps the
  usual 6·N·tokens + attention over every position.
- loop: host time = step wall time − blocked jitted parts (generate; reference scoring + train step, one program);
  `loop.run` rows report the loop's own `time_step_s` / `time_generate_s`.
- workload R (issue 17): the GRPO step on the real SmolLM2-135M-Instruct (`make smollm2` imports it): its
  weights, tokenizer and chat template, `arithmetic_chat` prompts, k3 KL β = 0.04 to the initial weights, one
  update per batch, fp32 (`bench/grpo_real.py`). R = 8 prompts × 8, 128 new tokens (`make bench-r`, slow on a
  CPU); R_small = 4 × 4, 64 new tokens, what `make bench` runs, in a fresh process of its own (as `--only-real`
  does; before 2026-12-07 it ran after the toy sections, whose freed memory its phases' RSS counted). Peers, each in
  `bench/.venv-bench` and taking
  turns with ours block by block (a peer's process is paused while any other side runs): Tunix
  (`bench/peers/tunix_grpo.py`, its Llama-3 family with the folder's config and safetensors, its vanilla
  sampler), TRL (`bench/peers/trl_grpo.py`, `GRPOTrainer`, `loss_type="grpo"`) and plain PyTorch
  (`bench/peers/torch_grpo.py`: `transformers` `generate` + a hand-written PPO-clip/k3-KL step with AdamW).
  All sides draw the same prompts in the same order and stop at EOS; torch and TRL pad prompts to the
  batch's longest, ours and Tunix to the bucket width. Roofline per phase: each phase of ours timed alone
  after the turns; memory: the process's peak RSS per phase against the budget from shapes. The "features"
  column says what each side ran with; the header gives the load average at start, at the end and at the end
  of each block of ours.
- speed features of ours on workload R (`bench/features.py`): `--features NAME=VALUE,...` sets ours' (`slots`,
  `slot_chunk`: continuous batching, `sampling.continuous`; `pack_width` (or `auto` = P + N): the packed learner,
  `jaxrl_llm/packing.py`; `spec_gamma`, `spec_draft_layers`: speculative decoding; `remat`: none / full / dots);
  `--variants 'A;B;...'` adds versions of ours with other feature sets, sharing the weights: in each round every
  version of ours runs a block (the order rotating), then the peer, so "ours / variant" and "peer / variant"
  come from the same rounds. Phases, roofline and memory are measured for ours only.
- long-tail rollouts (`bench/continuous.py`, decode only, toy models): static batches against continuous
  batching on geometric completion lengths and on episode-like ones (most short, a tail at the cap, realised
  exactly by a "chain" model whose token i predicts i + 1); `python -m bench.run --only-tail` measures it alone.
- on a GPU: `bash bench/gpu.sh` (CUDA JAX and a CUDA torch peer in their own venvs, workload R against plain
  PyTorch with feature variants, into `bench/results-gpu.json` and `bench/README-gpu.md`; see its header).
- speculative decoding on the real model (`bench/speculative.py`; not in `make bench`, as the drafter's distillation
  alone takes minutes): plain against speculative decode in the same run, each table with its command, commit and
  load in `bench/profiles/`: `speculative_head.md` (the EAGLE-style head drafter), `speculative_head_vocab.md` and
  `speculative_head_vocab_60.md` (the head over a 4096-token draft vocabulary, after 200 and 60 distillation
  batches), `speculative_head_vocab_sets.md` (the same head, 4 prompt sets per row), `speculative_head_ttt.md`
  (heads trained with EAGLE-3's training-time test over 1, 4 and 7 drafts on the same batches, each against the
  same plain decoding, 6 prompt sets per row).

Run it: `make bench` (creates `bench/.venv-bench` with `google-tunix` on first use; delete
`bench/.venv-bench/.tunix` to retry a failed install), or `python -m bench.run --no-peers` without
Tunix, or `python -m bench.run --quick` for a short smoke run (tiny shapes, meaningless numbers). `python -m
bench.run --render bench/results.json --readme bench/README.md` re-renders the tables without measuring;
`python -m bench.run --only-real [--real R]` measures workload R alone and merges it into `bench/results.json`.

"""


def write_readme(path: str, res: dict, tables: str) -> None:
  with open(path, "w") as f:
    head = README_HEAD.format(command=res["command"], block=GRPO_STEPS[1], rounds=GRPO_STEPS[2])
    f.write(head + "## Latest results\n\n" + tables + "\n")


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description="jaxrl_llm benchmarks (see bench/README.md)")
  ap.add_argument("--quick", action="store_true", help="tiny shapes, no peers: a smoke run")
  ap.add_argument("--no-peers", action="store_true", help="skip the Tunix comparison")
  ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results.json"))
  ap.add_argument("--readme", default="", help="rewrite this README with the tables")
  ap.add_argument("--render", default="", help="measure nothing: print (and --readme) the tables of this results.json")
  ap.add_argument("--real", default="R_small", choices=["R_small", "R", "none"],
                  help="workload R on the real SmolLM2-135M-Instruct: R_small (default; 4×4, 64 new tokens), "
                       "R (8×8, 128 new tokens: slow on a 2-core CPU) or none")
  ap.add_argument("--only-real", action="store_true",
                  help="measure the machine references and --real only; merge them into --out (toy rows kept)")
  ap.add_argument("--model", default=None, help="HF folder for --real (default: the imported SmolLM2-135M-Instruct)")
  ap.add_argument("--shared-prefill", action="store_true",
                  help="turn on the sampler's shared-prompt prefill for --real (when this checkout's SamplerConfig has it)")
  ap.add_argument("--command", default=None, help="the command recorded with the results (default: this one)")
  ap.add_argument("--peers", default="", help="with --only-real: comma-separated subset of tunix,trl,torch to "
                  "(re)measure against ours; only their rows of the existing entry are replaced")
  ap.add_argument("--features", default="", help="speed features of ours on --real, NAME=VALUE,... (bench/features.py: "
                  "slots, slot_chunk, pack_width (int or auto), spec_gamma, spec_draft_layers, remat)")
  ap.add_argument("--variants", action="append", default=[],
                  help="further feature sets of ours on --real, ';'-separated (repeatable): each takes turns with "
                       "ours and the peers in the same rounds, e.g. 'slots=16,slot_chunk=8;pack_width=auto;remat=none'")
  ap.add_argument("--real-blocks", type=int, default=REAL_STEPS[2],
                  help=f"--real: blocks of {REAL_STEPS[1]} step(s) each side runs, taking turns (default "
                       f"{REAL_STEPS[2]}); more for a closer comparison of ours' variants")
  ap.add_argument("--only-tail", action="store_true",
                  help="measure the machine references and the long-tail rollout section only; merge into --out")
  ap.add_argument("--peer-python", default=BENCH_PYTHON,
                  help="the python of the peers' virtualenv (default bench/.venv-bench; bench/gpu.sh passes its own)")
  args = ap.parse_args(argv)
  if args.render:
    with open(args.render) as f:
      res = json.load(f)
    tables = format_tables(res)
    print(tables)
    if args.readme:
      write_readme(args.readme, res, tables)
    return res
  t0 = time.perf_counter()
  real = None if args.real == "none" or (args.quick and "--real" not in (argv or sys.argv)) else args.real
  if args.only_real and real is None:
    ap.error("--only-real needs --real R_small or R")
  command = args.command or "python -m bench.run " + " ".join(sys.argv[1:] if argv is None else argv)
  only_peers = tuple(p for p in args.peers.split(",") if p)
  if set(only_peers) - set(REAL_PEERS) or (only_peers and not args.only_real):
    ap.error(f"--peers={args.peers!r}: a subset of {','.join(REAL_PEERS)}, with --only-real")
  from bench import features as features_lib, workloads
  try:
    features = features_lib.parse(args.features)
    features_lib.complete(features)
    variants = features_lib.parse_variants(args.variants)
    for v in variants.values():
      features_lib.complete(v)
  except ValueError as e:
    ap.error(f"--features / --variants: {e}")
  if (features or variants) and (real is None or args.only_tail):
    ap.error("--features / --variants act on workload R: give --real R_small or R (not with --only-tail)")
  if args.only_tail and args.only_real:
    ap.error("--only-tail and --only-real: one at a time")
  if args.real_blocks < 1:
    ap.error(f"--real-blocks={args.real_blocks}: at least 1")
  old = {}
  if os.path.exists(args.out):  # merged into: the other rows stay (a full run keeps the real workloads it skipped)
    with open(args.out) as f:
      old = json.load(f)
  # --peers with an existing entry of this workload: re-measure those peers' rows only (the rest of it stays)
  remeasure = bool(only_peers) and real in old.get("grpo", {})
  res = collect(args.quick, peers=not args.no_peers, real=real, only_real=args.only_real, model_dir=args.model,
                shared_prefill=args.shared_prefill, command=command, only_peers=only_peers, features=features,
                variants=variants, only_tail=args.only_tail, peer_python=args.peer_python, remeasure_peers=remeasure,
                real_blocks=args.real_blocks,
                log=lambda s: print(f"{s} (t={time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True))
  if args.only_tail:  # keep every other row of the existing results
    if old:
      old["rollout_tail"] = res["rollout_tail"]
    res = old or res
  elif args.only_real:  # keep every other row of the existing results (the toy history stays comparable)
    new = res["grpo"][real]  # (no --out yet: a new file holds this run's machine references and R alone)
    if remeasure:  # replace these peers' rows only, noting where they came from
      entry = old["grpo"][real]
      for n in only_peers:
        entry[n] = {**new[n], "remeasured": {**new["measured"], "loadavg_start": new["loadavg_start"],
                                             "loadavg_end": new["loadavg_end"]}}
        for k in (f"{n}_over_ours", f"ours_with_{n}_s"):
          entry[k] = new[k]
        for v in entry.get("variants", {}).values():  # from the first run's rounds: stale against the new row
          v.pop(f"{n}_over_variant", None)
    elif old:
      old.setdefault("grpo", {})[real] = new
    res = old or res
  else:  # a real workload measured on its own before (`make bench-r`'s R) and not in this run stays
    for name, entry in old.get("grpo", {}).items():
      if name in workloads.REAL:
        res["grpo"].setdefault(name, entry)
  tables = format_tables(res)
  print(tables)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=2)
  if args.readme:
    write_readme(args.readme, res, tables)
  return res


if __name__ == "__main__":
  from jaxrl_llm import hugepages
  hugepages.reexec_with_huge_pages()  # with JAXRL_LLM_HUGE_PAGES=1, as the CLI; the Tunix subprocess inherits it
  main()
