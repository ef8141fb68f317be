"""TFDS datasets of the built-in tasks, generated locally as ArrayRecord (no download, no TF).

One builder per task (``jaxrl_arithmetic``, ``jaxrl_countdown``, and for the data-file tasks
``jaxrl_jsonl``, ``jaxrl_gsm8k``, ``jaxrl_math``, ``jaxrl_dapo``), all generic over
``base.split_examples``, so TFDS rows equal the in-memory examples of the same config. A
``TaskBuilderConfig`` carries the task's keyword arguments, the generation seed and the split
sizes; its name hashes them (with ``GENERATOR_VERSION``, and for a data file a digest of its
loaded rows, so an edited file is rebuilt), so two configurations never share files.
Records hold ``prompt`` and ``answer`` (text, read back as bytes) and ``example_id`` (int64), in
generation order (TFDS shuffling is disabled), so record i is example i.

Layout: ``{data_dir}/jaxrl_{task}/{config name}/1.0.0/*.array_record-*``. Building 5k examples
takes well under a second; a built dataset is reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from jaxrl_llm.tasks import get_task
from jaxrl_llm.tasks.base import split_examples

DEFAULT_DATA_DIR = "~/.cache/jaxrl_llm/tfds"
# Bump when example generation changes, so stale files are not reused under the same name.
GENERATOR_VERSION = 1


@dataclasses.dataclass(eq=False)  # TFDS's BuilderConfig is a non-frozen dataclass
class TaskBuilderConfig(tfds.core.BuilderConfig):
  """Which examples to generate: resolved task kwargs, seed, split sizes."""
  task_kwargs: tuple[tuple[str, Any], ...] = ()
  seed: int = 0
  num_train: int = 5000
  num_test: int = 500


class _TaskBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Generic builder; subclasses only set TASK_NAME."""
  TASK_NAME = ""
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Procedurally generated train/test splits."}
  # There are no download checksums to locate. TFDS 4.9.10's lookup of a packaged builder's code
  # path needs the `importlib_resources` backport on Python >= 3.9, which it does not install.
  code_path = None

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=f"jaxrl_llm {self.TASK_NAME} task, config {self.builder_config}",
        features=tfds.features.FeaturesDict({
            "prompt": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "example_id": np.int64,
        }),
        # Keep generation order: record i is example i, as in the in-memory source.
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    return {split: self._generate_examples(split) for split in ("train", "test")}

  def _generate_examples(self, split):
    cfg = self.builder_config
    task = get_task(self.TASK_NAME, **dict(cfg.task_kwargs))
    for ex in split_examples(task, split, seed=cfg.seed, num_train=cfg.num_train,
                             num_test=cfg.num_test):
      yield ex["example_id"], ex


class JaxrlArithmetic(_TaskBuilder):
  """TFDS name ``jaxrl_arithmetic``."""
  TASK_NAME = "arithmetic"


class JaxrlArithmeticChat(_TaskBuilder):
  """TFDS name ``jaxrl_arithmetic_chat``."""
  TASK_NAME = "arithmetic_chat"


class JaxrlCountdown(_TaskBuilder):
  """TFDS name ``jaxrl_countdown``."""
  TASK_NAME = "countdown"


class JaxrlJsonl(_TaskBuilder):
  """TFDS name ``jaxrl_jsonl``: the rows of a user JSONL / parquet file."""
  TASK_NAME = "jsonl"


class JaxrlGsm8k(_TaskBuilder):
  """TFDS name ``jaxrl_gsm8k``: a GSM8K file (``question``, ``answer``)."""
  TASK_NAME = "gsm8k"


class JaxrlMath(_TaskBuilder):
  """TFDS name ``jaxrl_math``: a MATH / MATH-500 file."""
  TASK_NAME = "math"


class JaxrlDapo(_TaskBuilder):
  """TFDS name ``jaxrl_dapo``: a DAPO / verl prompt + ground-truth file."""
  TASK_NAME = "dapo"


BUILDERS = {b.TASK_NAME: b for b in (JaxrlArithmetic, JaxrlArithmeticChat, JaxrlCountdown, JaxrlJsonl, JaxrlGsm8k, JaxrlMath,
                                     JaxrlDapo)}


def make_config(task_name: str, task_kwargs: dict[str, Any] | None = None, *, seed: int = 0,
                num_train: int = 5000, num_test: int = 500) -> TaskBuilderConfig:
  """The builder config of a task; its name is a stable hash of the resolved task kwargs."""
  task = get_task(task_name, **(task_kwargs or {}))
  resolved = task.kwargs
  rows = "" if task.rows is None else hashlib.sha256(repr(task.rows).encode()).hexdigest()
  key = repr((GENERATOR_VERSION, task_name, resolved, seed, num_train, num_test) + ((rows,) if rows else ()))
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  return TaskBuilderConfig(name=f"s{seed}_train{num_train}_test{num_test}_{digest}",
                           description=repr(resolved), task_kwargs=resolved, seed=seed,
                           num_train=num_train, num_test=num_test)


def build(task_name: str, task_kwargs: dict[str, Any] | None = None, *,
          data_dir: str | os.PathLike | None = None, seed: int = 0, num_train: int = 5000,
          num_test: int = 500) -> tfds.core.DatasetBuilder:
  """Generates (once) and returns the builder of a task's train/test splits as ArrayRecord."""
  if task_name not in BUILDERS:
    raise ValueError(f"no TFDS builder for task {task_name!r}; valid names: {sorted(BUILDERS)}")
  data_dir = os.path.expanduser(os.fspath(data_dir or DEFAULT_DATA_DIR))
  config = make_config(task_name, task_kwargs, seed=seed, num_train=num_train, num_test=num_test)
  builder = BUILDERS[task_name](config=config, data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare(download_dir=os.path.join(data_dir, "downloads"))
  return builder


def data_source(task_name: str, split: str, task_kwargs: dict[str, Any] | None = None, *,
                data_dir: str | os.PathLike | None = None, seed: int = 0, num_train: int = 5000,
                num_test: int = 500):
  """A random-access source (``len``, ``__getitem__``) over one split, building it if needed.

  Records are dicts ``{"prompt": bytes, "answer": bytes, "example_id": int}`` in ``example_id``
  order, identical to the in-memory source of ``pipeline``.
  """
  builder = build(task_name, task_kwargs, data_dir=data_dir, seed=seed, num_train=num_train,
                  num_test=num_test)
  return builder.as_data_source(split=split)
