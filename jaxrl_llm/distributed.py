"""Multi-host start-up: `jax.distributed` from arguments (config) or the environment.

One process per host (one per GPU, or per TPU VM worker) runs the same program; after
`maybe_initialize`, `jax.devices()` lists every device of every process and a mesh built from them
(`jaxrl_llm.sharding.make_mesh`) spans hosts. Single-process runs (no coordinator anywhere) skip it.

Sources, first found wins, per field:
  coordinator    argument, else $JAX_COORDINATOR_ADDRESS   ("host:port" of process 0)
  num_processes  argument, else $JAX_NUM_PROCESSES
  process_id     argument, else $JAX_PROCESS_ID
With `auto=True` and no coordinator, `jax.distributed.initialize()` is called without arguments and
detects the cluster itself (TPU pod slices, SLURM, Open MPI, Kubernetes).

This module only reads the environment when called: importing it has no side effects.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import jax

ENV_VARS = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
            "process_id": "JAX_PROCESS_ID"}


def settings(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
             environ=None) -> dict:
  """The resolved {coordinator, num_processes, process_id} (None where neither source gives one)."""
  environ = os.environ if environ is None else environ
  given = {"coordinator": coordinator or None, "num_processes": num_processes, "process_id": process_id}
  out = {}
  for field, value in given.items():
    if value is None and environ.get(ENV_VARS[field]):
      value = environ[ENV_VARS[field]]
      value = value if field == "coordinator" else int(value)
    out[field] = value
  if out["coordinator"] is not None and (out["num_processes"] is None or out["process_id"] is None):
    raise ValueError(f"distributed: coordinator {out['coordinator']!r} given but num_processes={out['num_processes']} "
                     f"process_id={out['process_id']}: set both (arguments or ${ENV_VARS['num_processes']}, "
                     f"${ENV_VARS['process_id']})")
  if out["num_processes"] is not None and out["process_id"] is not None and not 0 <= out["process_id"] < out["num_processes"]:
    raise ValueError(f"distributed: process_id={out['process_id']} must be in [0, num_processes={out['num_processes']})")
  return out


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                     *, auto: bool = False, cpu_collectives: str | None = None, local_device_ids=None,
                     **timeouts) -> bool:
  """Initialises `jax.distributed` when a multi-process run is configured; returns whether it is now initialised.

  Call it first thing in the program, before anything touches a device. Idempotent.

  Args:
    coordinator, num_processes, process_id: override the environment (see the module docstring).
    auto: with no coordinator anywhere, let JAX detect the cluster (TPU pods, SLURM, ...).
    cpu_collectives: e.g. "gloo": the CPU backend's cross-process collectives (CPU-only runs and
      tests; GPUs use NCCL and TPUs their ICI/DCN without this).
    local_device_ids: restrict this process to some local devices (e.g. one GPU per process).
    timeouts: `initialization_timeout`, `heartbeat_timeout_seconds` (seconds), passed through.
  """
  if jax.distributed.is_initialized():
    return True
  s = settings(coordinator, num_processes, process_id)
  if s["coordinator"] is None and not auto:
    return False
  if s["num_processes"] == 1 and not auto:
    return False  # one process: nothing to coordinate
  if cpu_collectives:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  # Unset fields (None) are detected by JAX itself (TPU slice, SLURM, ...) when no coordinator is given.
  jax.distributed.initialize(s["coordinator"], s["num_processes"], s["process_id"], local_device_ids=local_device_ids,
                             **timeouts)
  return True


def is_coordinator() -> bool:
  """True on process 0: the one that writes metrics, plots and logs (every process saves checkpoints)."""
  return jax.process_index() == 0


def detected_cluster() -> str | None:
  """The cluster environment `jax.distributed.initialize()` would detect on its own (Cloud TPU VM slice,
  SLURM job step, Open MPI, Kubernetes), by JAX's own detectors; None outside one (or if JAX moved them)."""
  try:
    from jax._src import clusters  # private: the detectors `initialize()` itself runs
    for env in clusters.ClusterEnv._cluster_types:
      if not getattr(env, "opt_in_only_method", False) and env.is_env_present():
        return env.__name__
  except Exception:  # noqa: BLE001 -- no detector: a plain single-process run
    return None
  return None


