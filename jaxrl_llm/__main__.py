"""Command line: python -m jaxrl_llm --config=PATH --workdir=DIR [--config.FIELD=VALUE ...]"""

import os
import sys

if __name__ == "__main__":  # first, before any work: huge pages for XLA:CPU temporaries (see hugepages.py)
  from jaxrl_llm import hugepages
  hugepages.reexec_with_huge_pages()

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, plots and checkpoints.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from absl import logging
  if not flags.FLAGS["verbosity"].present:  # Orbax/JAX INFO logs drown the progress bar; -v 0 brings them back
    logging.set_verbosity(logging.WARNING)
  from jaxrl_llm import config as config_lib, distributed, loop, metrics
  distributed.maybe_initialize()  # multi-host: from JAX_COORDINATOR_ADDRESS etc.; a no-op on one process

  c = _CONFIG.value
  try:
    config_lib.validate(c)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    rows = loop.run(c, _WORKDIR.value)
  except config_lib.ConfigError as e:  # found at set-up (e.g. a missing checkpoint folder): one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  import json
  info = json.load(open(os.path.join(_WORKDIR.value, "run_info.json")))
  if not rows:
    print(f"nothing to do: {_WORKDIR.value} already holds a run that reached num_steps={c.num_steps} "
          f"(resumed at step {info['resumed_from_step']}); use another --workdir or a larger --config.num_steps")
  if rows:
    plot_path = os.path.join(_WORKDIR.value, "reward_accuracy.png")
    metrics.plot(rows, plot_path, title=f"{c.loss.name}, {c.rollout.mode} (lag {c.rollout.lag})")
    print(metrics.summary_table(rows, info.get("eval_accuracy_initial")))
    if info.get("time_sft_s"):
      print(f"SFT warm start: {info['time_sft_s']:.1f} s; held-out accuracy 'start' is after it, before RL")
    print(f"XLA compilations: train_step={info['compiles_train_step']} generate={info['compiles_generate']} "
          f"score={info['compiles_score']}")
    print(f"metrics: {os.path.join(_WORKDIR.value, 'metrics.jsonl')}\nplot:    {plot_path}")


if __name__ == "__main__":
  app.run(main)
