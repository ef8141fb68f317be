"""Smoke test of the benchmark harness: modules import, the FLOP model is right, a --quick run completes.

Benchmarks are not tests: nothing here asserts a wall time.
"""

import json
import math
import mmap
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from bench import common, grpo_step, run, workloads
from jaxrl_llm.models import ModelConfig, init_params


def _cfg(**kw):
  return ModelConfig(**{**workloads.LEARNER["S"]["model"], **kw})


def test_matmul_params_by_hand():
  # S: 2 layers × (q 128·128 + k,v 2·128·64 + o 128·128 + SwiGLU 3·128·512) + lm-head 128·256.
  assert common.matmul_params(_cfg()) == 2 * (16384 + 16384 + 16384 + 196608) + 32768 == 524288
  # A tied lm-head is the embedding: still one D·V matmul per token.
  assert common.matmul_params(_cfg(tie_embeddings=True)) == 524288


def test_train_flops_by_hand():
  cfg = _cfg()
  # causal attention, 10 keys: 4·L·H·hd·T / 2 = 4·2·4·32·10 / 2
  assert common.attention_flops_per_token(cfg, 10) == 5120
  assert common.attention_flops_per_token(cfg, 10, causal=False) == 10240
  assert common.train_flops(cfg, 1, 10) == 10 * (6 * 524288 + 3 * 5120)
  assert common.forward_flops(cfg, 3, 10) == 3 * (2 * 524288 + 5120)


def test_skipped_train_flops_by_hand():
  # Last layer at 3 unscored positions: q, o (2·128·128), SwiGLU (3·128·512), lm-head (128·256), ×6;
  # attention of positions 0, 1, 2 (1 + 2 + 3 keys): 3 · 4·H·hd · 6 = 3 · 4·4·32 · 6.
  assert common.skipped_train_flops(_cfg(), 2, 3) == 2 * (3 * 6 * (32768 + 196608 + 32768) + 3 * 512 * 6)
  assert common.skipped_train_flops(_cfg(), 2, 0) == 0


def test_prefill_flops_by_hand():
  # lm-head (128·256 = 32768) on the last position only: 2·10 positions through the body + 2 heads.
  assert common.prefill_flops(_cfg(), 2, 10) == 20 * (2 * (524288 - 32768) + 5120) + 2 * 2 * 32768


@pytest.mark.parametrize("tie", [False, True])
def test_param_bytes_matches_init(tie):
  cfg = _cfg(tie_embeddings=tie)
  params = init_params(cfg, jax.random.key(0))
  assert common.param_bytes(cfg, 4) == sum(x.nbytes for x in jax.tree.leaves(params))


def test_kv_cache_bytes():
  cfg = _cfg()
  assert common.kv_cache_bytes(cfg, 3, 5, 2) == 2 * 2 * 2 * 3 * 5 * 2 * 32


def test_count_compiles_sees_a_new_shape():
  f = jax.jit(lambda x: x * 3.0)
  f(np.ones(2, np.float32))
  with common.count_compiles() as n_same:
    f(np.ones(2, np.float32))
  with common.count_compiles() as n_new:
    f(np.ones(5, np.float32))
  assert (n_same[0], n_new[0]) == (0, 1)


def test_in_fresh_process_starts_from_nothing():
  """`make bench` measures workload R in a fresh interpreter: its compile counter starts at zero there while this
  process's has counted compilations, and the result comes back."""
  before = common.compile_events()
  jax.jit(lambda x: x + 1.0)(np.ones(3, np.float32))
  assert common.compile_events() > before and common.in_fresh_process(common.compile_events) == 0
  assert common.in_fresh_process(divmod, 7, 2) == (3, 1)


def test_peer_without_bench_venv():
  peer = run.InterleavedPeer("2L-d128", 1, 1, 2, python="/nonexistent/python")
  peer.turn()
  out = peer.result()
  assert "missing" in out["status"] and "total_s" not in out


# A stand-in for bench/peers/tunix_grpo.py speaking its --rounds protocol; FAKE_PEER picks a behaviour.
_FAKE_PEER = """
import json, os, sys, time
rounds = int(sys.argv[sys.argv.index("--rounds") + 1])
mode = os.environ["FAKE_PEER"]
gos = 0
for r in range(rounds):
  print(json.dumps({"status": "paused", "steps_done": r}), flush=True)
  if mode == "dies":
    sys.exit(3)
  if mode == "hangs":
    time.sleep(60)
  gos += bool(sys.stdin.readline())
print(json.dumps({"status": "ok", "total_s": 0.5, "gos": gos}), flush=True)
"""