def initialize_from_config(c) -> bool:
  """`jax.distributed` from `config.dist` (else the environment, else a detected cluster, else one process).

  Call it before anything touches a device (the CLI does, first thing). Raises `ConfigError` naming the
  `config.dist.*` field for inconsistent settings and `RunError` when this process cannot join the run
  (coordinator unreachable, peers never connect within `dist.initialization_timeout`). With more than one
  process it starts the peer watchdog (`start_watchdog`). Returns whether `jax.distributed` is initialised.
  """
  from jaxrl_llm import config as config_lib
  from jaxrl_llm.errors import RunError
  config_lib.validate_dist(c)
  get = lambda f: config_lib.read(c, f"dist.{f}")  # an absent section or field: its default
  s = _settings_or_config_error(get)
  cluster = detected_cluster() if s["coordinator"] is None else None
  if s["coordinator"] is None and cluster is None:
    if s["num_processes"] not in (None, 1):
      raise config_lib.ConfigError(f"config.dist.coordinator_address=None: config.dist.num_processes="
                                   f"{s['num_processes']} processes need the 'host:port' of process 0 (or "
                                   f"${ENV_VARS['coordinator']}); no TPU / SLURM / MPI cluster was detected")
    return False
  timeouts = {"initialization_timeout": get("initialization_timeout"),
              "heartbeat_timeout_seconds": get("heartbeat_timeout_seconds")}
  where = (f"config.dist.coordinator_address={s['coordinator']!r}" if s["coordinator"] else
           f"the detected {cluster} cluster")
  try:
    up = maybe_initialize(s["coordinator"], s["num_processes"], s["process_id"], auto=cluster is not None, **timeouts)
  except Exception as e:  # noqa: BLE001 -- JAX raises several types (and XlaRuntimeError for timeouts)
    raise RunError(f"{where}: could not join the run as process {s['process_id']} of {s['num_processes']} within "
                   f"config.dist.initialization_timeout={timeouts['initialization_timeout']} s "
                   f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
  _STATE["barrier_timeout_s"] = timeouts["initialization_timeout"]
  if up and jax.process_count() > 1:
    start_watchdog(timeouts["heartbeat_timeout_seconds"] / 2)
  return up


def _settings_or_config_error(get) -> dict:
  """`settings` from `config.dist`; a rejected combination is a `ConfigError` naming the `config.dist` field."""
  from jaxrl_llm import config as config_lib
  try:
    return settings(get("coordinator_address"), get("num_processes"), get("process_id"))
  except ValueError as e:
    field = ("process_id" if "must be in" in str(e) or get("num_processes") is not None and get("process_id") is None
             else "num_processes")
    raise config_lib.ConfigError(f"config.dist.{field}={get(field)!r}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Peers: barriers with a timeout, and a watchdog that stops this process when another one is gone.
#
# A process that dies (SIGKILL, OOM, a lost host) leaves the others blocked in a collective; JAX's own
# heartbeat eventually aborts them with a C++ stack trace. The watchdog gets there first, with one line:
# every process bumps a counter in the coordination service's key-value store each second and reads the
# others'; a counter that stops moving for `timeout_s`, a peer that reported a failure
# (`report_failure`), or a coordinator that no longer answers ends this process with exit code 1.

_STATE: dict = {"watchdog": None, "barriers": 0, "barrier_timeout_s": 300}
_ALIVE, _FAILED = "jaxrl_llm/alive/", "jaxrl_llm/failed/"


def _client():
  from jax._src import distributed as jax_distributed  # private: the coordination service client
  return jax_distributed.global_state.client


def barrier(name: str, timeout_s: float | None = None) -> None:
  """Waits until every process reaches the barrier `name` (a no-op with one process); RunError after
  `timeout_s` (default `dist.initialization_timeout`). Every process must call the same barriers in order."""
  if jax.process_count() == 1:
    return
  from jaxrl_llm.errors import RunError
  _STATE["barriers"] += 1
  timeout_s = _STATE["barrier_timeout_s"] if timeout_s is None else timeout_s
  try:
    _client().wait_at_barrier(f"jaxrl_llm/{name}/{_STATE['barriers']}", int(timeout_s * 1000))
  except Exception as e:  # noqa: BLE001
    raise RunError(f"process {jax.process_index()}: the other processes did not reach {name!r} within "
                   f"{timeout_s:.0f} s ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def report_failure(message: str) -> None:
  """Tells the other processes that this one stops with `message` (their watchdogs exit at once)."""
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return
  try:
    _client().key_value_set(f"{_FAILED}{jax.process_index()}", message[:500], allow_overwrite=True)
  except Exception:  # noqa: BLE001 -- the coordinator may be gone already
    pass
  stop_watchdog(done=False)


class PeerWatchdog:
  """Background thread: exits this process (code 1, one line on stderr) when a peer is gone (see above)."""

  def __init__(self, timeout_s: float, interval_s: float = 1.0, exit_fn=None):
    self.timeout_s, self.interval_s = float(timeout_s), float(interval_s)
    self._exit = exit_fn or _exit_now
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="jaxrl_llm-peer-watchdog", daemon=True)
    self.me, self.n = jax.process_index(), jax.process_count()

  def start(self) -> "PeerWatchdog":
    self._thread.start()
    return self

  def stop(self, done: bool = True) -> None:
    """Stops the thread; `done` tells the peers that this process finished normally (no longer beats)."""
    self._stop.set()
    if self._thread.is_alive() and self._thread is not threading.current_thread():
      self._thread.join(timeout=10)
    if done:
      try:
        _client().key_value_set(f"{_ALIVE}{self.me}", "done", allow_overwrite=True)
      except Exception:  # noqa: BLE001
        pass

  def _loop(self) -> None:
    client, beat = _client(), 0
    seen = {p: (None, time.monotonic()) for p in range(self.n) if p != self.me}  # peer -> (value, since)
    while not self._stop.wait(self.interval_s):
      beat += 1
      try:
        client.key_value_set(f"{_ALIVE}{self.me}", str(beat), allow_overwrite=True)
        alive = dict(client.key_value_dir_get(_ALIVE))
        failed = dict(client.key_value_dir_get(_FAILED))
      except Exception as e:  # noqa: BLE001 -- the coordination service (on process 0) no longer answers
        if self._stop.is_set():
          return
        return self._exit(f"process {self.me} of {self.n}: lost contact with the coordinator (process 0) "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:160]})")
      message = peer_verdict(self.me, self.n, alive, failed, seen, time.monotonic(), self.timeout_s)
      if message is not None and not self._stop.is_set():
        return self._exit(message)


