"""Orbax checkpoints: save a run's state, keep the recent and the best, resume from the newest good one.

One checkpoint step holds three Orbax items in one composite, committed atomically by Orbax (written to
`<step>.orbax-checkpoint-tmp-*`, renamed to `<step>` when complete):
  state      the array pytree (train state, parameter snapshots, RNG key data, loss state, ...): PyTreeSave
  meta       the caller's JSON (resolved config, data-iterator state, controller counters, ...): JsonSave
  integrity  format version, package version and a checksum per state leaf: JsonSave

`Checkpointer.latest_valid(abstract_state)` walks the steps newest first and returns the first that
passes every check below; each one that fails is reported with a `CheckpointWarning` naming the step
and the reason, and (by default) moved to `<directory>/quarantine/` so the resumed run can save that
step again. What is detected:
  - partial saves: `*.orbax-checkpoint-tmp-*` directories (a save that never committed);
  - missing or unreadable step metadata (`_CHECKPOINT_METADATA`);
  - missing items, missing or unreadable item metadata (`state/_METADATA`, JSON files), truncated or
    missing array files: anything that makes the Orbax restore raise;
  - a tree structure, shape or dtype different from `abstract_state`;
  - silent byte corruption of array data (same file sizes, different bytes): the per-leaf checksum
    (two wrapping uint32 sums over the leaf's bit pattern, one position-weighted) no longer matches.
Not detected: corruption of the caller's JSON that still parses to valid JSON.

A step whose saved tree (leaf paths, shapes, dtypes: recorded in `integrity`) does not fit the
requested `abstract_state` is not corrupt: it is skipped with a warning, listed in `mismatched`, and
never moved to quarantine (a run whose config changed must not destroy the checkpoints of the old one).

Nothing is ever unpickled or evaluated on restore: items are arrays and plain JSON. Host-side data of
variable size (buffers of rollouts) goes through `pack_host` / `unpack_host`: a JSON skeleton for `meta`
and one flat array per dtype for `state`, rebuilt with `abstract_state` given as a function of `meta`.

Leaves of `state` must be arrays (jax or numpy) or None; store PRNG keys as `jax.random.key_data`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as preservation_lib

import jaxrl_llm
from jaxrl_llm.errors import RunError

FORMAT_VERSION = 1
_ITEMS = ("state", "meta", "integrity")
_TMP_STEP_RE = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
_QUARANTINE = "quarantine"


class CheckpointWarning(UserWarning):
  """A checkpoint step was found partial or corrupt and skipped."""


class _Invalid(Exception):
  """A checkpoint step failed a check; the message is the reason."""


class _Mismatch(Exception):
  """A checkpoint step is readable but its tree does not fit the requested state; the message says where."""


class MetaError(ValueError):
  """Raised by an `abstract_state` function whose `meta` is unusable: the step is treated as corrupt."""


# ----------------------------------------------------------------------------------------------
# Host data as JSON + arrays (never pickle).

_HOST_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64")
_ARRAY_TAG = "__array__"


def pack_host(obj) -> tuple[Any, dict[str, np.ndarray]]:
  """(JSON skeleton, {dtype name: flat array}) of nested dicts (str keys), lists, tuples, numpy arrays,
  numbers, strings, bools and None. Arrays become `{"__array__": [dtype, offset, shape]}` into the flat
  array of their dtype; tuples become lists. Raises TypeError on anything else (objects, callables)."""
  chunks: dict[str, list[np.ndarray]] = {}
  sizes: dict[str, int] = {}

  def walk(x):
    if x is None or isinstance(x, (bool, str)):
      return x
    if isinstance(x, (int, float)):
      return x
    if isinstance(x, np.generic):
      return walk(x.item())
    if isinstance(x, (np.ndarray, jax.Array)):
      a = np.asarray(x)
      name = a.dtype.name
      if name not in _HOST_DTYPES:
        raise TypeError(f"pack_host: arrays of dtype {name} are not supported")
      off = sizes.get(name, 0)
      chunks.setdefault(name, []).append(a.reshape(-1))
      sizes[name] = off + a.size
      return {_ARRAY_TAG: [name, off, list(a.shape)]}
    if isinstance(x, dict):
      if not all(isinstance(k, str) for k in x):
        raise TypeError(f"pack_host: dict keys must be str, got {sorted(map(repr, x))[:3]}")
      return {k: walk(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [walk(v) for v in x]
    raise TypeError(f"pack_host: cannot store a {type(x).__name__} as plain data")

  skeleton = walk(obj)
  arrays = {k: np.concatenate(v) for k, v in chunks.items() if sizes[k] > 0}
  return skeleton, arrays


def host_sizes(arrays: dict[str, np.ndarray]) -> dict[str, int]:
  """{dtype name: length} of `pack_host` arrays (store it in `meta` to rebuild the restore target)."""
  return {k: int(v.shape[0]) for k, v in arrays.items()}


def host_template(sizes: dict) -> dict[str, np.ndarray]:
  """Restore target of `pack_host` arrays from `host_sizes`; raises MetaError on anything unexpected."""
  if not isinstance(sizes, dict):
    raise MetaError(f"host array sizes must be a JSON object, got {type(sizes).__name__}")
  out = {}
  for k, n in sizes.items():
    if k not in _HOST_DTYPES or not isinstance(n, int) or isinstance(n, bool) or n <= 0:
      raise MetaError(f"bad host array entry {k!r}: {n!r}")
    out[k] = np.zeros(n, np.dtype(k))
  return out


def unpack_host(skeleton, arrays: dict[str, np.ndarray]):
  """Inverse of `pack_host` (lists stay lists). Raises MetaError when a reference is malformed or out of range."""
  def walk(x):
    if isinstance(x, dict):
      if _ARRAY_TAG in x:
        ref = x[_ARRAY_TAG]
        if not (isinstance(ref, list) and len(ref) == 3 and ref[0] in _HOST_DTYPES and isinstance(ref[1], int)
                and isinstance(ref[2], list) and all(isinstance(d, int) and d >= 0 for d in ref[2])):
          raise MetaError(f"malformed array reference {str(ref)[:80]}")
        name, off, shape = ref
        n = int(np.prod(shape, dtype=np.int64))
        if n == 0:
          return np.zeros(shape, np.dtype(name))
        flat = arrays.get(name)
        if flat is None or off < 0 or off + n > flat.shape[0]:
          raise MetaError(f"array reference {str(ref)[:80]} is out of range")
        return np.asarray(flat[off:off + n]).astype(np.dtype(name)).reshape(shape)
      return {k: walk(v) for k, v in x.items()}
    if isinstance(x, list):
      return [walk(v) for v in x]
    return x

  return walk(skeleton)


def tree_signature(state) -> list[list]:
  """[[leaf path, shape, canonical dtype], ...] of an array pytree (what a restore target must match)."""
  return [[jax.tree_util.keystr(p), [int(d) for d in np.shape(x)],
           str(jax.dtypes.canonicalize_dtype(np.dtype(x.dtype)))]
          for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]


def _signature_diff(saved, want) -> str | None:
  """The first difference between two tree signatures, or None."""
  if not isinstance(saved, list):
    return None  # a checkpoint from before signatures: the restore itself checks
  saved_by = {tuple(s[0:1]): s for s in saved}
  want_by = {tuple(w[0:1]): w for w in want}
  missing = [k[0] for k in want_by if k not in saved_by]
  extra = [k[0] for k in saved_by if k not in want_by]
  if missing or extra:
    return f"tree structure differs (missing {missing[:3]}, unexpected {extra[:3]})"
  for k, w in want_by.items():
    s = saved_by[k]
    if list(s[1]) != list(w[1]):
      return f"shape mismatch at {k[0]}: saved {tuple(s[1])}, target {tuple(w[1])}"
    if s[2] != w[2]:
      return f"dtype mismatch at {k[0]}: saved {s[2]}, target {w[2]}"
  return None


# ----------------------------------------------------------------------------------------------
# Pure helpers: checksums and restore targets.


def _leaf_words(x):
  """The bit pattern of `x` as a flat uint32 vector (bool/8-bit/16-bit widened, 64-bit split)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).reshape(-1)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


