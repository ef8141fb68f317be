"""docs/compat.md and `jaxrl_llm.compat.REFUSED` agree with `config.validate`: every feature validates alone, the
pairs validation refuses are exactly the listed ones (a refusal without a reason, or a listed pair that now runs,
fails here), each refusal is one line naming a field, and the page is the one the probe renders."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_llm import compat
from devices import with_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def probed():
  """The probe's result, in a process of 8 forced CPU devices (the mesh features use them all)."""
  env = {**with_devices(compat.DEVICES), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  r = subprocess.run([sys.executable, "-m", "jaxrl_llm.compat", "--json"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  return out["singles"], {(a, b): e for a, b, e in out["pairs"]}


def test_every_feature_validates_alone(probed):
  singles, _ = probed
  assert singles.keys() == compat.FEATURES.keys()
  assert {n: e for n, e in singles.items() if e is not None} == {}


def test_refused_pairs_are_exactly_the_listed_ones(probed):
  _, pairs = probed
  refused = {compat.pair(a, b) for (a, b), e in pairs.items() if e is not None}
  unlisted = sorted(tuple(sorted(p)) for p in refused - compat.REFUSED.keys())
  stale = sorted(tuple(sorted(p)) for p in compat.REFUSED.keys() - refused)
  assert unlisted == [], "refused by config.validate but not in compat.REFUSED (give the reason there)"
  assert stale == [], "listed in compat.REFUSED but validates now (remove it)"
  for (a, b), e in pairs.items():
    if e is not None:
      assert e.startswith("config.") and "\n" not in e, (a, b, e)


def test_alternatives_are_not_pairs():
  assert ("fixed_lag", "staged") not in compat.pairs() and ("ewma", "teacher") not in compat.pairs()
  assert ("async", "partial") in compat.pairs()  # partial sets async's fields to the same values
  assert compat.merged(("lora", "qlora"))["model.lora.base_quantize"] == "int8"


def test_run_chooses_pairs_among_features_and_with_one():
  assert compat.chosen() is None  # every pair
  assert compat.chosen(["fixed_lag", "staged", "slots"]) == {("fixed_lag", "slots"), ("staged", "slots")}
  with_mesh = compat.chosen(one="mesh")
  assert ("fixed_lag", "mesh") in with_mesh and ("mesh", "slots") in with_mesh and len(with_mesh) == 32
  assert all("mesh" in p for p in with_mesh) and ("mesh", "sampler_devices") not in with_mesh  # alternatives
  assert compat.chosen(["slots", "lora"], "mesh") == {("mesh", "lora"), ("mesh", "slots")}
  with pytest.raises(SystemExit, match="unknown features \\['nope'\\]"):
    compat.chosen(one="nope")


def test_docs_compat_page_is_current(probed):
  _, pairs = probed
  with open(os.path.join(ROOT, "docs", "compat.md")) as f:
    assert f.read() == compat.render(pairs), "regenerate: python -m jaxrl_llm.compat > docs/compat.md"


def test_slots_over_processes_refuse_episodes_and_uneven_shares():
  """One slot engine per process takes an equal share of the prompts, and episodes' turns over processes
  re-prefill: both are refused by name (validated as one of 2 processes, on 8 forced devices)."""
  code = ("import json\n"
          "from jaxrl_llm import compat, config\n"
          "def err(fields):\n"
          "  try:\n"
          "    with compat._processes(2):\n"
          "      config.validate(compat.config_of(fields))\n"
          "  except config.ConfigError as e:\n"
          "    return str(e)\n"
          "f = compat.merged(('processes', 'slots'))\n"
          "print(json.dumps([compat.check(('processes', 'slots', 'episodes')), err(f),\n"
          "                  err({**f, 'rollout.prompts_per_step': 3})]))\n")
  env = {**with_devices(compat.DEVICES), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  episodes, plain, uneven = json.loads(r.stdout.strip().splitlines()[-1])
  assert plain is None
  assert episodes.startswith("config.rollout.slots=8:") and "re-prefill" in episodes, episodes
  assert uneven.startswith("config.rollout.prompts_per_step=3:") and "divisible by 2" in uneven, uneven


def test_evidence_names_features_and_finds_a_dropped_one():
  assert compat.EVIDENCE.keys() <= compat.FEATURES.keys()
  rows = [{"slot_steps": 48.0, "gen_kv_bits": 32.0}, {"slot_steps": 0.0, "spec_accept_rate": 0.5}]
  assert compat.inactive(("slots", "speculative", "mesh"), rows) == []  # each shown by some row; mesh has no entry
  # continuous batching that dropped the speculation, or a full cache where int8 was asked for
  assert compat.inactive(("slots", "speculative"), rows[:1]) == ["speculative"]
  assert compat.inactive(("kv_int8", "slots"), rows) == ["kv_int8"]
  assert compat.inactive(("kv_int8",), [{"gen_kv_bits": 10.0}]) == []


def test_run_pairs_shows_both_features_of_each_pair(tmp_path):
  """Three pairs run for one learner step through `compat.run_pairs` (the slot engine with an int8 cache; episodes
  with μ's top-k records; ECHO's three sampler calls speculating, whose counters its record once dropped) and their
  metrics show both features on (`compat.EVIDENCE`)."""
  code = ("import json, sys\n"
          "from jaxrl_llm import compat\n"
          "got = compat.run_pairs(sys.argv[1], {('kv_int8', 'slots'), ('mu_topk', 'episodes'),\n"
          "                                     ('speculative', 'echo')})\n"
          "print(json.dumps([[a, b, e] for (a, b), e in got.items()]))\n")
  env = {**with_devices(compat.DEVICES), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  got = {(a, b): e for a, b, e in json.loads(r.stdout.strip().splitlines()[-1])}
  assert got == {("kv_int8", "slots"): None, ("mu_topk", "episodes"): None, ("speculative", "echo"): None}, got
