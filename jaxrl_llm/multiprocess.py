"""The loop over several processes (one per host): who generates and scores which rows, what is gathered,
what is agreed on, who writes.

Every process runs the same loop on the same host-side data, so every decision (prompts, advantages,
versions, when to checkpoint, when to stop) is taken identically everywhere without a controller:

  generate   one SPMD program on the global mesh, the prompts laid out along the mesh's batch axes
             (`generate_on_mesh`): each process's devices decode that process's rows. The sampled tokens
             do not depend on the number of processes (the sampler's noise is drawn for the global
             [B, V] shape; threefry is partitionable), so 2 processes x 4 devices decode exactly what
             1 process x 8 devices decodes with the same mesh.
  gather     the decoded arrays are all-gathered to every process (`to_host`; small next to a learner
             step: B x T tokens, masks, log-probs)
  score      each process runs the reward functions of the rows it owns (`row_owners`: the lowest
             process whose devices hold the row) and the rewards and error counts are all-gathered
             (`score_rows`): rewards run on the host that generated the sample, once per sample
  learn      the learner's batch is put onto the mesh from these identical host values (each process
             transfers only its own shards: `jax.device_put` of identical values, the equivalent of
             `jax.make_array_from_process_local_data` here)
  agree      a stop signal on any process stops every process after the same step (`agree_stop`);
             wall-clock fields are reduced (slowest process) so the row is identical everywhere
             (`reduce_times`); process 0 alone writes metrics.jsonl, run_info.json, config.json, plots
             (`is_writer`, `NullWriter`); every process takes part in Orbax saves and restores.

With one process every function here is the plain single-process behaviour (no collective).
"""

from __future__ import annotations

import zlib

import jax
import numpy as np

from jaxrl_llm.errors import RunError

STATUS_KEYS = ("ok", "error", "timeout")  # the reward call counts of `collect.score_completions`


def multi() -> bool:
  """Whether this run spans several processes."""
  return jax.process_count() > 1


def is_writer() -> bool:
  """Process 0 writes the run's files (metrics, run info, config, plots, TensorBoard, exports)."""
  return jax.process_index() == 0


class NullWriter:
  """The `metrics.MetricsWriter` of processes other than 0: writes nothing."""

  def write(self, row) -> None:
    del row

  def timeline(self, step, entries) -> None:
    del step, entries

  def close(self) -> None:
    pass


def _allgather(x: np.ndarray) -> np.ndarray:
  """[process_count, *x.shape]: every process's `x` (same shape everywhere), in process order."""
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))


def row_owners(sharding, n: int) -> np.ndarray:
  """int[n]: for each row of an [n, ...] array laid out by `sharding`, the lowest process holding it.

  Computed from the global device map alone (no communication), so every process knows every owner.
  """
  owner_n = np.full((n,), np.iinfo(np.int32).max, np.int32)
  for device, index in sharding.devices_indices_map((n,)).items():
    rows = np.arange(n)[index[0]]
    owner_n[rows] = np.minimum(owner_n[rows], device.process_index)
  return owner_n


def to_host(tree):
  """Every leaf as a full numpy array on this process (all-gathered when it spans processes)."""
  leaves, treedef = jax.tree.flatten(tree)
  spread = [i for i, x in enumerate(leaves)
            if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated]
  out = [np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) and not x.is_fully_addressable else x
         for x in leaves]
  if spread:
    from jax.experimental import multihost_utils
    got = multihost_utils.process_allgather([leaves[i] for i in spread], tiled=True)
    for i, g in zip(spread, got):
      out[i] = g
  return jax.tree.unflatten(treedef, [np.asarray(x) for x in out])


def generate_on_mesh(generate, params, tokens_BP: np.ndarray, len_B: np.ndarray, key, model_cfg, sampler_cfg,
                     mesh=None) -> tuple[dict, np.ndarray | None]:
  """`generate(...)` as full host arrays, and the `row_owners` of the rows (None without a mesh).

  With a mesh the prompts are laid out along its batch axes (`sharding.SAMPLER`), so each device decodes
  its rows; a batch the axes do not divide stays replicated (every device decodes it, nothing is lost).
  """
  if mesh is None:
    return jax.tree.map(np.asarray, generate(params, tokens_BP, len_B, key, model_cfg, sampler_cfg)), None
  from jaxrl_llm import sharding
  sh = sharding.batch_sharding(mesh, sharding.SAMPLER, tokens_BP.shape[0])
  toks, lens = sharding.put_global((np.asarray(tokens_BP), np.asarray(len_B)), sh)
  return to_host(generate(params, toks, lens, key, model_cfg, sampler_cfg)), row_owners(sh, tokens_BP.shape[0])


def my_rows(n_rows: int) -> np.ndarray:
  """The rows this process decodes when every process runs an engine of its own (continuous batching): an equal,
  contiguous share, in process order (all rows with one process)."""
  n_proc, me = jax.process_count(), jax.process_index()
  if n_rows % n_proc:
    raise ValueError(f"{n_rows} rows cannot be shared equally by {n_proc} processes")
  per = n_rows // n_proc
  return np.arange(me * per, (me + 1) * per)