@pytest.mark.parametrize("mode", ["ok", "dies", "hangs"])
def test_interleaved_peer_takes_turns_and_survives_a_bad_peer(tmp_path, monkeypatch, mode):
  script = tmp_path / "peer.py"
  script.write_text(_FAKE_PEER)
  monkeypatch.setenv("FAKE_PEER", mode)
  peer = run.InterleavedPeer("w", 1, 2, 3, python=sys.executable, script=str(script), timeout_s=5)
  for _ in range(4):  # after the warm-up, then after each of the 3 blocks: what grpo_step.measure calls
    peer.turn()
  out = peer.result()
  if mode == "ok":
    assert out == {"status": "ok", "total_s": 0.5, "gos": 3}  # one go-ahead per block
  elif mode == "dies":
    assert out["status"].startswith("no result (exit 3)")
  else:
    assert out["status"] == "timed out after 5 s"


def test_tunix_pauses_once_per_round_and_leaves_the_pause_out():
  from bench.peers import tunix_grpo as tg
  warmup, steps, rounds = 2, 3, 4
  timed = [n - warmup for n in range(1, warmup + steps * rounds + 1)]  # after each global step
  assert [t for t in timed if tg.pauses_after(t, steps, rounds)] == [0, 3, 6, 9]
  assert not any(tg.pauses_after(t, steps, 1) for t in timed)  # one round: the old uninterrupted run
  ends = [1.0, 2.0, 3.0, 4.0]
  starts = [1.0, 2.5, 3.0, 4.0]  # a pause after step 2 ended at 2.5
  assert tg.step_times(starts, ends, warmup=1) == [1.0, 0.5, 1.0]  # step 3 runs from 2.5 to 3.0


def test_measure_calls_between_after_warmup_and_each_block(monkeypatch):
  calls = []
  monkeypatch.setattr(grpo_step, "step", lambda ctx, t: calls.append(("step", t)) or {
      "total_s": 1.0, "generate_s": 0.2, "ref_train_s": 0.7, "host_s": 0.1, "rollouts": 4, "completion_len_mean": 3.0})
  ctx = {"train_step": types.SimpleNamespace(_cache_size=lambda: 1)}
  out = grpo_step.measure(ctx, warmup=1, steps=2, rounds=3, between=lambda: calls.append("peer"))
  assert calls == [("step", 0), "peer", ("step", 1), ("step", 2), "peer", ("step", 3), ("step", 4), "peer",
                   ("step", 5), ("step", 6), "peer"]
  assert out["steps"] == 6 and out["rounds"] == 3 and out["total_s"] == 1.0


def test_tunix_script_reports_missing_tunix():
  # The project venv never has tunix: the peer script must say so as JSON, not crash.
  proc = subprocess.run([sys.executable, run.TUNIX_SCRIPT, "--workload", "2L-d128"], capture_output=True,
                        text=True, timeout=120, cwd=run.ROOT)
  assert proc.returncode == 0
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["status"].startswith("tunix not importable")


@pytest.mark.slow  # ~30 s of CPU: a dozen small XLA compilations
def test_quick_run(tmp_path, capsys):
  """A full (quick) run over an existing results file: its rows replaced, but a real workload measured on its own
  before (`make bench-r`'s R) and not in this run kept."""
  out_path = tmp_path / "results.json"
  readme = tmp_path / "README.md"
  committed = json.loads((__import__("pathlib").Path(run.ROOT) / "bench" / "results.json").read_text())
  before = {"grpo": {"R": committed["grpo"]["R"], "2L-d128": {"stale": True}}, "learner": {"stale": True}}
  out_path.write_text(json.dumps(before))
  res = run.main(["--quick", "--no-peers", "--out", str(out_path), "--readme", str(readme)])
  stdout = capsys.readouterr().out
  saved = json.loads(out_path.read_text())
  assert saved["quick"] and saved["command"] == res["command"]
  for name in ("matmul_fp32", "matmul_bf16"):
    assert saved["peak"][name]["flops_per_s"] > 0
  assert saved["peak"]["copy"]["bytes_per_s"] > 0 and saved["peak"]["copy"]["in_place"]
  assert "copy bandwidth (x + 1 in place)" in stdout and "page-fault" not in stdout.split("workload R**")[0]
  (learner,) = saved["learner"].values()
  assert learner["compiles_after_warmup"] == 0
  assert 0 < learner["mfu"] and math.isfinite(learner["tokens_per_s"])
  (samp,) = saved["sampler"]
  assert samp["decode_bound_kind"] in ("compute", "memory") and samp["decode_tokens_per_s"] > 0
  assert saved["grpo"]["R"] == committed["grpo"]["R"] and "**GRPO step on the real model: workload R**" in stdout
  (grpo,) = [v for k, v in saved["grpo"].items() if k != "R"]
  assert "stale" not in grpo and "stale" not in saved["learner"]
  assert grpo["ours"]["compiles_after_warmup"] == 0
  assert all(grpo["ours"][k] > 0 for k in ("generate_s", "ref_train_s", "host_s"))
  assert grpo["tunix"]["status"].startswith("skipped") and grpo["tunix_over_ours"] is None
  sparse = saved["system"]["sparse_sync"]
  assert sparse["status"] == "ok" and 0 <= sparse["every_1"]["payload_ratio"] <= 1
  assert "**Learner step**" in stdout and "**Full GRPO step vs Tunix**" in stdout
  assert stdout.strip() in readme.read_text()