def peer_verdict(me: int, n: int, alive: dict, failed: dict, seen: dict, now: float, timeout_s: float) -> str | None:
  """The watchdog's decision for one poll: a one-line reason to stop this process, or None.

  `alive` / `failed`: the key-value entries under `jaxrl_llm/alive/` (a beat counter or "done") and
  `jaxrl_llm/failed/` (a peer's error line); `seen`: peer -> (last counter, when it last changed),
  updated in place. A peer that reported a failure, or whose counter has not moved for more than
  `timeout_s` (and that is not done), is the reason.
  """
  for key, msg in sorted(failed.items()):
    peer = key.rsplit("/", 1)[-1]
    if peer != str(me):
      return f"process {me} of {n}: process {peer} stopped with an error: {msg}"
  for p, (value, since) in sorted(seen.items()):
    v = alive.get(f"{_ALIVE}{p}")
    if v == "done":
      continue
    if v != value:
      seen[p] = (v, now)
    elif now - since > timeout_s:
      return (f"process {me} of {n}: process {p} stopped responding ({now - since:.0f} s without a heartbeat: "
              "killed, out of memory or its host is gone)")
  return None


_PEER_LOSS = re.compile(r"gloo|nccl|connection (reset|refused|closed)|broken pipe|peer|socket", re.IGNORECASE)


def describe_peer_loss(e: BaseException) -> str | None:
  """A one-line explanation when `e` is a collective that failed because another process is gone (gloo
  reports a closed connection at once; NCCL usually hangs instead and the watchdog reports it), else None."""
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return None
  text = " ".join(str(e).split())
  if "RuntimeError" not in type(e).__name__ or not _PEER_LOSS.search(text):
    return None
  return (f"process {jax.process_index()} of {jax.process_count()}: lost another process during a collective (it "
          f"stopped, or its host is unreachable: see its log): {type(e).__name__}: {text[:300]}; restart every "
          "process with the same command to resume from the last checkpoint")


def _exit_now(message: str) -> None:
  print(f"error: {message}; stopping this process too (restart every process with the same command to "
        "resume from the last checkpoint)", file=sys.stderr, flush=True)
  os._exit(1)


def start_watchdog(timeout_s: float) -> PeerWatchdog:
  """Starts the process-wide `PeerWatchdog` (once)."""
  if _STATE["watchdog"] is None:
    _STATE["watchdog"] = PeerWatchdog(timeout_s).start()
  return _STATE["watchdog"]


def stop_watchdog(done: bool = True) -> None:
  """Stops the watchdog before a normal exit (`done`: peers stop waiting for this process's heartbeats)."""
  w, _STATE["watchdog"] = _STATE["watchdog"], None
  if w is not None:
    w.stop(done)