def score_rows(score, examples: list, tokens_BN: np.ndarray, owners: np.ndarray | None) -> tuple[np.ndarray, dict]:
  """(reward_B, {ok, error, timeout} counts) of all rows, each scored once, by the process that owns it.

  `score(examples, tokens_BN) -> (reward_B, counts)` runs on this process's rows only; the rewards and
  counts of the others arrive by all-gather. `owners` None (one process, no mesh): every row is local.
  """
  if owners is None or not multi():
    return score(examples, tokens_BN)
  me, n_proc = jax.process_index(), jax.process_count()
  mine = np.flatnonzero(owners == me)
  reward, counts = score([examples[i] for i in mine], tokens_BN[mine]) if len(mine) else (np.zeros((0,), np.float32), {})
  width = int(np.bincount(owners, minlength=n_proc).max())
  pad = np.zeros((width + len(STATUS_KEYS),), np.float32)
  pad[:len(mine)] = reward
  pad[width:] = [counts.get(k, 0) for k in STATUS_KEYS]
  got = _allgather(pad)
  reward_B = np.zeros(owners.shape, np.float32)
  for p in range(n_proc):
    rows = np.flatnonzero(owners == p)
    reward_B[rows] = got[p, :len(rows)]
  total = got[:, width:].sum(0)
  return reward_B, {k: int(round(float(v))) for k, v in zip(STATUS_KEYS, total)}


def agree_stop(flag) -> bool:
  """Whether any process was asked to stop (SIGTERM / SIGINT / `flag.request`); the same answer on every
  process, so all save the same step and stop together. The signal of the lowest such process is
  recorded in every process's `flag` (None: no signal handler on this thread; it still takes part)."""
  mine = flag is not None and flag.requested
  if not multi():
    return mine
  got = _allgather(np.array([flag.signum if mine else -1], np.int32))[:, 0]
  asked = [int(s) for s in got if s >= 0]
  if asked and flag is not None and not flag.requested:
    flag.request(asked[0])
  return bool(asked)


def reduce_times(row: dict) -> dict:
  """`row` with its wall-clock fields reduced over processes (`time_*_per_s`: the slowest, i.e. min;
  other `time_*`: max), so process 0 writes the run's (slowest process's) timings. Every other field
  is computed from gathered data and is already the same everywhere."""
  if not multi():
    return row
  keys = sorted(k for k, v in row.items() if k.startswith("time_") and isinstance(v, (int, float)))
  names = zlib.crc32(",".join(keys).encode()) % (1 << 24)  # exact in float32
  got = _allgather(np.array([row[k] for k in keys] + [names], np.float32))
  if not np.all(got[:, -1] == names):
    raise RunError(f"step {row.get('step')}: the processes report different time fields ({keys}): they no "
                   "longer run the same loop")
  out = dict(row)
  for i, k in enumerate(keys):
    out[k] = float(got[:, i].min() if k.endswith("_per_s") else got[:, i].max())
  return out


# ---------------------------------------------------------------------------------------------
# Async over several processes: each process runs its own rollout workers on its own devices, so
# nothing a worker thread runs may span processes (a collective started off the lockstep main
# thread would pair with an unrelated program on the other host). The main thread alone moves
# snapshots and batches between processes, at points every process reaches in the same order.


def split_devices(devices, n_last: int) -> tuple[list, list]:
  """(first, last): the last `n_last` devices of every process (by id within the process) and the rest,
  each in the order of `devices`. With one process: `devices[:-n_last]`, `devices[-n_last:]`."""
  local: dict[int, list] = {}
  for d in devices:
    local.setdefault(d.process_index, []).append(d)
  last = {d for ds in local.values() for d in sorted(ds, key=lambda d: d.id)[len(ds) - n_last:]} if n_last else set()
  return [d for d in devices if d not in last], [d for d in devices if d in last]


def local_view(tree):
  """Leaves that are global arrays replicated over devices of several processes (the async sampler's
  snapshot) as arrays over this process's devices alone: the same buffers, no copy. A program on these
  is one process's own (no collective), which is what a rollout worker thread may run."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    shards = x.addressable_shards
    if any(s.data.shape != x.shape for s in shards):
      raise ValueError(f"local_view: an array of shape {x.shape} is split over processes ({x.sharding}); "
                       "the sampler's snapshot must be replicated")
    mesh = Mesh(np.array([s.device for s in shards]), ("data",))
    return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, PartitionSpec()),
                                                    [s.data for s in shards])
  return jax.tree.map(one, tree)


def allgather_host(obj) -> list:
  """Every process's `obj` (plain data: what `checkpoint.pack_host` takes), in process order; [obj] with
  one process. Sent as a JSON skeleton plus raw array bytes: nothing is unpickled."""
  if not multi():
    return [obj]
  import json

  from jaxrl_llm import checkpoint
  skeleton, arrays = checkpoint.pack_host(obj)
  names = sorted(arrays)
  head = json.dumps({"skeleton": skeleton, "sizes": {k: int(arrays[k].shape[0]) for k in names}}).encode()
  blob = np.concatenate([np.frombuffer(np.array([len(head)], "<i8").tobytes(), np.uint8),
                         np.frombuffer(head, np.uint8)] + [np.frombuffer(np.ascontiguousarray(arrays[k]).tobytes(), np.uint8)
                                                           for k in names])
  sizes = _allgather(np.array([blob.size], np.int64))[:, 0]
  padded = np.zeros((int(sizes.max()),), np.uint8)
  padded[:blob.size] = blob
  out = []
  for p, raw in enumerate(_allgather(padded)):
    raw = raw[:sizes[p]].tobytes()
    n_head = int(np.frombuffer(raw[:8], "<i8")[0])
    head = json.loads(raw[8:8 + n_head])
    flat, off = {}, 8 + n_head
    for k in sorted(head["sizes"]):
      dt = np.dtype(k)
      n = head["sizes"][k] * dt.itemsize
      flat[k] = np.frombuffer(raw[off:off + n], dt).copy()
      off += n
    out.append(checkpoint.unpack_host(head["skeleton"], flat))
  return out
