"""`harness`: an agent harness plays episodes against the run's own OpenAI-compatible endpoint (`jaxrl_llm.serve`).

The source starts the endpoint (uvicorn on 127.0.0.1, a free port; the batcher samples at the newest published
version) and the async engine (`async_engine.AsyncRollout`: admission keeps every consumed lag ≤ η = `rollout.lag`,
as in `async`). A request is one GRPO group: G episodes of one seed (`async_engine.episode_seed`), each the
harness `serve.harness = "module:function"` called as `fn(base_url, episode_id, seed, **serve.harness_kwargs)` in
its own thread; the `max(1, serve.concurrency // G)` worker threads run that many groups at once. An episode ends
when the harness reports its reward (`POST /v1/episodes/{id}/reward`) and becomes one row (`serve.recorder.episode_row`: the
prompt's first `serve.prompt_width` ids in the P columns, the rest of the `serve.max_context` after them; μ's
log-probs and each token's version as served). π_old at each token's version as async episodes do
(`async_engine.prox_at_versions` with `rollout.prox_in_worker`, else the learner's recompute).

A harness that raises, overruns `serve.timeout_s`, never reports a reward, or whose episode does not fit the row
costs its episode only: the row keeps no tokens (mask 0) and the group's mean reward (so it moves no advantage).
`serve.sandbox=True` runs each episode's harness in a process of its own (`envs.sandbox`: `serve.sandbox_cpu_s`,
`serve.sandbox_memory_mb`, wall clock `serve.timeout_s`, sockets only to the endpoint, no new processes, a scratch
working directory): an overrun is killed, not left behind as a thread, and a stopped one counts `serve_killed`
(a wall overrun `serve_timeouts`). The harness must then be a module-level function (its module is imported again
in each episode's process); one with an attribute `unsandboxable` (a reason) is refused with it.

Metrics (each batch): `serve_episodes`, `serve_failed` (of which `serve_errors`, `serve_timeouts`, `serve_no_reward`,
`serve_too_long`, `serve_killed`, `serve_invalid`), `serve_split` (episodes whose calls did not extend each other,
packed one segment per call), `serve_batch_mean` / `serve_batch_max` (requests per sampler call since the previous
batch), `serve_calls` (calls served since then), `serve_slot_resumes` (of those, the ones that continued a parked
slot's keys/values, with `rollout.slots`), `serve_slot_steps` (the slot engine's slot-steps since then),
speculative decoding's `spec_accept_rate` / `spec_tokens_per_call` over those calls (the slot engine's: over the
run), `gen_kv_bits` (the sampler's cache format), plus async's `async_*` counters.

An episode with a chat call whose messages do not form a valid conversation (a tool message answering no tool
call, tool calls left unanswered: `serve.chat.conversation_error`; that call gets a 400) is dropped, counted
`serve_invalid`. Every episode's timeline (its calls in order with route, version, token counts, finish reason, tool
calls served and tool results carried, then its reward or why it is invalid; `t` in seconds after it opened) goes to
`timeline.jsonl` beside the metrics, one line per episode with the step that consumed it.

Checkpoint state is minimal: the request-id cursor (the seed counter) only. Episodes in flight or buffered at a
checkpoint are not saved; a resumed run starts new requests after the cursor.

Over several processes every process serves an endpoint of its own (on its host) to harnesses of its own, from its
replica of the snapshot, and plays its share of each batch (`prompts_per_step / processes` groups; process p takes
request ids p, p + n, ...), as async workers do; the learner's batch is the processes' batches joined in process
order (`asynchronous.merge_processes`), and the checkpoint holds every process's cursor (resumed on as many).
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
import uuid

import jax
import numpy as np

from jaxrl_llm import multiprocess
from jaxrl_llm.models.cache import window_record
from jaxrl_llm.record import Rollout, from_plain, to_plain
from jaxrl_llm.rollout import async_engine as ae
from jaxrl_llm.rollout import turn_sampler
from jaxrl_llm.rollout.buffer import collate, group_record, lag
from jaxrl_llm.rollout.settings import RolloutSettings
from jaxrl_llm.rollout.sources.asynchronous import merge_processes
from jaxrl_llm.rollout.sources.base import register
from jaxrl_llm.sampling import behavior
from jaxrl_llm.tasks.reward import interrupt_thread

FAIL_KINDS = ("errors", "timeouts", "no_reward", "too_long", "killed", "invalid")


def _bucket(n: int, cap: int) -> int:
  """Rows of a sampler call for n requests: the next power of two, at most `cap` (few compiled shapes)."""
  return min(cap, 1 << max(0, n - 1).bit_length())


def make_sample_fn(gen, width: int, max_tokens: int, max_batch: int, topk: int = 20):
  """The endpoint's sampler (`serve.batcher.SampleFn`): `turn_sampler.Reprefill` over prompts left-padded to
  `width`, at most `max_tokens` new tokens, the run's temperature / top-k / top-p (μ is the training distribution).
  Its rows are padded (copies of the first) to a power-of-two bucket; μ's `topk` most likely ids are recorded only when
  a request asks for top log-probs (the sampled tokens are the same either way). With `gen.slots` > 0 a call's rows go
  through the slot engine (`turn_sampler.SlotTurns`: row i draws with its own key, `fold_in(key, i)`), so one long
  completion stops holding every row of the call; a finished row's keys/values stay in its slot
  (`SlotTurns(resident=True, keyed=False)`), and a later request whose context shares at least half its prefix with
  them (a conversation's next call: its last call's messages and reply, then the tool's or user's answer; or a call
  with the same prompt as another's) continues that slot instead of prefilling the whole conversation; rows are
  not padded there."""
  turns = (turn_sampler.SlotTurns(gen, width, gen.slots, gen.slot_chunk, resident=True, keyed=False)
           if getattr(gen, "slots", 0) else turn_sampler.Reprefill(gen, width))
  base = dataclasses.replace(gen.sampler_cfg, max_new_tokens=max_tokens, group_size=1)
  train_k = base.behavior_topk  # μ's top-k the learner reads (`sampler.behavior_topk`)
  keep_routes = getattr(gen, "keep_routes", False)

  def sample(params, version: int, contexts, key, top_logprobs: int = 0) -> dict:
    n = len(contexts)
    # a static batch is padded to few shapes; the slot engine admits any number of rows (it buckets its admissions),
    # and a pad row there would be one more request decoded
    rows = list(contexts) + [contexts[0]] * (0 if isinstance(turns, turn_sampler.SlotTurns) else
                                             _bucket(n, max(max_batch, n)) - n)
    # a call asking for top log-probs records μ's top-k (speculating or not: the verify step records it too)
    cfg = dataclasses.replace(base, behavior_topk=max(topk, train_k)) if top_logprobs else base
    out = turns.turn(params, version, list(range(len(rows))), rows, key, cfg)
    got = {k: np.asarray(v)[:n] for k, v in out.items() if k in (
        "tokens_BN", "lengths_B", "behavior_logp_BN", "behavior_topk_ids_BNk", "behavior_topk_logp_BNk")}
    # what the learner reads of each call: μ's records (top-k: the best train_k) and, MoE, the routes by position
    got["records"] = {k: np.asarray(out[k])[:n, :, :train_k] if "topk" in k else np.asarray(out[k])[:n]
                      for k in (behavior.TOPK_FIELDS if train_k else ()) + behavior.MC_FIELDS if k in out}
    if keep_routes and "routes_BXLk" in out:
      got["routes_BXLk"] = np.asarray(out["routes_BXLk"])[:n]
    return got

  sample.turns = turns  # its counters (prefills, with slots resumed)
  return sample


def load_harness(spec: str):
  """The callable of "module:function"; a module that does not import, or no such callable, is a `ConfigError`
  naming `config.serve.harness`."""
  from jaxrl_llm.config import ConfigError  # noqa: PLC0415
  module, _, name = spec.partition(":")
  try:
    mod = importlib.import_module(module)
  except Exception as e:  # noqa: BLE001 -- the harness module is user code: anything can go wrong importing it
    raise ConfigError(f"config.serve.harness={spec!r}: cannot import {module!r} "
                      f"({type(e).__name__}: {' '.join(str(e).split())})") from e
  fn = getattr(mod, name, None)
  if not callable(fn):
    raise ConfigError(f"config.serve.harness={spec!r}: {module} has no callable {name!r}")
  return fn


def play(harness, base_url: str, episode_ids: list[str], seed: int, timeout_s: float,
         sandbox=None, kwargs: dict | None = None) -> list[str | None]:
  """Runs `harness(base_url, episode_id, seed, **kwargs)` for each id in its own thread; per episode None (it
  returned) or "errors" (it raised) / "timeouts" (still running `timeout_s` after the start: left behind as a daemon thread, its
  later calls and reward get a 408 once the episode is closed). Returns within `timeout_s` (one deadline for all the
  threads). `sandbox` (`envs.sandbox.Limits`): each thread runs its harness in a sandboxed process instead, killed at
  `sandbox.wall_s`; "killed" when a limit other than the wall clock stopped it."""
  status: list[str | None] = ["timeouts"] * len(episode_ids)
  if sandbox is not None:
    from urllib.parse import urlsplit  # noqa: PLC0415
    from jaxrl_llm.envs import sandbox as sandbox_lib  # noqa: PLC0415
    where = urlsplit(base_url)
    endpoint = ((where.hostname, where.port),)

  def one(i: int) -> None:
    try:
      if sandbox is None:
        harness(base_url, episode_ids[i], seed, **(kwargs or {}))
        status[i] = None
        return
      _, ok, violation = sandbox_lib.call(harness, kwargs or {}, sandbox, args=(base_url, episode_ids[i], seed),
                                          allow=endpoint)
      status[i] = (None if ok else "errors" if violation is None else "timeouts" if violation == "wall"
                   else "killed")
    except BaseException:  # pylint: disable=broad-except  # a failing harness costs its episode only
      status[i] = "errors"

  threads = [threading.Thread(target=one, args=(i,), name=f"harness-{e}", daemon=True)
             for i, e in enumerate(episode_ids)]
  for t in threads:
    t.start()
  deadline = time.monotonic() + timeout_s
  for t in threads:  # sandboxed: the child is killed at timeout_s; a little longer lets its thread report that
    t.join(max(0.0, deadline + (5.0 if sandbox is not None else 0.0) - time.monotonic()))
  out = list(status)
  for t in threads:  # left behind; one spinning in Python code would starve the process of the GIL: stopped there
    if t.is_alive() and t.ident is not None:
      interrupt_thread(t.ident)
  return out


def row_extras(gen, P: int, N: int) -> dict:
  """What every harness row carries beyond its tokens, as `episode_row` names it: {name: (shape, dtype, fill)} of
  μ's records the learner reads (the record's names, `sampler.behavior_topk` / `sampler.mc_samples`) and, for an MoE
  sampler whose routes are replayed, `routes_TLk` (fill: experts 0..k-1, as an unfed column). A row without one (a
  failed episode) holds the fill, so every group carries the same fields and none is dropped when groups are joined
  (`record.concat`)."""
  sc, out = gen.sampler_cfg, {}
  for (ids, logp), count in ((behavior.TOPK_FIELDS, sc.behavior_topk), (behavior.MC_FIELDS, sc.mc_samples)):
    if count:
      out[ids], out[logp] = ((N, count), np.int32, sc.pad_id), ((N, count), np.float32, 0)
  if getattr(gen, "keep_routes", False):
    L, k = gen.model_cfg.n_layers, gen.model_cfg.experts_per_token
    out["routes_TLk"] = ((P + N, L, k), np.int32, np.arange(k, dtype=np.int32))
  return out


def group_from_episodes(episodes, status: list[str | None], P: int, N: int, pad_id: int, version: int,
                        extras: dict | None = None, kv_window: tuple[int, int] | None = None) -> Rollout:
  """The G episodes of a request as one group of rows; failed ones (by `status`, a missing reward, or too long
  for the row) keep no tokens, take the mean reward of the others and the admitted `version` (held by the store
  while the group may be consumed). `status` is updated in place. `extras` (`row_extras`): the fields every row
  carries beyond its tokens; `kv_window`: the sampler's (sinks, window) of a window cache, recorded per row."""
  from jaxrl_llm.serve.recorder import TooLong, episode_row  # noqa: PLC0415  (keeps `sources` free of the extra)
  rows = []
  for i, ep in enumerate(episodes):
    row = None
    if status[i] is None and ep is not None and ep.invalid is not None:
      status[i] = "invalid"
    if status[i] is None and (ep is None or ep.reward is None or not ep.calls):
      status[i] = "no_reward"
    if status[i] is None:
      try:
        row = episode_row(ep.calls, P, N, pad_id)
      except TooLong:
        status[i] = "too_long"
    rows.append(row)
  ok = [ep.reward for ep, r in zip(episodes, rows) if r is not None]
  fill = float(np.mean(ok)) if ok else 0.0
  empty = {"sequence_T": np.full(P + N, pad_id, np.int32), "positions_T": np.zeros(P + N, np.int32),
           "segment_ids_T": np.zeros(P + N, np.int32), "mask_N": np.zeros(N, np.float32),
           "behavior_logp_N": np.zeros(N, np.float32), "versions_N": np.full(N, version, np.int32),
           "env_mask_N": np.zeros(N, np.float32), "split": False}
  full = [r if r is not None else empty for r in rows]
  stack = lambda k: np.stack([r[k] for r in full])
  fields = {}
  for name, (shape, dtype, default) in (extras or {}).items():  # a row without one (failed) holds the default
    fields["routes_BTLk" if name == "routes_TLk" else name] = np.stack(
        [np.asarray(r[name], dtype) if name in r else np.broadcast_to(np.asarray(default, dtype), shape) for r in full])
  fields.update(window_record(kv_window, len(full)))
  G = len(episodes)
  stats = {"serve_episodes": G, "serve_failed": sum(s is not None for s in status),
           "serve_split": sum(bool(r["split"]) for r in rows if r is not None),
           **{f"serve_{k}": sum(s == k for s in status) for k in FAIL_KINDS},
           "timeline": [{"episode": getattr(ep, "id", None), "status": status[i] or "ok",
                         "reward": getattr(ep, "reward", None), "invalid": getattr(ep, "invalid", None),
                         "events": list(getattr(ep, "events", []))} for i, ep in enumerate(episodes)]}
  return Rollout(sequence_BT=stack("sequence_T"), positions_BT=stack("positions_T"),
                 segment_ids_BT=stack("segment_ids_T"), mask_BN=stack("mask_N"),
                 behavior_logp_BN=stack("behavior_logp_N"), versions_BN=stack("versions_N"),
                 reward_B=np.asarray([ep.reward if r is not None else fill for ep, r in zip(episodes, rows)],
                                     np.float32),
                 group_B=np.zeros(G, np.int32), env_mask_BN=stack("env_mask_N"), **fields, stats=stats)