# ----------------------------------------------------------------------------- workload R (real-model path)


def test_memory_budget_by_hand():
  from bench import grpo_real
  cfg = ModelConfig(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=16, vocab_size=32)
  B, P, N = 3, 5, 4
  T = P + N
  # Per layer and token: 6·D + 2·K·hd + 3·F + H·T = 48 + 8 + 48 + 18 = 122 floats; lm-head: 2·N·V per row.
  no_remat = 4 * (B * T * 2 * 122 + 2 * B * N * 32)
  full = 4 * (B * T * (2 * 8 + 122) + 2 * B * N * 32)
  assert grpo_real.activation_bytes(cfg, B, T, "none", N) == no_remat
  assert grpo_real.activation_bytes(cfg, B, T, "full", N) == full
  params = common.param_bytes(cfg, 4)
  budget = grpo_real.memory_budget(cfg, B, P, N, "none")
  assert budget["resident"] == 4 * params
  # K and V, 2 layers, fp32; the decode view's copies of wq, wk, wv, wo, gate, up, down (64 + 32 + 32 + 64 + 3 * 128
  # per layer) and of the head (untied, 8 * 32)
  view = 4 * (2 * 576 + (0 if cfg.tie_embeddings else 256))
  assert budget["prefill"] == 4 * params + 4 * 2 * 2 * B * T * 1 * 4 + view
  assert budget["train"] == 5 * params + 4 * B * N * 32 + no_remat


def test_real_workload_remat_auto_decides_as_a_run(monkeypatch):
  """Workload R's remat "auto" is `memory.choose_remat` on its step (every row in one micro-batch, the frozen
  reference beside the policy, no published sampler copy): in an order that tries "dots" first, "dots" at a budget
  that holds that step, else "full"; any other mode is kept."""
  from bench import grpo_real
  from jaxrl_llm import memory
  monkeypatch.setitem(memory.REMAT_ORDER, "cpu", ("dots", "full", "none"))
  cfg = ModelConfig(n_layers=16, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=16, vocab_size=32)
  run = dict(prompts_per_step=2, group_size=3, max_new_tokens=4)
  shape = memory.StepShape(rows=6, prompt=5, new=4, micro_rows=6, frozen_copies=1, sampler_copy=False)
  fits = memory.step_bytes(cfg, shape, "dots")
  assert memory.step_bytes(cfg, shape, "full") < fits < memory.step_bytes(cfg, shape, "none")
  monkeypatch.setattr(memory, "machine_budget_bytes", lambda: fits)
  assert grpo_real._remat(cfg, "auto", run, 5) == "dots"
  monkeypatch.setattr(memory, "machine_budget_bytes", lambda: fits - 1)
  assert grpo_real._remat(cfg, "auto", run, 5) == "full"
  assert grpo_real._remat(cfg, "none", run, 5) == "none"