def _leaf_checksum(x):
  """Two wrapping uint32 sums: plain and position-weighted (Fletcher-like), as a uint32[2]."""
  words = _leaf_words(x)
  position_weight = jnp.arange(1, words.shape[0] + 1, dtype=jnp.uint32)
  return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * position_weight, dtype=jnp.uint32)])


@jax.jit
def _tree_checksums(leaves):
  return [_leaf_checksum(jnp.asarray(x)) for x in leaves]


def state_checksums(state) -> list[list[int]]:
  """Per-leaf checksums of an array pytree, in `jax.tree.leaves` order: one jit per device set (a learner
  and a sampler on disjoint devices cannot meet in one computation), one jit in all on one device set.
  Host (numpy) leaves join the first device set."""
  leaves = jax.tree.leaves(state)
  groups: dict = {}
  for i, x in enumerate(leaves):
    groups.setdefault(frozenset(x.sharding.device_set) if isinstance(x, jax.Array) else None, []).append(i)
  if None in groups and len(groups) > 1:
    host = groups.pop(None)
    first = next(iter(groups))
    groups[first] = sorted(groups[first] + host)
  out: list = [None] * len(leaves)
  for idx in groups.values():
    for i, (a, b) in zip(idx, jax.device_get(_tree_checksums([leaves[i] for i in idx]))):
      out[i] = [int(a), int(b)]
  return out