def make_harness_rollout(gen, service, harness, s, *, group_size: int, store=None, score_fn=None) -> ae.RolloutFn:
  """`rollout_fn(snapshot, request_id) -> Rollout` for `AsyncRollout`: G harness episodes of the request's seed
  against `service` (a started `serve.service.Service`), as one group (`group_from_episodes`). The admitted
  snapshot is the group's start version: every call is served at it or a newer one."""
  pad = gen.encoder.tokenizer.pad_id
  P, N = s.prompt_width, s.max_context - s.prompt_width
  extras = row_extras(gen, P, N)

  def rollout(snap, request_id: int) -> Rollout:
    seed = ae.episode_seed(gen.seed, request_id)
    ids = [f"r{request_id}-g{g}-{uuid.uuid4().hex[:8]}" for g in range(group_size)]
    for e in ids:
      service.recorder.open(e)
    status = play(harness, service.base_url, ids, seed, s.timeout_s, s.sandbox, s.harness_kwargs)
    episodes = [service.recorder.pop(e, expired=st in ("timeouts", "killed")) for e, st in zip(ids, status)]
    group = group_from_episodes(episodes, status, P, N, pad, snap.version, extras, gen.sampler_cfg.kv_window_arg)
    if score_fn is not None:
      group = group.replace(prox_logp_BN=ae.prox_at_versions(score_fn, store, snap, group))
    return group_record(group, request_id=request_id, example_id=seed, start_version=snap.version)

  return rollout


