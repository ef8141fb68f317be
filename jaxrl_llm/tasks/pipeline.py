"""Prompt batches for rollouts, read with grain, with exactly resumable iterator state.

  it = make_prompt_iterator("arithmetic", "train", batch_size=8, seed=0, source="memory")
  batch = next(it)            # dict of numpy arrays, leading dim B
  state = it.get_state()      # goes into the checkpoint
  it2 = make_prompt_iterator(...same args...); it2.set_state(state)   # next(it2) == next(it)

Batch fields (B = batch size, P = prompt width, A = answer width), encoded by ``encoder``
(``tasks.encoder.Encoder``; default the char tokenizer: BOS + prompt characters, answer + EOS):
  prompt_tokens  int32[B, P]  prompt ids, left-padded with the tokenizer's pad id
  prompt_len     int32[B]     number of non-pad prompt tokens (BOS included)
  answer_tokens  int32[B, A]  reference answer + its end id, right-padded with the pad id
  answer_len     int32[B]     number of answer tokens (end id included)
  prompt, answer bytes[B]     UTF-8 text, for the host-side reward
  example_id     int64[B]     index of the example in its split

Sources (same examples, from ``base.split_examples``): ``"tfds"`` reads the ArrayRecord files of
``tfds_builders`` (built on first use); ``"memory"`` generates them in memory (tests, tiny runs).
The pipeline is ``source → shuffle(seed) → repeat → map(to_element) → batch``, a grain
``MapDataset``: every element is a pure function of its index, so the iterator state is a
position and resuming is exact.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import grain
import numpy as np

from jaxrl_llm.tasks import get_task
from jaxrl_llm.tasks.base import Task, num_held_out, split_examples
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder, round_width


def _memory_source(task_name, split, task_kwargs, *, data_dir, seed, num_train, num_test):
  del data_dir
  task = get_task(task_name, **(task_kwargs or {}))
  return [{"prompt": ex["prompt"].encode(), "answer": ex["answer"].encode(),
           "example_id": ex["example_id"]}
          for ex in split_examples(task, split, seed=seed, num_train=num_train, num_test=num_test)]


def _tfds_source(task_name, split, task_kwargs, *, data_dir, seed, num_train, num_test):
  from jaxrl_llm.tasks import tfds_builders  # lazy: imports tensorflow_datasets
  return tfds_builders.data_source(task_name, split, task_kwargs, data_dir=data_dir, seed=seed,
                                   num_train=num_train, num_test=num_test)


SOURCES: dict[str, Callable[..., Any]] = {"memory": _memory_source, "tfds": _tfds_source}


def to_element(record: dict[str, Any], *, prompt_width: int, answer_width: int,
               encoder: Encoder = CHAR_ENCODER) -> dict[str, Any]:
  """Turns a record ``{"prompt", "answer": bytes|str, "example_id"}`` into padded token arrays."""
  prompt = record["prompt"].decode() if isinstance(record["prompt"], bytes) else record["prompt"]
  answer = record["answer"].decode() if isinstance(record["answer"], bytes) else record["answer"]
  prompt_tokens, prompt_len = encoder.pad_prompts([prompt], prompt_width)
  answer_tokens, answer_len = encoder.pad_targets([answer], answer_width)
  return {
      "prompt_tokens": prompt_tokens[0],
      "prompt_len": prompt_len[0],
      "answer_tokens": answer_tokens[0],
      "answer_len": answer_len[0],
      "prompt": np.bytes_(prompt.encode()),
      "answer": np.bytes_(answer.encode()),
      "example_id": np.int64(record["example_id"]),
  }


def widths(task: Task, records=(), encoder: Encoder = CHAR_ENCODER) -> tuple[int, int]:
  """Default ``(prompt_width, answer_width)``: the task's bounds plus BOS / EOS (char tokenizer, raw),
  else the longest encoding among ``records`` rounded up to a shape bucket (``tasks.encoder.round_width``)."""
  if encoder.exact_char_widths:
    return task.max_prompt_len + 1, task.max_answer_len + 1
  text = lambda x: x.decode() if isinstance(x, bytes) else x
  rows = [records[i] for i in range(len(records))]
  longest = lambda ids: max((len(x) for x in ids), default=1)
  return (round_width(longest(encoder.prompt_ids(text(r["prompt"])) for r in rows)),
          round_width(longest(encoder.target_ids(text(r["answer"])) for r in rows)))


def make_prompt_dataset(task_name: str, split: str, batch_size: int, seed: int,
                        data_dir: str | os.PathLike | None = None, *, source: str = "tfds",
                        task_kwargs: dict[str, Any] | None = None, data_seed: int = 0,
                        num_train: int = 5000, num_test: int | None = None,
                        prompt_width: int | None = None, answer_width: int | None = None,
                        shuffle: bool = True, num_epochs: int | None = None,
                        drop_remainder: bool = True, encoder: Encoder = CHAR_ENCODER) -> grain.MapDataset:
  """The batched grain ``MapDataset`` behind ``make_prompt_iterator`` (same arguments)."""
  if source not in SOURCES:
    raise ValueError(f"unknown source {source!r}; valid sources: {sorted(SOURCES)}")
  task = get_task(task_name, **(task_kwargs or {}))
  if num_test is None:  # auto: 500 generated prompts, or 10% of a data file's rows (base.num_held_out)
    num_test = num_held_out(task, 0, num_train)
  records = SOURCES[source](task_name, split, task_kwargs, data_dir=data_dir, seed=data_seed,
                            num_train=num_train, num_test=num_test)
  default_p, default_a = (prompt_width, answer_width) if prompt_width and answer_width else widths(
      task, records, encoder)
  ds = grain.MapDataset.source(records)
  if shuffle:
    ds = ds.shuffle(seed=seed)  # reshuffled each epoch (grain folds the epoch into the seed)
  ds = ds.repeat(num_epochs)
  ds = ds.map(lambda r: to_element(r, prompt_width=prompt_width or default_p,
                                   answer_width=answer_width or default_a, encoder=encoder))
  return ds.batch(batch_size, drop_remainder=drop_remainder)


def make_prompt_iterator(task_name: str, split: str, batch_size: int, seed: int,
                         data_dir: str | os.PathLike | None = None, *, num_threads: int = 0,
                         prefetch_buffer_size: int = 16, **kwargs: Any):
  """A grain ``DatasetIterator`` over prompt batches with ``get_state``/``set_state``.

  Elements are cheap to make, so reading is synchronous by default (``num_threads=0``): grain's
  default (16 threads prefetching 500 batches) would make thousands of batches per iterator
  created or restored. ``num_threads > 0`` prefetches ``prefetch_buffer_size`` batches.

  Args:
    task_name: a name from ``jaxrl_llm.tasks.task_names()`` with a data source.
    split: ``"train"`` or ``"test"``.
    batch_size: B.
    seed: shuffle seed (the order); ``data_seed`` picks which examples exist.
    data_dir: TFDS data dir (default ``~/.cache/jaxrl_llm/tfds``); unused by ``source="memory"``.
    **kwargs: ``source`` ("tfds" | "memory"), ``task_kwargs``, ``data_seed``, ``num_train``,
      ``num_test`` (None = ``base.num_held_out``'s automatic size), ``prompt_width``, ``answer_width``, ``shuffle``, ``num_epochs`` (None =
      forever), ``drop_remainder``, ``encoder`` (``tasks.encoder.Encoder``, default the char
      tokenizer); see ``make_prompt_dataset``.
  """
  ds = make_prompt_dataset(task_name, split, batch_size, seed, data_dir, **kwargs)
  options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
  return iter(ds.to_iter_dataset(options))