def test_rss_peak_sees_an_allocation():
  from bench import grpo_real
  with grpo_real.RssPeak(every_s=0.001) as r:
    # 64 MiB of fresh anonymous pages, touched: a numpy array can reuse a freed chunk malloc still holds (a worker
    # late in the suite kept one: its RSS did not move), a new mapping cannot
    x = mmap.mmap(-1, 64 << 20)
    for i in range(0, 64 << 20, 4096):
      x[i] = 1
    # held until the watcher thread has sampled (on a loaded machine it may not run for a while): a bound on
    # the wait, not on how soon it samples
    deadline = time.monotonic() + 60
    while r.peak - r.start < 32 << 20 and time.monotonic() < deadline:
      time.sleep(0.005)
    x.close()
  assert r.peak - r.start >= 32 << 20


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
  tests_dir = __import__("os").path.dirname(__file__)
  sys.path.insert(0, tests_dir)
  import tiny_hf
  return str(tiny_hf.make_checkpoint(tmp_path_factory.mktemp("tiny_real"), seed=0, max_seq_len=256))


def test_real_workload_path_merges_into_results(tiny_ckpt, tmp_path, monkeypatch, capsys):
  """--only-real on a tiny random checkpoint (no peers): workload R's whole path (chat prompts through the
  checkpoint's tokenizer, turns, phases, roofline, memory) lands in results.json beside the toy rows."""
  monkeypatch.setitem(workloads.REAL, "R_small", dict(prompts_per_step=2, group_size=2, max_new_tokens=4, remat="none"))
  out_path, readme = tmp_path / "results.json", tmp_path / "README.md"
  committed = json.loads((__import__("pathlib").Path(run.ROOT) / "bench" / "results.json").read_text())
  toy = {k: v for k, v in committed.items() if k != "grpo"}
  toy["grpo"] = {k: v for k, v in committed["grpo"].items() if "variant" not in v}
  out_path.write_text(json.dumps(toy))
  run.main(["--quick", "--only-real", "--real", "R_small", "--model", tiny_ckpt, "--out", str(out_path),
            "--readme", str(readme)])
  stdout = capsys.readouterr().out
  saved = json.loads(out_path.read_text())
  assert saved["grpo"]["2L-d128"] == toy["grpo"]["2L-d128"] and saved["learner"] == toy["learner"]
  r = saved["grpo"]["R_small"]
  assert r["workload"]["rollouts"] == 4 and r["ours"]["rollouts_per_step"] == 4
  assert r["ours"]["compiles_after_warmup"] == 0
  for peer in ("tunix", "trl", "torch"):
    assert r[peer]["status"].startswith("skipped") and r[f"{peer}_over_ours"] is None
  assert r["roofline"]["decode_b64"]["batch"] == 64
  for ph in ("prefill", "decode", "reference", "train"):
    x = r["roofline"][ph]
    # seconds: decode and train are differences of two timings, noise on a tiny model (no sign asserted)
    assert x["flops"] > 0 and x["bound_s"] > 0 and math.isfinite(x["seconds"]) and x["bound_kind"] in ("compute", "memory")
    assert r["memory"][ph]["peak_rss"] > 0 and r["memory"][ph]["budget"] > 0
  assert 0 < r["roofline"]["step"]["lower_bound_s"]
  assert r["measured"]["command"].startswith("python -m bench.run") and len(r["loadavg_start"]) == 3
  assert "**Full GRPO step vs Tunix**" in stdout and "**R_small: targets**" in stdout
  assert stdout.strip() in readme.read_text()
  # A results file that `--only-real` starts (no toy sections) formats: R alone, no KeyError.
  alone = {k: saved[k] for k in ("command", "machine", "peak", "wall_s")} | {"grpo": {"R_small": r}}
  tables = run.format_tables(alone)
  assert "**R_small: targets**" in tables and "**Full GRPO step vs Tunix**" not in tables


def test_real_model_memory_measures_the_reference_scorer(tiny_ckpt):
  from bench import real_model_memory
  out = real_model_memory.measure("reference", tiny_ckpt, 2, 4, 3, "full", 1.0)
  assert out["what"] == "reference" and (out["B"], out["P"], out["N"]) == (2, 4, 3) and not out["compile_only"]
  assert 0 <= out["xla_temp_gib"] < 1.0 and out["peak_rss_gib"] >= out["rss_after_load_gib"]


def test_shared_prefill_flag_sets_the_group_size(tiny_ckpt):
  from bench import grpo_real
  on = grpo_real.build("R_small", tiny_ckpt, shared_prefill=True)
  off = grpo_real.build("R_small", tiny_ckpt)
  assert on["sampler_cfg"].group_size == on["run"]["group_size"] > 1 and on["run"]["shared_prefill"]
  assert off["sampler_cfg"].group_size == 1 and not off["run"]["shared_prefill"]


# ----------------------------------------------------------------------------- speed features of ours (issue 35)