def _restore_target(leaf):
  """A concrete restore target: numpy stays numpy; jax arrays keep their sharding (default: device 0)."""
  if isinstance(leaf, np.ndarray | np.generic) or not hasattr(leaf, "shape"):
    return np.asarray(leaf)
  sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _restore_args(abstract_state):
  """Restore args with the target's shape and sharding but the *saved* dtype, so dtypes can be checked."""
  target = jax.tree.map(_restore_target, abstract_state)
  args = ocp.checkpoint_utils.construct_restore_args(target)
  args = jax.tree.map(lambda a: dataclasses.replace(a, dtype=None), args,
                      is_leaf=lambda a: isinstance(a, ocp.RestoreArgs))
  return target, args


def _check_against(restored, abstract_state) -> None:
  """Raises `_Invalid` naming the first leaf whose shape or dtype differs from the target."""
  got = jax.tree_util.tree_flatten_with_path(restored)[0]
  want = jax.tree.leaves(abstract_state)
  if len(got) != len(want):
    raise _Invalid(f"tree has {len(got)} leaves, target has {len(want)}")
  for (path, g), w in zip(got, want):
    name = jax.tree_util.keystr(path)
    if tuple(g.shape) != tuple(w.shape):
      raise _Invalid(f"shape mismatch at {name}: saved {tuple(g.shape)}, target {tuple(w.shape)}")
    # Canonicalised so that a numpy int64 leaf matches its jax.eval_shape (int32 without x64).
    if jax.dtypes.canonicalize_dtype(g.dtype) != jax.dtypes.canonicalize_dtype(w.dtype):
      raise _Invalid(f"dtype mismatch at {name}: saved {g.dtype}, target {w.dtype}")


def _check_integrity(restored, integrity: dict) -> None:
  """Raises `_Invalid` when the integrity record is unusable or a leaf's checksum differs."""
  if not isinstance(integrity, dict) or integrity.get("format") != FORMAT_VERSION:
    raise _Invalid(f"integrity record missing or of unknown format: {str(integrity)[:80]}")
  saved = integrity.get("checksums")
  got = state_checksums(restored)
  if not isinstance(saved, list) or len(saved) != len(got):
    raise _Invalid("integrity record does not match the number of state leaves")
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(restored)[0]]
  for name, s, g in zip(paths, saved, got):
    if list(s) != g:
      raise _Invalid(f"checksum mismatch at {name} (array data corrupted)")


