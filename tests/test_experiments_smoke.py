"""Experiment scripts: the report generator's rules on synthetic results, argument parsing, 2-step runs."""

import json
import os

import pytest

from experiments import async_staleness, async_throughput, mismatch_ablation, report, staleness_ablation


def _run(task, method, lag, seed, acc, frac_key="clip_frac_mean", frac=0.1):
  s = {"eval_accuracy_initial": 0.2, "eval_accuracy_late": acc, "ratio_max": 3.0, "ratio_p99_max": 1.5,
       "kl_mu_k3_mean": 0.01, "lag_max": lag, "mismatch_abs_mean": 0.0, frac_key: frac}
  c = {"step": [0, 1], "reward_mean": [0.1, 0.2], "eval_step": [1], "eval_accuracy": [acc]}
  return {"task": task, "method": method, "lag": lag, "seed": seed, "summary": s, "curves": c}


def _staleness_doc(grpo_late):
  runs = []
  for seed, jitter in ((0, 0.0), (1, 0.01)):
    runs += [_run("arithmetic", "grpo", 0, seed, 0.50 + jitter, frac=0.02),
             _run("arithmetic", "grpo", 32, seed, grpo_late + jitter, frac=0.30),
             _run("arithmetic", "m2po", 0, seed, 0.50 + jitter, "mask_frac_mean", 0.0),
             _run("arithmetic", "m2po", 32, seed, 0.49 + jitter, "mask_frac_mean", 0.01)]
  return {"experiment": "staleness_ablation", "command": "python -m experiments.staleness_ablation",
          "commit": "abc123", "machine": {"cpu": "TestCPU", "cores": 2}, "setting": "ci", "steps": 10, "seeds": 2,
          "base_overrides": {}, "methods": {"grpo": {}, "m2po": {}}, "baseline": "grpo", "runs": runs}


def _verdict(text, claim_start):
  line = next(l for l in text.splitlines() if l.startswith(f"| {claim_start}"))
  return line.split("**")[1]


def test_drops_rule_golden_values():
  a = report.stats([0.50, 0.52])  # mean 0.51, std 0.01414, se 0.01
  b = report.stats([0.40, 0.42])
  assert a["mean"] == pytest.approx(0.51) and a["se"] == pytest.approx(0.01)
  assert report.drops(a, b)  # 0.11 > 0.03 and > 2·sqrt(2)·0.01 = 0.028
  assert not report.drops(b, a)
  noisy = report.stats([0.2, 0.8])  # se 0.3: a 0.11 gap is within noise
  assert not report.drops(noisy, report.stats([0.39, 0.39]))
  assert report.drops(report.stats([0.5]), report.stats([0.46]))  # one seed: the margin alone
  assert not report.drops(report.stats([0.5]), report.stats([0.48]))
  assert report.trust_frac({"clip_frac_mean": 0.1, "mask_frac_mean": 0.3, "ratio_max": 9.0}) == 0.3


def test_report_verdicts_follow_the_numbers(tmp_path):
  results = tmp_path / "results"
  results.mkdir()
  (results / "staleness_ablation.json").write_text(json.dumps(_staleness_doc(grpo_late=0.30)))
  (results / "async_staleness.json").write_text(json.dumps(
      {"experiment": "async_staleness", "available": False, "reason": "not available: config.rollout.mode='async'",
       "runs": []}))
  out = tmp_path / "docs" / "RESULTS.md"
  report.main(["--results", str(results), "--out", str(out)])
  text = out.read_text()
  assert _verdict(text, "GRPO degrades") == "reproduces"
  assert _verdict(text, "m2po stays stable") == "reproduces"
  assert _verdict(text, "M2PO masks far fewer") == "reproduces"
  assert "python -m experiments.staleness_ablation" in text and "abc123" in text and "TestCPU, 2 cores" in text
  assert "not available: config.rollout.mode='async'" in text
  assert "No results yet: run `python -m experiments.mismatch_ablation`" in text
  figs = sorted(os.listdir(tmp_path / "docs" / "figures"))
  assert figs == ["staleness_arithmetic_acc_vs_lag.png", "staleness_arithmetic_grpo_curves.png"]
  assert "](figures/staleness_arithmetic_acc_vs_lag.png)" in text
  assert "| grpo | 0.505 ± 0.007 | 0.305 ± 0.007 |" in text

  # Same files, but the baseline does not degrade: the stability claim becomes untestable.
  (results / "staleness_ablation.json").write_text(json.dumps(_staleness_doc(grpo_late=0.50)))
  report.main(["--results", str(results), "--out", str(out)])
  text = out.read_text()
  assert _verdict(text, "GRPO degrades") == "does not reproduce"
  assert _verdict(text, "m2po stays stable") == "not testable here"


def test_argument_parsing_and_plans(capsys):
  staleness_ablation.main(["--dry-run", "--methods", "grpo,m2po", "--lags", "0,4", "--tasks", "arithmetic"])
  planned = [l for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
  assert len(planned) == 4  # 2 methods × 2 lags × 1 seed
  full = staleness_ablation.plan({"grid": staleness_ablation.SETTINGS["full"]["grid"]}, 3)
  assert len(full) == 2 * 16 * 5 * 3
  with pytest.raises(KeyError, match="unknown method 'nope'"):
    staleness_ablation.main(["--dry-run", "--methods", "nope"])
  mismatch_ablation.main(["--dry-run", "--methods", "pg"])
  out = capsys.readouterr().out
  assert "int8" in out and "not available yet: config.sampler.quantization" in out
  async_throughput.main(["--dry-run"])
  async_staleness.main(["--dry-run", "--etas", "0,2"])
  assert "async:" in capsys.readouterr().out


@pytest.mark.slow
def test_two_step_staleness_run_writes_results(tmp_path):
  path = staleness_ablation.main(["--base", "tiny", "--methods", "grpo", "--lags", "1", "--tasks", "arithmetic",
                                  "--steps", "2", "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "wd")])
  doc = json.load(open(path))
  (r,) = doc["runs"]
  assert r["summary"]["num_steps"] == 2 and r["summary"]["lag_max"] == 1
  assert doc["commit"] and doc["machine"]["cores"] >= 1 and "--steps 2" in doc["command"]


@pytest.mark.slow
def test_two_step_runs_of_the_other_scripts(tmp_path):
  common = ["--base", "tiny", "--steps", "2", "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "wd")]
  m = json.load(open(mismatch_ablation.main(common + ["--methods", "tis"])))
  assert {r["sampler"] for r in m["runs"]} >= {"fp32", "bf16"}
  t = json.load(open(async_throughput.main(common)))
  assert {r["mode"] for r in t["runs"]} >= {"sync", "fixed_lag", "staged"}
  a = json.load(open(async_staleness.main(common + ["--etas", "1", "--methods", "grpo"])))
  assert a["available"] is False or a["runs"][0]["summary"]["lag_max"] <= 1
  out = tmp_path / "RESULTS.md"
  report.main(["--results", str(tmp_path / "res"), "--out", str(out)])
  assert "## Throughput" in out.read_text()