def test_features_parse_and_label():
  from bench import features
  f = features.parse("slots=16, slot_chunk=8,pack_width=auto,remat=none")
  assert f == {"slots": 16, "slot_chunk": 8, "pack_width": "auto", "remat": "none"}
  assert features.label(f) == "slots=16,slot_chunk=8,pack_width=auto,remat=none"
  assert features.parse(features.label(f)) == f  # the label reads back
  assert features.label({}) == "baseline" and features.label({"slot_chunk": 4}) == "baseline"  # no slots: no chunk
  assert features.complete({"spec_gamma": 2})["slots"] == 0
  assert features.parse_variants(["spec_gamma=2;remat=full", "pack_width=96"]) == {
      "spec_gamma=2": {"spec_gamma": 2}, "remat=full": {"remat": "full"}, "pack_width=96": {"pack_width": 96}}
  assert features.draft_layers({"spec_gamma": 2, "spec_draft_layers": 0}, 30) == 8
  assert features.draft_layers({"spec_gamma": 2, "spec_draft_layers": 0}, 2) == 2
  for bad, words in (("slotz=3", "unknown feature 'slotz'"), ("slots=-1", "slots='-1'"), ("slots", "NAME=VALUE"),
                     ("remat=some", "one of none, full, dots"), ("slot_chunk=0", "int >= 1")):
    with pytest.raises(ValueError, match=words):
      features.parse(bad)
  assert features.label({"slots": 4, "spec_gamma": 2}) == "slots=4,slot_chunk=8,spec_gamma=2"  # they compose


@pytest.mark.parametrize("argv, words", [
    (["--features", "slotz=1"], "unknown feature 'slotz'"),
    (["--variants", "remat=none;pack_width=x"], "pack_width='x'"),
    (["--features", "slots=2", "--real", "none"], "act on workload R"),
    (["--real-blocks", "0"], "--real-blocks=0: at least 1"),
])
def test_bad_features_flag_is_a_clear_error(argv, words, capsys):
  with pytest.raises(SystemExit) as e:
    run.main(["--quick", *([] if "--real" in argv else ["--real", "R_small"]), *argv])
  assert e.value.code == 2 and words in capsys.readouterr().err  # argparse's error: nothing measured


def test_render_of_the_committed_results(capsys, tmp_path):
  committed = __import__("pathlib").Path(run.ROOT) / "bench" / "results.json"
  readme = tmp_path / "README.md"
  run.main(["--render", str(committed), "--readme", str(readme)])
  out = capsys.readouterr().out
  assert "**GRPO step on the real model: workload R_small**" in out and "**R_small: targets**" in out
  # the side table says what each side ran with (an entry from before the features column: ours' defaults)
  assert "| static batch, padded learner, remat full |" in out and "static batch (`generate`)" in out
  assert out.strip() in readme.read_text()
  # measured before the bandwidth reference wrote in place: each table and target that used it says so
  assert "copy bandwidth (x + 1, a fresh output per call: page-fault bound)" in out
  assert out.count("so it is the page-fault rate") == out.count("roofline per phase**") >= 1
  assert "% (against the page-fault rate, bounds too long) |" in out


def test_copy_bandwidth_writes_in_place():
  """The bandwidth reference donates its input, so the buffer it writes is the one it read: no fresh pages to map.
  The old reference, a fresh output per call (`python -m bench.peak` times both), maps a fresh 64 MiB output at
  every call (above glibc's largest mmap threshold, so never a recycled block)."""
  from bench import peak
  n = 1 << 24
  fresh, in_place = peak.copy_bandwidth(n, in_place=False), peak.copy_bandwidth(n)
  assert (fresh["in_place"], in_place["in_place"]) == (False, True)
  assert fresh["bytes_moved"] == in_place["bytes_moved"] == 2 * 4 * n and in_place["bytes_per_s"] > 0
  assert 4 * in_place["page_faults"] < fresh["page_faults"]


def test_static_slot_waste_by_hand(monkeypatch):
  # Lengths 1, 3, 2: the batch decodes 2 steps after column 0 (3 rows × 2 slot-steps), rows use 0 + 2 + 1.
  out = {"lengths_B": np.array([1, 3, 2])}
  monkeypatch.setattr(grpo_step, "generate", lambda *a: out)
  ctx = {"cfg": None, "sampler_cfg": None}
  p = types.SimpleNamespace(tokens_BP=None, len_B=None)
  _, stats = grpo_step.sample(ctx, None, p, None)
  assert stats == {"slot_wasted": pytest.approx(0.5)}