@dataclasses.dataclass(frozen=True)
class _Unscored:
  """A checkpoint as a preservation policy sees it, without metrics."""
  step: int
  metrics: None
  time: Any


@dataclasses.dataclass
class _BestEvaluated:
  """Orbax's BestN over the steps whose metrics hold `metric`. Steps that were not evaluated are saved with
  empty metrics (Orbax warns at every save without metrics once a best_fn is set) and, like steps saved
  before that, never count as best."""
  metric: str
  best: Any

  def should_preserve(self, checkpoints, *, context):
    scored = [c if isinstance(c.metrics, dict) and self.metric in c.metrics else _Unscored(c.step, None, c.time)
              for c in checkpoints]
    return self.best.should_preserve(scored, context=context)


def _retention(keep: int | None, best_metric: str | None, best_mode: str, keep_best: int):
  """Keeps a step if it is among the `keep` newest or the `keep_best` best by `metrics[best_metric]`.

  Steps saved without that metric (not evaluated, e.g. a SIGTERM save) never count as best.
  """
  policies = [preservation_lib.LatestN(n=keep)]
  if best_metric is not None:
    best = preservation_lib.BestN(get_metric_fn=lambda m: m[best_metric], reverse=best_mode == "min",
                                  n=keep_best, keep_checkpoints_without_metrics=False)
    policies.append(_BestEvaluated(best_metric, best))
  return preservation_lib.AnyPreservationPolicy(policies)


def _best_fn(best_metric: str, best_mode: str):
  """Orbax's `best_fn` (it ranks steps for `best_step`): a step without the metric ranks last."""
  worst = -np.inf if best_mode == "max" else np.inf
  return lambda m: m.get(best_metric, worst) if isinstance(m, dict) else worst


# ----------------------------------------------------------------------------------------------
# The shell: one CheckpointManager per run directory.


def _save_failure(directory: str, e: Exception) -> str:
  """The reason a save failed, one line; names the step folders that are symbolic links (Orbax cannot
  delete them when `keep` retires them)."""
  why = f"{type(e).__name__}: {' '.join(str(e).split())}"
  try:
    links = sorted(n for n in os.listdir(directory) if n.isdigit() and os.path.islink(os.path.join(directory, n)))
  except OSError:
    links = []
  if links and isinstance(e, OSError):
    why += (f"; step folder(s) {', '.join(os.path.join(directory, n) for n in links)} are symbolic links, which "
            "Orbax cannot delete when checkpoint.keep retires them: replace them by copies of their targets")
  return why


