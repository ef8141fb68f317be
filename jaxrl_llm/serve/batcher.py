"""The request batcher: concurrent calls share one sampler call at one pinned policy version.

HTTP handlers `submit(prompt_ids, max_tokens, top_logprobs)` and wait on the returned future. One sampler
thread takes what is pending (up to `max_batch` requests, waiting at most `window_s` for more after the first),
pins the newest published snapshot for the whole call (`acquire` / `release`), samples every prompt together
with `sample_fn`, and answers each request with its completion ids (up to and including a stop id), μ's
log-probs, the finish reason ("stop": a stop id was drawn; "length": the request's `max_tokens` ran out) and the
version. Served batch sizes are counted (`stats`: `serve_batch_mean`, `serve_batch_max`, `serve_calls`).

The run's `sample_fn` is `rollout.sources.harness.make_sample_fn` (`rollout.turn_sampler.Reprefill`: prompts
left-padded to one width, `sampling.generate`), no decode loop of its own. Tests pass their own `sample_fn` or hold
the thread (`hold`). Nothing here imports `jaxrl_llm.rollout` (the harness source imports this package).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Callable, Sequence

import numpy as np

from jaxrl_llm.keys import fold_in

TOPK = 20  # OpenAI's largest `top_logprobs`: a batch that asks for any records μ's top 20

# sample_fn(params, version, contexts, key, top_logprobs) -> {tokens_BN, lengths_B, behavior_logp_BN[,
# behavior_topk_ids_BNk, behavior_topk_logp_BNk][, records][, routes_BXLk]} as host numpy, one row per context:
# `records` what the learner reads of μ per token ({record name: [B, N, ...]}, `sampling.behavior`), `routes_BXLk`
# an MoE sampler's expert ids by context position (the prompt's, then the completion's).
SampleFn = Callable[..., dict]


@dataclasses.dataclass
class Completion:
  """One served completion: ids (stop id included when drawn), log μ of each, why it ended, the version."""
  ids: list[int]
  logprobs: list[float]
  finish_reason: str
  version: int
  top: list[list[tuple[int, float]]] | None = None  # per token: μ's most likely (id, log-prob), best first
  records: dict | None = None  # per token: μ's records the learner reads ({name: [len(ids), ...]})
  routes: np.ndarray | None = None  # MoE: [len(prompt) + len(ids), L, k] expert ids by position (routing replay)


@dataclasses.dataclass
class _Request:
  prompt_ids: list[int]
  max_tokens: int
  top_logprobs: int
  future: concurrent.futures.Future


class Batcher:
  """The queue and the sampler thread (module docstring).

  Args:
    sample_fn: `SampleFn` (e.g. `make_sample_fn`).
    acquire / release: pin and unpin the newest snapshot (`ParamStore.acquire` / `release`); a snapshot has
      `version` and the parameters `params_of(snapshot)` gives.
    key: the root of the sampling keys (call c of version v draws with fold_in(fold_in(key, v), c)).
    stop_ids: the ids that end a completion ("stop"); max_batch: requests per sampler call at most;
    window_s: how long to wait for more after the first.
  """

  def __init__(self, sample_fn: SampleFn, acquire: Callable, release: Callable, params_of: Callable, key, *,
               stop_ids: Sequence[int] = (), max_batch: int = 8, window_s: float = 0.01):
    self.stop_ids = frozenset(int(t) for t in stop_ids)
    self.sample_fn, self.acquire, self.release, self.params_of = sample_fn, acquire, release, params_of
    self.key, self.max_batch, self.window_s = key, max_batch, window_s
    self._queue: queue.Queue[_Request | None] = queue.Queue()
    self._open = threading.Event()  # cleared by `hold`: the thread takes nothing until `resume`
    self._open.set()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._lock = threading.Lock()
    self.sizes: list[int] = []  # requests per served sampler call
    self._unserved = 0  # submitted, not yet handed to the sampler
    self.calls = 0

  def start(self) -> "Batcher":
    self._thread = threading.Thread(target=self._run, name="serve-batcher", daemon=True)
    self._thread.start()
    return self

  def close(self, timeout: float = 30.0) -> None:
    """Stops the thread after its current call; requests still queued fail with RuntimeError."""
    self._stop.set()
    self._open.set()
    self._queue.put(None)
    if self._thread is not None:
      self._thread.join(timeout)
    while True:
      try:
        r = self._queue.get_nowait()
      except queue.Empty:
        break
      if r is not None and not r.future.done():
        r.future.set_exception(RuntimeError("the server is shutting down"))

  def hold(self) -> None:
    """Let requests queue up without serving them (tests: a batch of known size, independent of timing)."""
    self._open.clear()

  def resume(self) -> None:
    self._open.set()

  def pending(self) -> int:
    """Requests submitted and not yet handed to the sampler (queued, or taken while held)."""
    with self._lock:
      return self._unserved

  def submit(self, prompt_ids: Sequence[int], max_tokens: int, top_logprobs: int = 0) -> concurrent.futures.Future:
    """Queues one request; the future's result is a `Completion` (or the sampler's exception)."""
    if self._stop.is_set():
      raise RuntimeError("the server is shutting down")
    fut: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      self._unserved += 1
    self._queue.put(_Request(list(map(int, prompt_ids)), int(max_tokens), int(top_logprobs), fut))
    return fut

  def stats(self) -> dict:
    """`serve_batch_mean` / `serve_batch_max` (requests per sampler call so far) and `serve_calls`."""
    with self._lock:
      sizes = list(self.sizes)
    return {"serve_batch_mean": float(np.mean(sizes)) if sizes else 0.0,
            "serve_batch_max": int(max(sizes, default=0)), "serve_calls": int(sum(sizes))}

  def _take(self) -> list[_Request]:
    """The next batch: blocks for a first request, then takes what arrives within the window (at most max_batch)."""
    first = self._queue.get()
    if first is None:
      return []
    self._open.wait()  # held: the first request waits here with the rest queued behind it
    batch, deadline = [first], time.monotonic() + self.window_s
    while len(batch) < self.max_batch:
      try:
        r = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        break
      if r is None:
        self._queue.put(None)  # keep the stop marker for the loop
        break
      batch.append(r)
    return batch

  def _run(self) -> None:
    while not self._stop.is_set():
      batch = self._take()
      if batch and not self._stop.is_set():
        self._serve(batch)
      else:
        for r in batch:
          r.future.set_exception(RuntimeError("the server is shutting down"))

  def _serve(self, batch: list[_Request]) -> None:
    with self._lock:
      self._unserved -= len(batch)
    try:
      snap = self.acquire()
      try:
        version = int(snap.version)
        key = fold_in(fold_in(self.key, version), self.calls)
        self.calls += 1
        out = self.sample_fn(self.params_of(snap), version, [r.prompt_ids for r in batch], key,
                             max(r.top_logprobs for r in batch))
      finally:
        self.release(snap)
    except BaseException as e:  # pylint: disable=broad-except  # each waiting request gets the error
      for r in batch:
        r.future.set_exception(e)
      return
    with self._lock:
      self.sizes.append(len(batch))
    for i, r in enumerate(batch):
      r.future.set_result(_completion(out, i, r, version, self.stop_ids))


def _completion(out: dict, i: int, r: _Request, version: int, stop_ids: frozenset) -> Completion:
  """Row i of a sampler output as the completion of request r, cut at its `max_tokens`: "stop" when its last
  token is a stop id, else "length"."""
  k = min(int(out["lengths_B"][i]), r.max_tokens)
  ids = [int(t) for t in out["tokens_BN"][i, :k]]
  logp = [float(x) for x in out["behavior_logp_BN"][i, :k]]
  top = None
  if r.top_logprobs and "behavior_topk_ids_BNk" in out:
    ids_k, lp_k = out["behavior_topk_ids_BNk"][i], out["behavior_topk_logp_BNk"][i]
    top = [[(int(ids_k[t, j]), float(lp_k[t, j])) for j in range(r.top_logprobs)] for t in range(k)]
  records = {name: np.array(a[i, :k]) for name, a in out["records"].items()} if out.get("records") else None
  routes = np.array(out["routes_BXLk"][i, :len(r.prompt_ids) + k]) if "routes_BXLk" in out else None
  return Completion(ids, logp, "stop" if ids and ids[-1] in stop_ids else "length", version, top, records, routes)