def _gpu_sh_bench_argv(module: str = "bench.run") -> list[str]:
  """The arguments bench/gpu.sh passes to `python -m module` (from its dry run)."""
  import shlex
  proc = subprocess.run(["bash", "bench/gpu.sh"], cwd=run.ROOT, env={**__import__("os").environ, "DRY_RUN": "1"},
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  (line,) = [ln for ln in proc.stderr.splitlines() if f"-m {module} " in ln]
  words = shlex.split(line[2:])
  return words[words.index(module) + 1:]


def test_gpu_sh_is_bash_clean_and_asks_for_the_gpu_run():
  assert subprocess.run(["bash", "-n", "bench/gpu.sh"], cwd=run.ROOT).returncode == 0
  argv = _gpu_sh_bench_argv()
  assert argv[:3] == ["--only-real", "--real", "R"] and argv[argv.index("--peers") + 1] == "torch"
  assert argv[argv.index("--peer-python") + 1].endswith("bin/python")
  # and the remat modes timed on the same workload (the GPU's "auto" order is unmeasured)
  assert _gpu_sh_bench_argv("bench.remat") == ["--variant", "R", "--rounds", "3", "--markdown",
                                               "bench/profiles/R_remat_gpu.md"]


@pytest.mark.slow  # ~60-90 s of CPU: five versions of ours compile on the tiny checkpoint
def test_feature_variants_quick_run(tiny_ckpt, tmp_path, monkeypatch, capsys):
  """bench/gpu.sh's bench.run arguments (its variants: remat none, continuous batching, packing, speculative
  decoding), made quick on a tiny checkpoint, with ours' own features on: each version of ours takes turns and
  reports finite step times and its feature's statistics; the tables render them."""
  monkeypatch.setitem(workloads.REAL, "R", dict(prompts_per_step=2, group_size=2, max_new_tokens=6, remat="full"))
  argv = _gpu_sh_bench_argv()
  for flag in ("--out", "--readme", "--peer-python"):  # this machine's paths
    i = argv.index(flag)
    del argv[i:i + 2]
  out_path = tmp_path / "results.json"
  run.main(["--quick", *argv, "--features", "pack_width=auto", "--model", tiny_ckpt, "--out", str(out_path)])
  stdout = capsys.readouterr().out
  r = json.loads(out_path.read_text())["grpo"]["R"]
  assert r["features"]["pack_width"] == "auto" and r["ours"]["compiles_after_warmup"] >= 0
  assert r["torch"]["status"].startswith("skipped")  # --quick: no peers
  v = r["variants"]
  assert set(v) == {"remat=none", "slots=32,slot_chunk=16", "pack_width=auto", "spec_gamma=4"}
  for name, entry in v.items():
    o = entry["ours"]
    assert all(math.isfinite(t) and t > 0 for t in o["step_s_each"]) and o["steps"] == 1, name
    assert math.isfinite(entry["baseline_over_variant"]) and o["rollouts_per_step"] == 4
    assert len(o["loadavg_blocks"]) == 1
  assert v["remat=none"]["remat"] == "none" and r["model"]["remat"] == "full"
  assert 0 <= v["slots=32,slot_chunk=16"]["ours"]["slot_wasted"] < 1
  assert 0 <= v["spec_gamma=4"]["ours"]["spec_accept_rate"] <= 1
  assert v["spec_gamma=4"]["features"]["spec_draft_layers"] == 1  # the tiny model's depth
  assert 0 <= v["pack_width=auto"]["ours"]["learner_pad_frac"] < 1
  assert "**R: feature variants of ours**" in stdout and "| ours + slots=32,slot_chunk=16 |" in stdout
  assert "continuous batching (32 slots, chunk 16)" in stdout


def test_long_tail_section_quick(tmp_path, capsys):
  """--only-tail --quick: both length distributions, static against continuous batching; the episode-like
  lengths drawn on the host come out of the chain model exactly, and both paths emit the same tokens."""
  out_path = tmp_path / "results.json"
  committed = json.loads((__import__("pathlib").Path(run.ROOT) / "bench" / "results.json").read_text())
  out_path.write_text(json.dumps(committed))
  run.main(["--quick", "--only-tail", "--out", str(out_path)])
  saved = json.loads(out_path.read_text())
  assert saved["grpo"] == committed["grpo"] and saved["machine"] == committed["machine"]  # merged: the rest kept
  geo, ep = saved["rollout_tail"]["rows"]
  assert (geo["dist"], ep["dist"]) == ("geometric", "episode")
  for x in (geo, ep):
    assert x["same_tokens"] and math.isfinite(x["speedup"]) and 0 <= x["continuous_wasted"] < 1
  assert ep["realised_lengths_ok"] and 0 < ep["length_mean"] <= ep["new_tokens"]
  assert "**Long-tail rollouts: static batches vs continuous batching**" in capsys.readouterr().out


def test_episode_lengths_mixture():
  from bench import continuous
  n = continuous.episode_lengths(np.random.default_rng(0), 4000, 128)
  assert n.min() >= 1 and n.max() == 128
  assert abs((n <= 16).mean() - 0.8) < 0.03 and abs((n == 128).mean() - 0.1) < 0.02


@pytest.mark.slow  # torch + transformers import and one tiny step: ~10 s idle, a minute on a loaded machine
def test_torch_peer_runs_on_the_available_device(tiny_ckpt):
  """bench/peers/torch_grpo.py (the peer bench/gpu.sh runs on CUDA) in this venv's torch, on the tiny checkpoint:
  one step on the device `torch.cuda.is_available()` picks (the CPU here), reported in its summary."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  proc = subprocess.run([sys.executable, run.REAL_PEERS["torch"], "--workload", "R_small", "--model", tiny_ckpt],
                        capture_output=True, text=True, timeout=600, cwd=run.ROOT)
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["status"] == "ok", proc.stderr[-2000:]
  assert out["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
  assert math.isfinite(out["total_s"]) and out["rollouts_per_step"] == 16


def test_workload_r_rewards_decode_with_the_models_tokenizer(tmp_path):
  """Workload R scores its completions as the peers do: the real tokenizer's text. Decoding a subword model's ids as
  characters (what `step` did) scored every completion 0."""
  import tiny_hf
  from jaxrl_llm.models.tokenizer import load_checkpoint_tokenizer
  from jaxrl_llm.tasks import get_task
  from jaxrl_llm.tasks.encoder import Encoder
  tok = load_checkpoint_tokenizer(tiny_hf.make_tokenizer(tmp_path))
  task = get_task("arithmetic_chat", num_digits=2)
  ex = task.make_example(np.random.default_rng(0))
  right = tok.encode(f"The answer is {ex['answer']}.") + [tok.end_of_turn_id]
  wrong = tok.encode("I do not know.") + [tok.end_of_turn_id]
  width = max(len(right), len(wrong))
  tokens = np.asarray([r + [tok.pad_id] * (width - len(r)) for r in (right, wrong)])
  ctx = {"task": task, "encoder": Encoder(tok, chat_template="chat")}
  np.testing.assert_array_equal(grpo_step.rewards(ctx, [ex, ex], tokens), [1.0, 0.0])


def test_pooled_blocks_keep_every_blocks_reward():
  """Ours' summary pools the blocks that took turns with each peer: its reward and prompt length are over all of
  their steps (the table once showed the first peer's block alone: reward 0.00 where the run averaged 0.06)."""
  part = lambda r, steps: {"step_s_each": [1.0] * steps, "steps": steps, "rounds": 1, "compiles_after_warmup": 0,
                           "completion_len_mean": 30.0, "generate_s": 0.5, "ref_train_s": 0.4, "host_s": 0.1,
                           "reward_mean": r, "prompt_len_mean": 40.0 + r}
  pooled = run._pool([part(0.0, 2), part(0.25, 2), part(0.125, 4)])
  assert pooled["reward_mean"] == pytest.approx((0.0 * 2 + 0.25 * 2 + 0.125 * 4) / 8)
  assert pooled["prompt_len_mean"] == pytest.approx(40.0 + 0.125)
  assert pooled["steps"] == 8


def test_decode_attention_bench_compares_equal_attentions():
  """bench/decode_attention.py times two formulations of one attention: they must agree (tiny shapes)."""
  from bench import decode_attention
  row = decode_attention.attention_ms(2, 5, n_layers=2)
  assert row["max_abs_diff"] < 1e-5 and row["dots_ms"] >= 0 and row["sums_ms"] >= 0


def test_decode_matmul_bench_compares_equal_products():
  """bench/decode_matmul.py times two layouts of one product: they must agree (tiny shapes)."""
  from bench import decode_matmul
  row = decode_matmul.measure([2], n_layers=2, d=8, f=16)[0]
  assert row["max_abs_diff"] < 1e-5 and row["rows_major_ms"] >= 0 and row["output_major_ms"] >= 0


def test_optimizer_update_bench_compares_equal_updates():
  """bench/optimizer_update.py times the former update against the train step's: the same parameters after one
  update with the clip acting (norm 4 > 1), and fewer XLA temps for the in-place form (tiny shapes)."""
  from bench import optimizer_update
  out = optimizer_update.measure({"a": (4, 32), "b": (3, 8, 16)}, rounds=2, lr=1e-2, grad_scale=0.2)
  assert out["max_abs_diff"] < 1e-6 and out["in_place"]["median_s"] > 0
  assert out["in_place"]["xla_temp_bytes"] < out["select"]["xla_temp_bytes"], out


def test_decode_matmul_bench_head_compares_equal_products():
  """bench/decode_matmul.py --head: the vocabulary head's two layouts agree (tiny shapes)."""
  from bench import decode_matmul
  row = decode_matmul.measure_head([3], d=8, v=40)[0]
  assert row["max_abs_diff"] < 1e-5 and row["head_rows_major_ms"] >= 0 and row["head_output_major_ms"] >= 0


def test_remat_bench_times_every_mode_on_the_same_batch(tiny_ckpt, tmp_path, monkeypatch):
  """bench/remat.py on a tiny random checkpoint: a row per mode with one timed round each (finite seconds, the
  first mode's ratio over itself 1), the auto choice named, the table written with its command."""
  from bench import remat
  monkeypatch.setitem(workloads.REAL, "R_small", dict(prompts_per_step=2, group_size=2, max_new_tokens=4, remat="none"))
  rows, auto = remat.measure("R_small", tiny_ckpt, ("full", "dots", "none"), rounds=1)
  assert [r["remat"] for r in rows] == ["full", "dots", "none"] and auto == "full"  # this CPU's order: "full" first
  assert all(len(r["seconds"]) == 1 and math.isfinite(r["median_s"]) and r["median_s"] > 0 for r in rows)
  assert rows[0]["first_over_this"] == 1.0
  md = tmp_path / "remat.md"
  assert remat.main(["--model", tiny_ckpt, "--modes", "full,none", "--rounds", "1", "--markdown", str(md)]) == 0
  text = md.read_text()
  assert "python -m bench.remat --model" in text and "| full |" in text and "| none |" in text
  for bad in ("full,sometimes", "full,full"):
    with pytest.raises(SystemExit, match="--modes"):
      remat.main(["--modes", bad])


def test_spec_cost_bench_on_a_tiny_checkpoint(tiny_ckpt, tmp_path):
  """bench/spec_cost.py on a tiny random checkpoint: a row per plain width and per γ with finite milliseconds, the
  1-row step the unit, one verification call per token past the first (a fresh head over ids 0..K-1 agrees with
  nothing here), and the table written with its command."""
  from bench import spec_cost
  rows = spec_cost.measure(tiny_ckpt, 1, (2,), (2,), 4, 8, 1)
  assert [r["rows"] for r in rows] == [1, 2, 3] and rows[0]["over_plain"] == 1.0
  assert all(math.isfinite(r["ms"]) for r in rows) and 1 <= rows[-1]["calls"] <= 3
  md = tmp_path / "cost.md"
  assert spec_cost.main(["--model", tiny_ckpt, "--rows", "2", "--gammas", "2", "--new-tokens", "4", "--head-vocab",
                         "8", "--repeats", "1", "--markdown", str(md)]) == 0
  text = md.read_text()
  assert "python -m bench.spec_cost --model" in text and "| speculative call, γ = 2 | 3 |" in text


def test_resident_turns_bench_on_a_toy_model(tmp_path):
  """bench/resident_turns.py at toy sizes: both samplers play the same tokens, the resident one prefills once
  (turn 0, all episodes in slots) and resumes every later turn, and the table is written with its command."""
  from bench import resident_turns
  md = tmp_path / "resident.md"
  resident_turns.main(["--episodes", "3", "--slots", "4", "--turns", "3", "--turn-tokens", "3", "--obs", "2",
                       "--prompt", "5", "--d-model", "64", "--layers", "1", "--rounds", "1", "--markdown", str(md)])
  text = md.read_text()
  assert "python -m bench.resident_turns --episodes 3" in text and "Same tokens: yes." in text
  assert "| resident |" in text and "| 1 | 6 of 9 |" in text, text
