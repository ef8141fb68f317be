"""Runs the shared command-line / metrics contract check (../shared/checks/cli-contract) when present."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "..", "shared", "checks", "cli-contract")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHECK), reason="../shared/checks/cli-contract not beside the checkout")
def test_cli_contract():
  r = subprocess.run(["bash", CHECK, sys.executable], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stdout + r.stderr
  assert "OK: unknown config field rejected" in r.stdout
