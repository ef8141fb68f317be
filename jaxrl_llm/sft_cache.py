"""A warm start computed once per input: the result of an SFT run stored under the digest of everything it reads.

Opt-in through the environment variable `JAXRL_LLM_SFT_CACHE` (a directory; unset = no cache). The test suite
sets it to a fresh directory per session (tests/conftest.py): dozens of runs start from the same 150-step warm
start of `configs/tiny.py`, and with the cache each distinct one is trained once. It is equally useful for an
ablation that starts many RL runs from one warm start.

The key is a SHA-256 of the SFT's exact inputs: the model config, the optimiser settings, the initial parameters'
bytes, every batch the steps would feed (`batches`, drawn before any step runs), the jax version and the source of
the package (so an edited model, loss or optimiser never reads an old entry). A hit returns bitwise the parameters
and final loss the steps would have produced, because the entry is that computation's output, stored exactly
(`.npz` of the leaves, read with `allow_pickle=False`: no code runs at load). A process writes an entry to a
temporary name and renames it, so concurrent runs (xdist workers, the processes of a multi-process run) never
read half an entry. Only unsharded parameters of plain numpy dtypes are cached; anything else trains as usual.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

ENV = "JAXRL_LLM_SFT_CACHE"


@functools.cache
def _source_digest() -> str:
  """SHA-256 of every module of the package (the code an SFT step runs is somewhere in it)."""
  h = hashlib.sha256(jax.__version__.encode())
  root = pathlib.Path(__file__).parent
  for p in sorted(root.rglob("*.py")):
    h.update(str(p.relative_to(root)).encode())
    h.update(p.read_bytes())
  return h.hexdigest()


def _cacheable(leaves) -> bool:
  return all(isinstance(x, (np.ndarray, jax.Array)) and np.dtype(x.dtype).kind in "fiub"
             and (not isinstance(x, jax.Array) or x.is_fully_addressable and len(x.sharding.device_set) == 1)
             for x in leaves)


def digest(settings: dict, params, batches: Iterable[tuple]) -> str:
  """The entry's key: `settings` (JSON-able: model config, optimiser, step count), the initial parameters and
  every batch, as bytes with their shapes and dtypes."""
  h = hashlib.sha256(_source_digest().encode())
  h.update(json.dumps(settings, sort_keys=True, default=str).encode())
  for arrays in [jax.tree.leaves(params), *map(list, batches)]:
    for x in arrays:
      a = np.asarray(x)
      h.update(f"{a.shape}{a.dtype}".encode())
      h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()


def _load(path: pathlib.Path, params) -> tuple[Any, float] | None:
  leaves, treedef = jax.tree.flatten(params)
  try:
    with np.load(path / "params.npz", allow_pickle=False) as f:
      stored = [f[f"leaf{i}"] for i in range(len(leaves))]
    loss = json.loads((path / "meta.json").read_text())["loss"]
  except (OSError, KeyError, ValueError):
    return None  # absent or unreadable: train and write it anew
  if any(s.shape != x.shape or s.dtype != x.dtype for s, x in zip(stored, leaves)):
    return None
  return jax.tree.unflatten(treedef, [jnp.asarray(s) for s in stored]), float(loss)


def _store(path: pathlib.Path, params, loss: float) -> None:
  tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
  tmp.mkdir(parents=True, exist_ok=True)
  np.savez(tmp / "params.npz", **{f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))})
  (tmp / "meta.json").write_text(json.dumps({"loss": loss}))
  try:
    os.replace(tmp, path)
  except OSError:  # another process stored the same entry first: theirs is the same computation's output
    for f in tmp.iterdir():
      f.unlink()
    tmp.rmdir()


def cached(settings: dict, params, batches: list[tuple], train: Callable[[], tuple[Any, float]],
           cache_dir: str | None = None) -> tuple[Any, float]:
  """`train()` (an SFT run from `params` over `batches`, returning (params, final loss)), or its stored result.

  `cache_dir` defaults to `$JAXRL_LLM_SFT_CACHE`; without one, or for parameters that are sharded or of a dtype
  numpy cannot store exactly, it just calls `train()`."""
  cache_dir = os.environ.get(ENV, "") if cache_dir is None else cache_dir
  if not cache_dir or not _cacheable(jax.tree.leaves(params)):
    return train()
  path = pathlib.Path(cache_dir) / digest(settings, params, batches)
  hit = _load(path, params)
  if hit is not None:
    return hit
  out_params, loss = train()
  if _cacheable(jax.tree.leaves(out_params)):
    _store(path, out_params, loss)
  return out_params, loss


def settings_of(model_cfg, schedule) -> dict:
  """The JSON-able part of an SFT run's key: its model config and schedule (dataclasses)."""
  return {"model": dataclasses.asdict(model_cfg), "schedule": dataclasses.asdict(schedule)}