class Checkpointer:
  """A thin wrapper over `orbax.checkpoint.CheckpointManager` for one run directory.

  Args:
    directory: where step directories `<directory>/<step>` live (created if absent).
    keep: how many of the most recent checkpoints to keep (None: all).
    best_metric: a key of the `metrics` passed to `save`; when set, the `keep_best` best checkpoints by it
      are also kept (a checkpoint is deleted only when it is neither recent enough nor best enough).
    best_mode: "max" or "min".
    keep_best: how many best checkpoints to keep.
    async_save: Orbax async checkpointing (save returns after the device-to-host copy). Off by default so
      that tests and resumes are deterministic.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3, best_metric: str | None = None,
               best_mode: str = "max", keep_best: int = 1, async_save: bool = False):
    if best_mode not in ("max", "min"):
      raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be >= 1 or None, got {keep}")
    self.directory = os.path.abspath(os.fspath(directory))
    self._best_metric = best_metric
    self.mismatched: list[tuple[int, str]] = []  # (step, reason) of steps that did not fit the last target
    options = ocp.CheckpointManagerOptions(
        # best_fn only makes Orbax write the metrics; retention is the explicit policy below.
        best_fn=_best_fn(best_metric, best_mode) if best_metric else None,
        best_mode=best_mode,
        preservation_policy=_retention(keep, best_metric, best_mode, keep_best),
        enable_async_checkpointing=async_save,
        create=True)
    self._quarantine_unreadable_metrics()
    self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
    self._last_saved: int | None = None  # the newest step handed to Orbax (its write may finish in the background)
    self._committed: int | None = None  # the newest step seen on disk after a `wait`

  def _quarantine_unreadable_metrics(self) -> None:
    """Orbax reads every step's metrics when the manager is built and raises on a corrupt file, so a
    step whose metrics are unreadable is reported and moved aside before that (like any bad step)."""
    if not os.path.isdir(self.directory):
      return
    for name in sorted(os.listdir(self.directory)):
      path = os.path.join(self.directory, name, "metrics", "metrics")
      if not (name.isdigit() and os.path.isfile(path)):
        continue
      try:
        with open(path) as f:
          json.load(f)
      except (ValueError, OSError) as e:
        self._skip(int(name), os.path.join(self.directory, name), f"unreadable metrics ({type(e).__name__})", True)

  def all_steps(self) -> list[int]:
    """Committed steps on disk (not validated), ascending."""
    return sorted(self._mngr.all_steps())

  def save(self, step: int, state, meta: dict, metrics: dict | None = None, force: bool = False) -> bool:
    """Saves `state` (array pytree) and `meta` (JSON) as checkpoint `step`; returns whether it saved.

    A step already on disk is not rewritten (returns False): e.g. a SIGTERM save right after the cadence
    save of the same step. `force` saves even when Orbax's save policy would skip the step.
    `metrics` (name -> number) is required for best-checkpoint retention to consider this step.
    """
    step = int(step)
    if step in self._mngr.all_steps():
      return False
    integrity = {"format": FORMAT_VERSION, "jaxrl_llm_version": jaxrl_llm.__version__,
                 "checksums": state_checksums(state), "tree": tree_signature(state)}
    args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta),
                              integrity=ocp.args.JsonSave(integrity))
    if metrics is not None:
      metrics = {k: float(v) for k, v in metrics.items()}
    elif self._best_metric is not None:
      metrics = {}  # not evaluated: an empty record, not None (see `_BestEvaluated`)
    try:
      saved = bool(self._mngr.save(step, args=args, metrics=metrics, force=force))
    except Exception as e:  # noqa: BLE001 -- Orbax / TensorStore raise many types; say which step and where
      why = _save_failure(self.directory, e)
      # Orbax may raise a background write's failure only at the next save: name the step that failed.
      prev = self._last_saved
      failed = prev if prev is not None and prev != self._committed and prev not in self._mngr.all_steps() else step
      raise RunError(f"checkpoint step {failed} in {self.directory}: cannot save ({why})") from e
    if saved:
      self._last_saved = step
    return saved

  def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
    """Restores checkpoint `step` into `abstract_state`'s structure, shapes, dtypes and shardings.

    Raises ValueError with the reason when the step is corrupt or does not match the target.
    """
    self._mngr.wait_until_finished()
    try:
      return self._restore_checked(int(step), abstract_state)
    except (_Invalid, _Mismatch) as e:
      raise ValueError(f"checkpoint step {step} in {self.directory}: {e}") from None

  def latest_valid(self, abstract_state, *, quarantine: bool = True) -> tuple[int, Any, dict] | None:
    """(step, state, meta) of the newest checkpoint that passes every check, or None when there is none.

    `abstract_state` is the live state or `jax.eval_shape` of its initialiser (ShapeDtypeStructs; those
    without a sharding go to the first local device), or a function `meta -> abstract_state` called with
    each candidate step's meta before its arrays are read (it may raise `MetaError`: the step is then
    treated as corrupt; any other exception propagates, e.g. a refusal to resume). Each skipped step gets
    a `CheckpointWarning` naming the step and the reason; with `quarantine` (default) a corrupt or
    partial one is moved to `<directory>/quarantine/` so the resumed run can write that step again (if
    the move fails, the step is left in place and the search goes on). Steps that are intact but do not
    fit `abstract_state` are never moved: they are listed in `self.mismatched`. Pass `quarantine=False`
    to inspect a directory read-only.
    """
    self._mngr.wait_until_finished()
    self.mismatched = []
    for name in sorted(os.listdir(self.directory)):
      match = _TMP_STEP_RE.match(name)
      if match:
        self._skip(int(match.group(1)), os.path.join(self.directory, name),
                   "partial save (uncommitted Orbax tmp directory)", quarantine)
    found = None
    for step in sorted(self._mngr.all_steps(), reverse=True):
      try:
        state, meta = self._restore_checked(step, abstract_state)
      except _Invalid as e:
        self._skip(step, os.path.join(self.directory, str(step)), str(e), quarantine)
        continue
      except _Mismatch as e:
        self.mismatched.append((step, str(e)))
        self._skip(step, os.path.join(self.directory, str(step)), f"does not fit this state: {e}", False)
        continue
      found = (step, state, meta)
      break
    if quarantine:
      self._mngr.reload()
    return found

  def wait(self) -> None:
    """Blocks until an async save has been committed."""
    self._mngr.wait_until_finished()
    if self._last_saved is not None and self._last_saved in self._mngr.all_steps():
      self._committed = self._last_saved

  def close(self) -> None:
    """Waits for pending saves and releases Orbax resources."""
    self._mngr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- internals --------------------------------------------------------------------------------

  def _restore_checked(self, step: int, abstract_state) -> tuple[Any, dict]:
    step_dir = os.path.join(self.directory, str(step))
    try:
      with open(os.path.join(step_dir, "_CHECKPOINT_METADATA")) as f:
        json.load(f)
    except (OSError, ValueError) as e:
      raise _Invalid(f"missing or unreadable step metadata: {type(e).__name__}: {e}") from None
    try:  # the JSON items first: the target may depend on meta, and the tree signature is in integrity
      js = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(),
                                                            integrity=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 -- any failure to read a step means this step is unusable
      raise _Invalid(f"restore failed: {type(e).__name__}: {str(e)[:300]}") from None
    if js["meta"] is None or js["integrity"] is None:
      raise _Invalid("missing meta or integrity item")
    if not isinstance(js["meta"], dict) or not isinstance(js["integrity"], dict):
      raise _Invalid("meta or integrity item is not a JSON object")
    if callable(abstract_state):
      try:
        abstract_state = abstract_state(js["meta"])
      except MetaError as e:
        raise _Invalid(f"unusable meta: {e}") from None
    diff = _signature_diff(js["integrity"].get("tree"), tree_signature(abstract_state))
    if diff:
      raise _Mismatch(diff)
    target, restore_args = _restore_args(abstract_state)
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args))
    try:
      out = self._mngr.restore(step, args=args)
    except Exception as e:  # noqa: BLE001 -- any failure to read a step means this step is unusable
      raise _Invalid(f"restore failed: {type(e).__name__}: {str(e)[:300]}") from None
    _check_against(out["state"], abstract_state)
    _check_integrity(out["state"], js["integrity"])
    return out["state"], js["meta"]

  def _skip(self, step: int, path: str, reason: str, quarantine: bool) -> None:
    where = ""
    if quarantine and jax.process_index() == 0:
      dest = os.path.join(self.directory, _QUARANTINE, f"{os.path.basename(path)}-{time.time_ns()}")
      try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.move(path, dest)
        where = f"; moved to {dest}"
      except OSError as e:  # unreadable / read-only directory: report, leave it, fall back to older steps
        where = f"; could not move it aside ({type(e).__name__}: {e}), left in place"
    warnings.warn(f"checkpoint step {step} in {self.directory} skipped: {reason}{where}", CheckpointWarning,
                  stacklevel=3)
