"""Executes the Colab notebooks top to bottom (tiny configs, CPU) with the project's interpreter."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(ROOT, "colab")) if f.endswith(".ipynb"))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
  """A kernelspec whose argv is this interpreter (`sys.executable`), so notebooks run in the project venv."""
  from ipykernel.kernelspec import install
  prefix = str(tmp_path_factory.mktemp("kernels"))
  install(kernel_name="jaxrl_llm_test", prefix=prefix)
  old = os.environ.get("JUPYTER_PATH")
  os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (os.path.join(prefix, "share", "jupyter"), old) if p)
  yield "jaxrl_llm_test"
  if old is None:
    os.environ.pop("JUPYTER_PATH", None)
  else:
    os.environ["JUPYTER_PATH"] = old


def test_notebooks_exist():
  assert NOTEBOOKS == ["01_quickstart.ipynb", "02_prototype_a_loss.ipynb", "03_staleness_ablation.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, kernel, tmp_path, monkeypatch):
  import nbclient
  import nbformat
  nb = nbformat.read(os.path.join(ROOT, "colab", name), as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "store notebooks without outputs"
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=300, resources={"metadata": {"path": ROOT}})
  client.execute()  # raises CellExecutionError naming the failing cell
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors
