"""Writes the Colab notebooks (colab/*.ipynb) from the cell sources below: edit here, then run

    python colab/make_notebooks.py

Notebooks are stored without outputs; tests/test_notebooks.py executes them top to bottom.
"""

from __future__ import annotations

import os

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))

# Colab has no checkout: clone the repository and install it unless jaxrl_llm is already importable
# and the configs/ folder is found (a local checkout, or the test suite).
SETUP = '''\
import importlib.util, os, pathlib, sys

# Set this to the git URL of your jaxrl_llm checkout (or fork) when running on Colab.
REPO_URL = os.environ.get("JAXRL_LLM_REPO", "")


def find_root():
  for d in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (d / "configs" / "tiny.py").exists() and (d / "jaxrl_llm").is_dir():
      return d
  return None


ROOT = find_root()
if ROOT is None or importlib.util.find_spec("jaxrl_llm") is None:
  if ROOT is None:
    if not REPO_URL:
      raise RuntimeError("set REPO_URL (or the JAXRL_LLM_REPO environment variable) to the jaxrl_llm git URL")
    !git clone -q {REPO_URL} jaxrl_llm_repo
    ROOT = pathlib.Path("jaxrl_llm_repo").resolve()
  %pip install -q -e {ROOT}
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the tiny config runs on CPU; unset to use a GPU/TPU
print("repository:", ROOT)
'''

LOAD_TINY = '''\
from jaxrl_llm.config import load_file


def load_config(name):
  c = load_file(ROOT / "configs" / f"{name}.py")
  c.log.progress = False
  c.log.tensorboard = False
  return c
'''


def md(s):
  return nbformat.v4.new_markdown_cell(s)


def code(s):
  return nbformat.v4.new_code_cell(s)


QUICKSTART = [
    md("# jaxrl_llm quickstart\n\nTrain the tiny policy on 2-digit addition with GRPO-style PPO-clip "
       "(`loop.run`), then plot reward and held-out accuracy. About a minute on a CPU."),
    code(SETUP),
    code(LOAD_TINY + '''
c = load_config("tiny")
c.num_steps = 30
c.eval.every = 10
c.optim.lr = 1e-3  # the tiny model tolerates a large step
print(c.loss.name, c.rollout.mode, c.model.d_model)
'''),
    code('''\
import tempfile
from jaxrl_llm import loop

workdir = tempfile.mkdtemp(prefix="quickstart_")
rows = loop.run(c, workdir)
print(len(rows), "learner steps; metrics in", workdir)
'''),
    code('''\
import json
import matplotlib.pyplot as plt

info = json.load(open(f"{workdir}/run_info.json"))
fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3))
a1.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows])
a1.set_title("train reward"); a1.set_xlabel("learner step")
ev = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
a2.plot([-1] + [s for s, _ in ev], [info["eval_accuracy_initial"]] + [a for _, a in ev], marker="o")
a2.set_title("held-out accuracy"); a2.set_xlabel("learner step")
plt.tight_layout(); plt.show()
assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
'''),
]

PROTOTYPE = [
    md("# Prototype a loss in a notebook\n\nWrite a policy loss as a pure function, register it, check it "
       "against the library contract (finite gradients under `-inf` padding, zero gradient on masked tokens, "
       "on-policy gradient = vanilla PG), then compare it with `ppo_clip` at a fixed lag."),
    code(SETUP),
    code('''\
import dataclasses
import jax
import jax.numpy as jnp
from jaxrl_llm import losses
from jaxrl_llm.losses import core


@dataclasses.dataclass(frozen=True)
class Hparams:
  cap: float = 2.0  # truncation of the importance weight


def truncated_is_pg(inputs, hp):
  """Truncated-IS policy gradient: ℓ_t = -Â_t · sg(min(π_θ/π_old, C)) · log π_θ(y_t).

  On-policy (π_θ = π_old) the weight is 1 and the gradient is vanilla PG's.
  """
  lr = core.safe_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, inputs.mask_BN)
  w = jax.lax.stop_gradient(jnp.minimum(jnp.exp(lr), hp.cap))
  loss = -inputs.adv_BN * w * core.safe_logp(inputs.logp_BN, inputs.mask_BN)
  aux = {"truncated_frac": core.metric(jnp.exp(lr) > hp.cap, inputs.mask_BN)}
  return core.apply_mask(loss, inputs.mask_BN), aux


losses.unregister("truncated_is_pg")  # re-running this cell re-registers
losses.register("truncated_is_pg", truncated_is_pg, Hparams, needs=("prox_logp",))
print("truncated_is_pg" in losses.names())
'''),
    code('''\
import numpy as np
from jaxrl_llm.types import LossInputs

rng = np.random.default_rng(0)
mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], jnp.float32)
adv = jnp.array([1.5, -0.7, 0.4])[:, None] * mask
logp = jnp.where(mask > 0, jnp.asarray(rng.uniform(-3, -0.05, mask.shape), jnp.float32), -jnp.inf)
prox = jnp.where(mask > 0, logp + jnp.asarray(rng.normal(0, 0.5, mask.shape), jnp.float32), -jnp.inf)


def grad_of(name, logp_BN, prox_BN):
  spec = losses.get(name)
  def total(lp):
    loss_BN, _ = spec.fn(LossInputs(logp_BN=lp, mask_BN=mask, adv_BN=adv, prox_logp_BN=prox_BN), spec.Hparams())
    return losses.reduce(loss_BN, mask, "token-mean")
  return jax.grad(total)(logp_BN)


g = grad_of("truncated_is_pg", logp, prox)
assert bool(jnp.all(jnp.isfinite(g))), "gradients must be finite under -inf padding"
assert bool(jnp.all(jnp.where(mask > 0, 0.0, g) == 0.0)), "masked tokens must get zero gradient"
g_on = grad_of("truncated_is_pg", logp, logp)  # on-policy: π_old = π_θ
g_pg = grad_of("pg", logp, logp)
np.testing.assert_allclose(np.asarray(g_on), np.asarray(g_pg), rtol=1e-6, atol=1e-7)
print("contract checks passed")
'''),
    code(LOAD_TINY + '''
import tempfile
from jaxrl_llm import loop

curves = {}
for name in ("ppo_clip", "truncated_is_pg"):
  c = load_config("tiny")
  c.num_steps = 12
  c.eval.every = 0
  c.optim.lr = 1e-3
  c.rollout.mode = "fixed_lag"
  c.rollout.lag = 4
  c.loss.name = name
  curves[name] = loop.run(c, tempfile.mkdtemp(prefix=name))
  print(name, "final reward", curves[name][-1]["reward_mean"])
'''),
    code('''\
import matplotlib.pyplot as plt
for name, rows in curves.items():
  plt.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label=name)
plt.xlabel("learner step"); plt.ylabel("train reward"); plt.title("fixed lag 4"); plt.legend(); plt.show()
'''),
]

ABLATION = [
    md("# Staleness ablation results\n\nLoads `experiments/results/staleness_ablation.json` (written by "
       "`python -m experiments.staleness_ablation`) and plots held-out accuracy against the lag, method by method. "
       "Without a results file it makes a 2-step one with the tiny config so the notebook still runs."),
    code(SETUP),
    code('''\
import json, tempfile
from experiments import report, staleness_ablation

path = ROOT / "experiments" / "results" / "staleness_ablation.json"
if not path.exists():
  tmp = tempfile.mkdtemp()
  path = staleness_ablation.main(["--base", "tiny", "--methods", "grpo", "--lags", "0,1", "--tasks", "arithmetic",
                                  "--steps", "2", "--out", tmp, "--workdir", tmp])
doc = json.load(open(path))
print(doc["command"], "|", doc["commit"], "|", doc["machine"]["cpu"])
'''),
    code('''\
runs = doc["runs"]
for task in sorted({r["task"] for r in runs}):
  lags = sorted({r["lag"] for r in runs if r["task"] == task})
  print(f"\\n{task}: held-out accuracy (late), mean ± std over seeds")
  print(f"{'method':16s}" + "".join(f"lag {k:<10d}" for k in lags))
  for m in doc["methods"]:
    cells = [report.fmt(report.cell(runs, task=task, method=m, lag=k)) for k in lags]
    if any(x != "—" for x in cells):
      print(f"{m:16s}" + "".join(f"{x:14s}" for x in cells))
'''),
    code('''\
import matplotlib.pyplot as plt
tasks = sorted({r["task"] for r in runs})
fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 3.5), squeeze=False)
for ax, task in zip(axes[0], tasks):
  lags = sorted({r["lag"] for r in runs if r["task"] == task})
  for m in doc["methods"]:
    pts = [(k, report.cell(runs, task=task, method=m, lag=k)) for k in lags]
    pts = [(k, s["mean"]) for k, s in pts if s]
    if pts:
      ax.plot([str(k) for k, _ in pts], [v for _, v in pts], marker="o", label=m)
  ax.set_title(task); ax.set_xlabel("lag"); ax.set_ylabel("held-out accuracy")
  ax.legend(fontsize=6, ncol=2)
plt.tight_layout(); plt.show()
'''),
]

NOTEBOOKS = {"01_quickstart.ipynb": QUICKSTART, "02_prototype_a_loss.ipynb": PROTOTYPE,
             "03_staleness_ablation.ipynb": ABLATION}


def main() -> None:
  for name, cells in NOTEBOOKS.items():
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["colab"] = {"provenance": []}
    nbformat.write(nb, os.path.join(HERE, name))


if __name__ == "__main__":
  main()