@register("harness")
class Harness:
  """The harness source (module docstring)."""

  on_policy = False
  per_process_workers = True  # several processes: each serves its own endpoint from its own replica

  @staticmethod
  def retention(s: RolloutSettings) -> int:
    return s.lag + 1

  def __init__(self, ctx, store):
    self.ctx, self.store = ctx, store
    self.s = ctx.settings.serve
    if self.s is None:
      raise ValueError('rollout.mode="harness" needs the serve settings (config.serve)')
    self.harness = load_harness(self.s.harness)
    if self.s.sandbox is not None:
      from jaxrl_llm.config import ConfigError  # noqa: PLC0415
      from jaxrl_llm.envs.sandbox import importable  # noqa: PLC0415
      why = getattr(self.harness, "unsandboxable", "")  # a harness that cannot run sandboxed says why
      if why:
        raise ConfigError(f"config.serve.sandbox=True: the harness {self.s.harness!r} cannot run sandboxed ({why})")
      try:
        importable(self.harness)
      except ValueError as e:
        raise ConfigError(f"config.serve.harness={self.s.harness!r}: serve.sandbox=True: {e}") from None
    self.service = None
    self.engine: ae.AsyncRollout | None = None
    self.next_request_id = jax.process_index()  # several processes: ids p, p + n, ...
    self._sizes_seen = 0  # batcher calls already reported
    self._resumes_seen = self._slot_steps_seen = 0  # calls that continued a parked slot, slot-steps: reported
    self._spec_seen = 0  # speculating calls already reported (static batches)

  def _start(self) -> None:
    from jaxrl_llm.serve.service import Service  # noqa: PLC0415  (the `serve` extra)
    st = self.ctx.settings
    from jaxrl_llm.serve.batcher import TOPK  # noqa: PLC0415
    sample_fn = self.sample_fn = make_sample_fn(self.ctx.gen, self.s.max_context, self.s.max_tokens,
                                                self.s.max_batch, TOPK)
    self.service = Service.start(self.ctx.gen, self.store, self.s, sample_fn=sample_fn, params_of=ae.worker_params)
    score_fn = self.ctx.score if st.old_logp == "recompute" and st.prox_in_worker else None
    fn = make_harness_rollout(self.ctx.gen, self.service, self.harness, self.s, group_size=st.group_size,
                              store=self.store, score_fn=score_fn)
    n_proc = jax.process_count()  # config validation: divides prompts_per_step
    self.engine = ae.AsyncRollout(self.store, fn, batch_groups=st.prompts_per_step // n_proc, eta=st.lag,
                                  num_workers=max(1, self.s.concurrency // st.group_size),
                                  next_request_id=self.next_request_id, id_stride=n_proc).start()

  def next_batch(self, step: int, version: int) -> Rollout:
    del step
    if self.engine is None:
      self._start()
    groups, st = self.engine.next_batch(version, timeout=max(600.0, 4 * self.s.timeout_s))
    sizes = self.service.batcher.sizes[self._sizes_seen:]
    self._sizes_seen += len(sizes)
    turns = self.sample_fn.turns
    resumed = getattr(turns, "resumed", 0)  # a counter the batcher's thread advances
    resumes, self._resumes_seen = resumed - self._resumes_seen, resumed
    slot_steps = getattr(turns, "slot_steps", 0)
    slot_steps, self._slot_steps_seen = slot_steps - self._slot_steps_seen, slot_steps
    calls = list(turns.spec)  # speculation: Reprefill's calls so far (the batcher's thread appends), or the engine's
    spec = calls[self._spec_seen:] if isinstance(turns, turn_sampler.Reprefill) else calls
    self._spec_seen = len(calls)
    gen_stats = {**({k: float(np.mean([d[k] for d in spec])) for k in spec[0]} if spec else {}),
                 **({} if turns.kv_bits is None else {"gen_kv_bits": turns.kv_bits})}
    counts = {k: sum(int(g.stat(k)) for g in groups) for k in
              ("serve_episodes", "serve_failed", "serve_split", *(f"serve_{k}" for k in FAIL_KINDS))}
    ro = collate(groups, version).with_stats(
        **counts, serve_batch_mean=float(np.mean(sizes)) if sizes else 0.0,
        serve_batch_max=int(max(sizes, default=0)), serve_calls=int(sum(sizes)), serve_slot_resumes=resumes,
        serve_slot_steps=slot_steps, **gen_stats,
        time_learner_idle_s=st["time_learner_idle_s"], async_dropped_stale=st["dropped_stale"],
        async_buffered=st["buffered"], async_running=st["running"],
        async_lag_hist=np.bincount([lag(g, version) for g in groups], minlength=self.ctx.settings.lag + 1).tolist(),
        request_ids=sorted({int(g.stat("request_id")) for g in groups}),
        timeline=[{"request_id": int(g.stat("request_id")), **e} for g in groups for e in g.stat("timeline", [])])
    if not multiprocess.multi():
      return ro
    return merge_processes([from_plain(p) for p in multiprocess.allgather_host(to_plain(ro))])

  def state(self) -> dict:
    """The request-id cursor only (module docstring): episodes in flight are not saved. Several processes: every
    process's cursor."""
    cursor = self.engine.state()["next_request_id"] if self.engine is not None else self.next_request_id
    if multiprocess.multi():
      return {"processes": multiprocess.allgather_host({"next_request_id": int(cursor)})}
    return {"next_request_id": int(cursor)}

  def restore(self, state: dict | None) -> None:
    self.close()
    state = state or {}
    n_proc = jax.process_count()
    saved = len(state["processes"]) if "processes" in state else 1
    if state and saved != n_proc:
      raise ValueError(f"the harness state was saved by {saved} process(es) and this run has {n_proc}: a harness run "
                       "resumes on the number of processes that wrote its checkpoint")
    mine = state["processes"][jax.process_index()] if "processes" in state else state
    self.next_request_id = int(mine.get("next_request_id", jax.process_index()))

  def close(self) -> None:
    """Stops the endpoint first (a harness still playing then fails fast), then the worker threads: each returns
    within `serve.timeout_s` (`play`); one still running after twice that is left behind (a daemon thread), so a
    harness that never returns cannot fail the run's exit."""
    if self.service is not None:
      self.service.close()
      self.service = None
    if self.engine is not None:
      self.next_request_id = self.engine.state()["next_request_id"]
      try:
        self.engine.stop(timeout=max(60.0, 2 * self.s.timeout_s), abandon=True)
      finally:
        self.engine = None
