"""Which run-level features run together: every pair of them validated, and the pairs still refused, with why.

`FEATURES` names the features a researcher switches on (run modes, mesh, LoRA, packing, slots, speculative
decoding, cache formats, μ records, episodes, teachers, MoE, replay, sparse sync, the harness, several processes,
...), each as the config fields it sets on `configs/tiny.py` (`BASE` first). A pair merges both; two features
that set one field to different values are alternatives (two run modes, two losses), not a pair.

`REFUSED` lists the pairs `config.validate` refuses, each with the reason a researcher should read. It is checked,
not trusted: `probe()` validates every pair (forced CPU devices for the mesh; "processes" pretends to be one of
2 processes over the same 8 devices), and tests/test_compat.py fails when validation refuses a pair `REFUSED`
does not list, or `REFUSED` lists a pair that validates. `python -m jaxrl_llm.compat > docs/compat.md` renders
the page; `--run` also runs every allowed pair (`--among a,b,...`: the pairs of those features; `--with a`: the
pairs of a) for one learner step (`run_pairs`, minutes) and reports the failures, which `config.validate` should
turn into refusals or the code into runs. A pair whose metrics do not show both features on (`EVIDENCE`) fails as
well.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import sys
from typing import Any

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
DEVICES = 8  # the probe's forced CPU devices (mesh features below use all of them)
# Every pair starts from configs/tiny.py without its warm start and evaluation (features add them).
BASE = {"sft.steps": 0, "eval.every": 0, "num_steps": 1, "checkpoint.every": 0, "log.tensorboard": False}

_EPISODES = {"env.name": "guess_number", "env.kwargs": {"max_turns": 4}, "env.max_turns": 4, "env.turn_tokens": 3,
             "env.max_episode_tokens": 16, "env.timeout_s": 5.0, "env.prompt_width": 8,
             "env.newest_each_turn": True, "env.kv_cache": True, "env.evict": "none", "env.context_budget": 0,
             "env.keep_last_turns": 1}  # configs/agent_tiny.py's environment
_TEACHER = {"distill.teacher": "sft", "distill.teacher_n_layers": 2, "distill.teacher_d_model": 64,
            "distill.teacher_sft_steps": 150, "distill.temperature": 0.0, "distill.topk": 16,
            "distill.teacher_cache_dir": "", "distill.ref_teacher": "", "distill.ref_teacher_n_layers": 4,
            "distill.ref_teacher_d_model": 256, "distill.ref_teacher_sft_steps": 500,
            "loss.name": "opd_reverse_kl", "loss.agg_mode": "token-mean"}  # configs/opd_tiny.py's teacher
_SPEC = {"sampler.spec_gamma": 2, "sampler.spec_draft_layers": 1}

# name -> (what it is, fields set)
FEATURES: dict[str, tuple[str, dict[str, Any]]] = {
    "fixed_lag": ("rollout.mode='fixed_lag' (lag 1)", {"rollout.mode": "fixed_lag", "rollout.lag": 1}),
    "staged": ("rollout.mode='staged' (stages of 2)", {"rollout.mode": "staged", "rollout.lag": 2}),
    "async": ("rollout.mode='async' (η = 1)", {"rollout.mode": "async", "rollout.lag": 1}),
    "partial": ("async partial rollouts (rollout.partial_chunk)",
                {"rollout.mode": "async", "rollout.lag": 1, "rollout.partial_chunk": 2,
                 # 8 new tokens: a speculating chunk (up to γ + 1 = 3 tokens per call) still stops before the end
                 "sampler.max_new_tokens": 8}),
    "replay": ("experience replay (rollout.replay.capacity)",
               {"rollout.mode": "fixed_lag", "rollout.lag": 1, "rollout.replay.capacity": 8,
                "rollout.replay.fresh_per_step": 2}),
    "harness": ("rollout.mode='harness' (an agent harness on the OpenAI endpoint)",
                {"rollout.mode": "harness", "rollout.lag": 1, "rollout.prompts_per_step": 2,
                 "serve.harness": "jaxrl_llm.serve.example_harness:run", "serve.max_context": 704,
                 "serve.max_tokens": 8, "serve.prompt_width": 640,  # configs/harness_tiny.py's widths
                 # an episode's first call waits for the endpoint's compile: on a loaded machine (a mesh's, or
                 # the suite beside it) that passed the 60 s default and every episode failed
                 "serve.timeout_s": 600.0}),
    "mesh": ("a multi-device config.mesh (data 2 × fsdp 4)", {"mesh.data": 2, "mesh.fsdp": 4}),
    "sampler_devices": ("sampler devices of its own (rollout.sampler_devices 2, learner data 3 × fsdp 2)",
                        {"mesh.data": 3, "mesh.fsdp": 2, "rollout.sampler_devices": 2}),
    "processes": ("several processes (2, one mesh data 2 × fsdp 4 over their devices)",
                  {"mesh.data": 2, "mesh.fsdp": 4}),
    "sft": ("an SFT warm start (sft.steps)", {"sft.steps": 150}),
    "lora": ("LoRA adapters (model.lora.rank)", {"model.lora.rank": 4, "model.lora.alpha": 8.0}),
    "qlora": ("QLoRA (model.lora.base_quantize='int8')",
              {"model.lora.rank": 4, "model.lora.alpha": 8.0, "model.lora.base_quantize": "int8"}),
    "moe": ("an MoE model (model.num_experts 4, routing replay on)", {"model.num_experts": 4}),
    "pr2": ("an MoE model with predictive routing replay (model.routing_replay='PR2')",
            {"model.num_experts": 4, "model.routing_replay": "PR2"}),
    "packing": ("the packed learner (optim.pack_width; wide enough for a harness row)", {"optim.pack_width": 704}),
    "grad_accum": ("micro-batches (optim.grad_accum 2)", {"optim.grad_accum": 2}),
    "kl_ref": ("a KL term to the reference policy (loss.kl_coef)", {"loss.kl_coef": 0.05}),
    "ewma": ("PPO-EWMA's anchor (rollout.old_logp='ewma')", {"loss.name": "ppo_ewma", "rollout.old_logp": "ewma"}),
    "sparse_sync": ("sparse weight sync (rollout.weight_sync='sparse')", {"rollout.weight_sync": "sparse"}),
    "bf16_sampler": ("a bfloat16 sampler (sampler.dtype)", {"sampler.dtype": "bfloat16"}),
    "int8_sampler": ("an int8 weight-only sampler (sampler.quantize)", {"sampler.quantize": "int8"}),
    "kv_int8": ("an int8 sampler KV cache (sampler.kv_cache='int8')", {"sampler.kv_cache": "int8"}),
    # 1 + 2 < N = 4: static batches decode from the ring buffer (models/cache.py's ring_layout)
    "kv_window": ("a sinks + window sampler KV cache (sampler.kv_cache='window')",
                  {"sampler.kv_cache": "window", "sampler.kv_sinks": 1, "sampler.kv_window": 2}),
    "mu_topk": ("μ's top-k candidates recorded (sampler.behavior_topk)", {"sampler.behavior_topk": 4}),
    "mc_samples": ("μ's Monte-Carlo candidates recorded (sampler.mc_samples)", {"sampler.mc_samples": 2}),
    "slots": ("continuous batching (rollout.slots)", {"rollout.slots": 8}),
    "speculative": ("speculative decoding, the policy's first layer drafting (sampler.spec_gamma)", _SPEC),
    "drafter": ("the distilled drafter (sampler.spec_drafter='distilled')",
                {**_SPEC, "sampler.spec_drafter": "distilled"}),
    "head_drafter": ("the EAGLE-style head drafter over a 16-token draft vocabulary, trained on 2 drafts per chain "
                     "(sampler.spec_drafter='head')",
                     {**_SPEC, "sampler.spec_drafter": "head", "sampler.spec_head_vocab": 16,
                      "sampler.spec_head_ttt": 2}),
    "episodes": ("multi-turn episodes (env.name; configs/agent_tiny.py's)", _EPISODES),
    "eviction": ("episodes with context eviction (env.evict='drop_oldest')",
                 {**_EPISODES, "env.evict": "drop_oldest", "env.context_budget": 8}),
    "teacher": ("on-policy distillation from a teacher (distill.teacher; configs/opd_tiny.py's)", _TEACHER),
    "echo": ("ECHO's cascaded rollout with a co-evolving critic (rollout.echo.on)", {"rollout.echo.on": True}),
    "pats": ("Pats' evidence-card scaffold (rollout.pats.on)", {"rollout.pats.on": True}),
}



def _positive(*names: str):
  return lambda m: any((m.get(n) or 0) > 0 for n in names)


def _has(*names: str):
  return lambda m: any(n in m for n in names)


# What shows in a run's metrics that a feature was on: (the metrics, a predicate on one metrics row). `run_pairs`
# fails a pair when one of its features' predicates holds on none of the run's rows: a feature silently dropped by
# the other (a driver that takes another path) is a failure, not a pass. Features without an entry change where or how
# the work runs (mesh, processes, remat), or what the learner optimises, not what a sampler's metrics can show.
EVIDENCE: dict[str, tuple[str, Any]] = {
    "async": ("async_lag_hist", _has("async_lag_hist")),
    "partial": ("gen_partial_polls > 0", _positive("gen_partial_polls")),
    "replay": ("replay_size > 0", _positive("replay_size")),
    "harness": ("serve_episodes > serve_failed",
                lambda m: (m.get("serve_episodes") or 0) > (m.get("serve_failed") or 0)),
    "moe": ("routes_replayed", _positive("routes_replayed")),
    "kv_int8": ("gen_kv_bits < 16 (int8 keys and values, scales included)",
                lambda m: 0 < m.get("gen_kv_bits", 99) < 16),
    "kv_window": ("kv_window > 0", _positive("kv_window")),
    "mu_topk": ("mu_topk_mass > 0", _positive("mu_topk_mass")),
    "mc_samples": ("mu_mc_hit", _has("mu_mc_hit")),
    "slots": ("slot_steps, async_slot_steps, env_slot_steps or serve_slot_steps > 0",
              _positive("slot_steps", "async_slot_steps", "env_slot_steps", "serve_slot_steps")),
    "speculative": ("spec_accept_rate", _has("spec_accept_rate")),
    "drafter": ("spec_accept_rate and spec_drafter_kl", lambda m: "spec_accept_rate" in m and "spec_drafter_kl" in m),
    "head_drafter": ("spec_accept_rate and spec_head_vocab_hit",
                     lambda m: "spec_accept_rate" in m and "spec_head_vocab_hit" in m),
    "episodes": ("env_turns > 0", _positive("env_turns")),
    "eviction": ("env_turns > 0 and env_evictions", lambda m: (m.get("env_turns") or 0) > 0 and "env_evictions" in m),
}


def inactive(names, rows: list[dict]) -> list[str]:
  """The features of `names` with an `EVIDENCE` entry that no metrics row of `rows` shows."""
  return [n for n in names if n in EVIDENCE and not any(EVIDENCE[n][1](r) for r in rows)]


def pair(a: str, b: str) -> frozenset:
  return frozenset((a, b))


def _each(reason: str, a, bs) -> dict[frozenset, str]:
  """`reason` for the pairs of every feature in `a` with every feature in `bs`."""
  a = (a,) if isinstance(a, str) else a
  return {pair(x, y): reason for x in a for y in bs}


_EPS = ("episodes", "eviction")
# The pairs still refused, each with its reason ("inherent: ..." where no implementation could run the pair;
# otherwise what is missing). Keep it short: a refusal is a last resort (docs/compat.md).
REFUSED: dict[frozenset, str] = {
    pair("partial", "slots"): "inherent: async slots already switch to the newest version at every slot_chunk "
                              "boundary, keeping the cache: partial_chunk would be a second, conflicting switch",
    **_each("inherent: async episodes switch versions between turns (env.newest_each_turn); a switch inside a turn "
            "would need the environment's tokens re-scored mid-turn", "partial", _EPS),
    **_each("inherent: in harness mode the harness is the environment", "harness", _EPS),
    pair("echo", "partial"): "not built: a version switch inside ECHO's cascade of three dependent sampler calls "
                             "(attempt, diagnoses, refinements); async ECHO runs each request with one version",
    **_each("not built: a critique turn inside a multi-turn episode (ECHO runs on single completions)", "echo",
            _EPS),
    pair("echo", "harness"): "inherent: in harness mode the harness decides every call; ECHO's cascade is a "
                             "sampling schedule of its own",
    **_each("not built: cards in an episode's first message (Pats runs on single completions)", "pats", _EPS),
    pair("pats", "harness"): "inherent: in harness mode the harness writes every prompt",
    pair("pats", "echo"): "not built: cards in ECHO's attempt prompts (each runs on its own)",
}


def merged(names) -> dict | None:
  """The fields of `names` together (BASE first), or None when two of them set one field differently."""
  out = dict(BASE)
  for n in names:
    for k, v in FEATURES[n][1].items():
      if k in out and k not in BASE and out[k] != v:
        return None
      out[k] = v
  return out


def config_of(fields: dict):
  """configs/tiny.py with `fields` set (dotted names; a dict value becomes a section)."""
  import ml_collections

  from jaxrl_llm.config import load_file
  c = load_file(CONFIG_DIR / "tiny.py")
  for k, v in fields.items():
    *path, key = k.split(".")
    node = c
    for p in path:
      if p not in node:
        node[p] = ml_collections.ConfigDict()
      node = node[p]
    node[key] = ml_collections.ConfigDict(v) if isinstance(v, dict) else v
  return c


@contextlib.contextmanager
def _processes(n: int):
  """`config.validate` as one of `n` processes would run it (its multi-process rules); devices as they are."""
  import jax
  saved = jax.distributed.is_initialized, jax.process_count
  jax.distributed.is_initialized, jax.process_count = (lambda: True), (lambda: n)
  try:
    yield
  finally:
    jax.distributed.is_initialized, jax.process_count = saved


def check(names) -> str | None:
  """None when the features `names` validate together, else the one-line ConfigError."""
  from jaxrl_llm import config as config_lib
  from jaxrl_llm import loop  # noqa: F401 -- as the CLI: the run modes and the needs components provide register
  fields = merged(names)
  assert fields is not None, names
  ctx = _processes(2) if "processes" in names else contextlib.nullcontext()
  try:
    with ctx:
      config_lib.validate(config_of(fields))
  except config_lib.ConfigError as e:
    return str(e)
  return None


def pairs() -> list[tuple[str, str]]:
  """Every pair of features that is a pair (not alternatives), in `FEATURES` order."""
  return [(a, b) for a, b in itertools.combinations(FEATURES, 2) if merged((a, b)) is not None]


def chosen(among: list[str] | None = None, one: str | None = None) -> set[tuple[str, str]] | None:
  """The pairs `--run` runs: every pair (None), the pairs among the features `among`, or the pairs of feature `one`
  with every other (with those `among` names, if given)."""
  unknown = sorted((set(among or ()) | {one}) - {None} - FEATURES.keys())
  if unknown:
    raise SystemExit(f"--among / --with: unknown features {unknown}")
  if one is not None:
    return {p for p in pairs() if one in p and (among is None or set(p) - {one} <= set(among))}
  return None if among is None else {p for p in pairs() if set(p) <= set(among)}


def probe() -> dict[tuple[str, str], str | None]:
  """{pair: None or its ConfigError} for every pair (needs `DEVICES` visible devices)."""
  import jax
  if jax.device_count() != DEVICES:
    raise RuntimeError(f"the compatibility probe needs {DEVICES} devices (XLA_FLAGS="
                       f"--xla_force_host_platform_device_count={DEVICES}), not {jax.device_count()}")
  return {p: check(p) for p in pairs()}


def run_pairs(workdir: str, only=None) -> dict[tuple[str, str], str | None]:
  """Runs every pair that validates (or `only`) for one learner step in this process; {pair: None or the error}. A
  run whose metrics do not show one of its features (`EVIDENCE`) fails too. Several processes are not run here
  (tests/test_multiprocess_cli.py)."""
  import traceback

  import jax

  from jaxrl_llm import loop
  from jaxrl_llm.metrics import read_jsonl
  out = {}
  checked = probe() if only is None else {p: check(p) for p in pairs() if p in only}
  for p, err in checked.items():
    if err is not None or "processes" in p:
      continue
    jax.clear_caches()  # hundreds of runs' compiled programs would exhaust the process's memory maps
    try:
      wd = os.path.join(workdir, "__".join(p))
      loop.run(config_of(merged(p)), wd)
      off = inactive(p, read_jsonl(os.path.join(wd, "metrics.jsonl")))
      out[p] = None if not off else "not shown in the metrics: " + "; ".join(f"{n} ({EVIDENCE[n][0]})" for n in off)
    except Exception as e:  # noqa: BLE001 -- any failure of a pair is the result
      out[p] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
      traceback.print_exc()
    print(f"{' x '.join(p)}: {out[p] or 'ok'}", file=sys.stderr, flush=True)
  return out


def render(result: dict[tuple[str, str], str | None]) -> str:
  """docs/compat.md from a probe's result."""
  names = list(FEATURES)
  refused = {p: e for p, e in result.items() if e is not None}
  lines = ["# Feature compatibility", "",
           "Generated by `python -m jaxrl_llm.compat > docs/compat.md` from `jaxrl_llm/compat.py` and "
           "`config.validate`; `tests/test_compat.py` fails when the two disagree.", "",
           f"{len(names)} run-level features, {len(result)} pairs (two features that set one field differently, "
           f"such as two run modes or two losses, are alternatives, not pairs). **{len(refused)} pairs are "
           f"refused**; every other pair validates, and `python -m jaxrl_llm.compat --run` runs each for one "
           "learner step (`--among a,b,...`: the pairs among those features; `--with a`: the pairs of a).", "",
           "## Refused pairs", ""]
  if refused:
    lines += ["| pair | why | the error |", "|---|---|---|"]
    for (a, b), err in sorted(refused.items(), key=lambda kv: (names.index(kv[0][0]), names.index(kv[0][1]))):
      why = REFUSED.get(pair(a, b), "(not listed in REFUSED)").replace("|", "\\|")
      lines.append(f"| `{a}` × `{b}` | {why} | `{err.replace('|', '/')}` |")
  else:
    lines.append("None.")
  lines += ["", "## Features", "",
            "*Shows as*: the metrics that show the feature was on in a run (`compat.EVIDENCE`; `--run` fails a pair "
            "whose metrics do not show both features).", "",
            "| feature | what | fields (on configs/tiny.py) | shows as |", "|---|---|---|---|"]
  for n, (what, fields) in FEATURES.items():
    shown = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    ev = f"`{EVIDENCE[n][0]}`" if n in EVIDENCE else ""
    lines.append(f"| `{n}` | {what} | {shown.replace('|', '/')} | {ev} |")
  lines += ["", f"Every pair starts from `configs/tiny.py` with {', '.join(f'{k}={v!r}' for k, v in BASE.items())}.",
            ""]
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  if "jax" not in sys.modules:  # the mesh features need the probe's devices
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={DEVICES}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "--json" in argv:  # tests/test_compat.py: the probe's result and each feature alone
    import json
    out = {"singles": {n: check((n,)) for n in FEATURES}, "pairs": [[a, b, e] for (a, b), e in probe().items()]}
    print(json.dumps(out))
    return
  if "--run" in argv:  # `--run [--among a,b,c] [--with a]`: every pair, the named features' pairs, or a's
    import tempfile
    among = argv[argv.index("--among") + 1].split(",") if "--among" in argv else None
    only = chosen(among, argv[argv.index("--with") + 1] if "--with" in argv else None)
    with tempfile.TemporaryDirectory() as d:
      result = run_pairs(d, only)
    failed = {p: e for p, e in result.items() if e is not None}
    for p, e in failed.items():
      print(f"{' x '.join(p)}: {e}")
    print(f"{len(result)} pairs ran, {len(failed)} failed")
    return
  sys.stdout.write(render(probe()))


if __name__ == "__main__":
  main(sys.argv[1:])
