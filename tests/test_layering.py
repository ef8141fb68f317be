"""The package's layering (.importlinter) holds, and its contracts catch the back-arrows they forbid.

`lint-imports` reads the imports statically (function-local ones too); no package code runs.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTRACTS = os.path.join(ROOT, ".importlinter")


def lint_imports(package_root: str) -> subprocess.CompletedProcess:
  """Runs the venv's `lint-imports` on the repo's contracts, for the `jaxrl_llm` found under `package_root`."""
  exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
  if not os.path.exists(exe):
    exe = shutil.which("lint-imports")
  assert exe, "lint-imports not found: pip install import-linter (the `test` extra)"
  env = {**os.environ, "PYTHONPATH": package_root}
  return subprocess.run([exe, "--no-cache", "--no-logo", CONTRACTS], cwd=package_root, env=env,
                        capture_output=True, text=True, timeout=120)


def test_package_keeps_its_layering():
  out = lint_imports(ROOT)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "0 broken" in out.stdout


# (file of the package, a function-local import appended to it, the import the report must name)
BACK_ARROWS = [
    ("distill/teacher.py", "from jaxrl_llm import loop", "jaxrl_llm.distill.teacher -> jaxrl_llm.loop"),
    ("config.py", "from jaxrl_llm.distill import opd", "jaxrl_llm.config -> jaxrl_llm.distill.opd"),
    ("losses/pg.py", "from jaxrl_llm.models import forward", "jaxrl_llm.losses.pg -> jaxrl_llm.models"),
    ("models/transformer.py", "from jaxrl_llm.losses import core", "jaxrl_llm.models.transformer -> jaxrl_llm.losses.core"),
    ("sampling/sample.py", "from jaxrl_llm.rollout import param_store",
     "jaxrl_llm.sampling.sample -> jaxrl_llm.rollout.param_store"),
    ("rollout/collect.py", "from jaxrl_llm import sft", "jaxrl_llm.rollout.collect -> jaxrl_llm.sft"),
    ("tasks/encoder.py", "from jaxrl_llm.models import tokenizer", "jaxrl_llm.tasks.encoder -> jaxrl_llm.models"),
    ("losses/pg.py", "from jaxrl_llm.tasks import reward", "jaxrl_llm.losses.pg -> jaxrl_llm.tasks"),
    ("envs/guess_number.py", "from jaxrl_llm.rollout import collect", "jaxrl_llm.envs.guess_number -> jaxrl_llm.rollout"),
    ("config.py", "from jaxrl_llm.models import ModelConfig", "jaxrl_llm.config -> jaxrl_llm.models"),
    ("sharding.py", "from jaxrl_llm.rollout import param_store", "jaxrl_llm.sharding -> jaxrl_llm.rollout"),
    ("rollout/sources/staged.py", "import ml_collections", "jaxrl_llm.rollout.sources.staged -> ml_collections"),
    ("record.py", "from jaxrl_llm import learner", "jaxrl_llm.record -> jaxrl_llm.learner"),
    ("wiring.py", "from jaxrl_llm import run_state", "jaxrl_llm.wiring -> jaxrl_llm.run_state"),
]


@pytest.mark.parametrize("path,stmt,reported", BACK_ARROWS, ids=[f"{b[0]}:{b[2].split(' -> ')[1]}" for b in BACK_ARROWS])
def test_contracts_catch_a_back_arrow(tmp_path, path, stmt, reported):
  """A copy of the package with one forbidden import added inside a function breaks a contract."""
  shutil.copytree(os.path.join(ROOT, "jaxrl_llm"), tmp_path / "jaxrl_llm",
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  target = tmp_path / "jaxrl_llm" / path
  assert target.exists(), path
  with open(target, "a") as f:
    f.write(f"\n\ndef _back_arrow():\n  {stmt}\n")
  out = lint_imports(str(tmp_path))
  assert out.returncode == 1, out.stdout + out.stderr
  assert "BROKEN" in out.stdout and reported in out.stdout, out.stdout


def test_config_learns_the_opd_needs_from_the_component_not_an_import():
  """`config` imports no distillation code; importing the loop (as every run does) registers OPD's needs."""
  code = """if True:
    import sys
    from jaxrl_llm import config
    c = config.load_file(sys.argv[1])
    assert c.distill.teacher and "jaxrl_llm.distill.opd" not in sys.modules
    assert "teacher_logits" not in config.available_needs(c)
    from jaxrl_llm import loop
    assert {"teacher_logp", "teacher_logits", "teacher_topk", "student_logits"} <= config.available_needs(c)
    c.loss.name = "opd_forward_kl"
    config.validate(c)
    c.distill.teacher = ""
    assert "teacher_logits" not in config.available_needs(c)
    print("ok")
  """
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "configs", "opd_tiny.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
