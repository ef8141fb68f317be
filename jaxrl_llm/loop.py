"""The run: SFT warm start, then learner steps fed by pinned-version rollouts, one uniform loop for every mode.

Run modes (DESIGN §3) are batch sources (`jaxrl_llm.rollout.sources`, one file each: sync, fixed_lag,
staged, replay, async). `run` validates, sets up (`jaxrl_llm.wiring`), resumes or starts fresh
(`jaxrl_llm.run_state`), picks the source and runs one step loop: batch (`source.next_batch`, a
`record.Rollout`) → learner batch (`jaxrl_llm.batch`) → train → publish → log → checkpoint (with the
source's plain-data `state()`).

Several processes (one per host, `python -m jaxrl_llm` on each) run this same loop on the same host-side
data; `jaxrl_llm.multiprocess` says which process generates and scores which rows, what is gathered and
agreed on (stop signals, timings), and that process 0 alone writes the run's files.

Randomness is derived, never shared: init from the root, the sampler key from (root, behaviour
version, step or request id), the learner key `fold_in(root, step)`. In sync / fixed_lag / staged modes a
resumed run writes the same metrics as an uninterrupted one (wall-clock `time_*` fields excepted).

Workdir safety (`jaxrl_llm.workdir`): one run owns a workdir (lock file); `metrics.jsonl` is never
deleted: a resume truncates it past the resumed step; a fresh start moves an old one aside.
"""

from __future__ import annotations

import json
import os
import time

import jax
import ml_collections
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import metrics as metrics_lib, multiprocess, packing, preemption, run_state
from jaxrl_llm import workdir as workdir_lib
from jaxrl_llm.batch import make_batch, prox_is_current, prox_logp  # noqa: F401 (re-exported)
from jaxrl_llm.episode_eval import evaluate_run
from jaxrl_llm.errors import RunError  # noqa: F401 (re-exported)
from jaxrl_llm.keys import fold_in
from jaxrl_llm.models import lora
from jaxrl_llm.record import Rollout, sampler_metrics
from jaxrl_llm.rollout import sources
from jaxrl_llm.rollout.ewma import ewma_update
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.sampling import generate
# Re-exported: experiments, notebooks and tests set runs up through `loop.setup` & co.
from jaxrl_llm.wiring import (Run, encoder_from_config, evaluate, fresh_state, new_store, prompt_width,  # noqa: F401
                              reward_policy, sampler_config, sampler_replicas, setup)


def run(c: ml_collections.ConfigDict, workdir: str, on_step=None) -> list[dict]:
  """Runs (or resumes) the configured job; returns the metric rows this call wrote.

  `on_step(row, store)`, if given, is called on the host after every learner step (soak tests and
  notebooks observe the run without adding non-deterministic fields to the metrics stream).
  Raises `RunError` (one-line message) when the workdir cannot be used or is owned by another run, the
  checkpoint's config differs (see the module docstring), `optim.max_skips` consecutive updates were
  non-finite (after writing that step's row and a checkpoint), or every update of the call was skipped.
  SIGTERM and SIGINT save a checkpoint at the end of the current step and return
  (`run_info.json` records `stopped_by_signal`).
  """
  config_lib.validate(c)
  workdir = workdir_lib.prepare(workdir)
  lock = workdir_lib.acquire(workdir) if multiprocess.is_writer() else None  # several processes: process 0's
  try:
    return _run(c, workdir, on_step)
  finally:
    if lock is not None:
      workdir_lib.release(lock)


def _run(c: ml_collections.ConfigDict, workdir: str, on_step) -> list[dict]:
  r = setup(c)
  compiled_before = _compiled(r)
  store = new_store(r)
  slots = sources.retention(r.ctx.settings)
  config_json = json.loads(c.to_json_best_effort())  # the resolved config, stored with every checkpoint
  ckpt, restored = run_state.resume_point(c, workdir, r, store, slots, config_json)
  start, state, extra, meta, host = restored or run_state.fresh_start(c, r, store, workdir)
  if r.drafter is not None:  # the sampler drafts with the distilled drafter's (restored) parameters
    r.ctx.gen.drafter.params = sampler_drafter(r, r.drafter.sampler_params(extra["drafter"]))
  writes = multiprocess.is_writer()  # process 0 writes the run's files; every process checkpoints
  if restored is not None and writes:
    for name in ("metrics.jsonl", metrics_lib.TIMELINE):
      metrics_lib.truncate_after(os.path.join(workdir, name), start - 1)
  if writes:
    with open(os.path.join(workdir, "config.json"), "w") as f:  # after the resume check: never the old run's
      f.write(c.to_json_best_effort(indent=2, sort_keys=True))
  name = sources.pick(r.ctx.settings)
  source = _open_source(r, store, name, run_state.source_state(name, meta, host),
                        f"checkpoint step {start} in {ckpt.directory}")
  extras_state = getattr(r.batch_extras, "state", None)  # distillation options with state (ADWIN, Open-MOPD)
  if extras_state is not None and host.get("distill") is not None:
    r.batch_extras.restore(host["distill"])
  if r.ctx.scaffold is not None:  # Pats' evidence cards: a resumed run shows the cards the uninterrupted one would
    r.ctx.scaffold.restore(host.get("scaffold"))
  meta = {**{k_: v for k_, v in meta.items() if k_ not in ("host", "host_sizes", "stage_version")}, "config": config_json}

  writer = metrics_lib.MetricsWriter(workdir, tensorboard=c.log.tensorboard) if writes else multiprocess.NullWriter()
  flag = preemption.install_sigterm_handler(sigint=True) if _main_thread() else None
  rows: list[dict] = []
  failure = None  # optim.max_skips reached: the message; the row and a checkpoint are written first
  bar = _progress_bar(c, start)
  try:
    for t in range(start, c.num_steps):
      t_step = time.perf_counter()
      if r.ctx.gen.budget is not None:  # the batch extras' cap on this step's new tokens (ADWIN's horizon)
        r.ctx.gen.budget.max_new_tokens = r.batch_extras.generation_budget(t)
      ro = source.next_batch(t, store.latest_version)
      state, m, info = _learn(r, store, state, extra, ro, t)
      if m.get("refresh_buffer", 0) > 0 and hasattr(source, "flush"):  # the loss asks for fresher rollouts (f-OPD)
        info["refresh_flushed"] = source.flush()
      failure = _skip_failure(c, m, t)
      row = _row(r, store, state, t, ro, m, info)
      row["time_step_s"] = time.perf_counter() - t_step
      row = multiprocess.reduce_times(row)  # several processes: the slowest one's timings; the rest agrees already
      writer.write(row)
      writer.timeline(t, ro.stat("timeline", []))  # the harness's episodes, event by event (timeline.jsonl)
      rows.append(row)
      if on_step is not None:
        on_step(row, store)
      if bar is not None:
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.2f}", eval=row.get("eval_accuracy", ""))
      preempted = multiprocess.agree_stop(flag)  # a signal on any process stops all after this step
      stop = preempted or failure is not None
      if stop or (c.checkpoint.every > 0 and (t + 1) % c.checkpoint.every == 0) or (
          t + 1 == c.num_steps and c.checkpoint.final):
        best = {"eval_accuracy": row["eval_accuracy"]} if "eval_accuracy" in row else None  # keep-N + best
        # the source's state (buffered groups, ids, counters): a resumed run samples what this one would
        run_state.save(ckpt, t + 1, state, store, extra, slots, meta,
                       {"source": {"name": name, "state": source.state()},
                        **({"distill": extras_state()} if extras_state is not None else {}),
                        **({"scaffold": r.ctx.scaffold.state()} if r.ctx.scaffold is not None else {})},
                       force=stop, metrics=best)
        if preempted:
          print(f"preempted (signal {flag.signum}): checkpoint saved at step {t + 1}; exiting", flush=True)
        if stop:
          break
  finally:
    source.close()
    if bar is not None:
      bar.close()
    writer.close()
    ckpt.close()
    if flag is not None:
      flag.uninstall()
  _write_run_info(c, r, store, workdir, meta, start, rows, flag, failure, compiled_before)
  return rows


def _open_source(r: Run, store: ParamStore, name: str, state, where: str):
  """The run's batch source `name`, continuing from `state` (plain data) when there is one."""
  source = sources.get(name)(r.ctx, store)
  if state is not None:
    try:
      source.restore(state)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
      raise RunError(f"{where}: unusable {name} source state ({type(e).__name__}: {e})") from None
  return source


def pack_batch(c, batch: Rollout, ro: Rollout, batch_sharding=None) -> tuple[Rollout, float]:
  """(the learner's batch, its fraction of padding token slots): packed into rows of `optim.pack_width` when on
  (`jaxrl_llm.packing`; one packing per micro-batch of every minibatch; on a mesh, `batch_sharding`, a row count
  its batch axes divide), else the padded batch as it is. Evicted episodes (`env.evict`) are packed even with
  `optim.pack_width=0`, one row each at the width their rows take once each later segment's copy of the first
  message is left out (`packing.compact_width`), where the loss allows packing (`config.packing_refusal`)."""
  width = config_lib.read(c, "optim.pack_width")
  P = ro.sequence_BT.shape[1] - ro.mask_BN.shape[1]  # an evicted episode's first message is packed once
  chunks = c.optim.grad_accum * config_lib.read(c, "optim.minibatches")
  rows = 0
  if not width and config_lib.evicting(c) and config_lib.packing_refusal(c) is None:
    width, rows = packing.compact_width(ro.sequence_BT, ro.positions_BT, ro.segment_ids_BT, P,
                                        batch.routes_BTLk), ro.sequence_BT.shape[0] // chunks
    width = 0 if width == ro.sequence_BT.shape[1] else width  # no copy to leave out: the padded rows
  if not width:
    return batch, packing.pad_frac(ro.segment_ids_BT)
  shards = 1
  if batch_sharding is not None:  # devices along the batch axes: the mesh size over the spec's leading axes
    axes = batch_sharding.spec[0] if len(batch_sharding.spec) else None
    for ax in (() if axes is None else (axes,) if isinstance(axes, str) else axes):
      shards *= batch_sharding.mesh.shape[ax]
  pk = packing.pack(ro.sequence_BT, ro.positions_BT, ro.segment_ids_BT, width, chunks, shards,
                    routes_BTLk=batch.routes_BTLk, prompt_len=P, rows=rows)  # MoE: routes travel with their tokens
  return batch.replace(pack=jax.tree.map(jax.numpy.asarray, pk)), packing.pad_frac(pk.segment_ids_RW)


def _learn(r: Run, store: ParamStore, state, extra: dict, ro: Rollout, t: int):
  """batch → train → publish: learner step `t` on rollout `ro`; publishes the new version (and updates the
  EWMA copy) unless the update was skipped as non-finite; distils a distilled speculative drafter on `ro`.
  Returns (state, step metrics, batch info)."""
  batch, info = make_batch(r, store, state, extra, ro)
  batch, info["learner_pad_frac"] = pack_batch(r.c, batch, ro, r.batch_sharding)
  if batch.pack is not None and batch.pack.share_RW is not None:  # the copies of first messages left out
    info["learner_copies_skipped"] = packing.skipped_tokens(batch.pack, ro.segment_ids_BT)
  if r.mesh is not None:  # the step's explicit in_shardings: lay the batch out along `batch`
    batch = jax.device_put(batch, r.batch_sharding)
  t_train = time.perf_counter()
  ref = () if extra["ref"] is None else (extra["ref"],)
  state, m = r.train_step(state, batch, fold_in(r.k_learn, t), *ref)
  m = metrics_lib.to_python(m)  # blocks on the step
  n_tok = float(np.asarray(ro.mask_BN).sum())
  info["time_learner_tokens_per_s"] = n_tok / max(time.perf_counter() - t_train, 1e-9)
  if ro.stat("time_generate_s"):
    info["time_sampler_tokens_per_s"] = ro.stat("generated_tokens", n_tok) / ro.stat("time_generate_s")
  if not m["update_skipped"]:
    if r.route_predictor is None:
      store.publish(state.params)
    else:  # PR2: the sampler routes with the routers predicted a few updates ahead
      sampler_params, info["pr2_router_shift"] = r.route_predictor(state)
      store.publish(state.params, sampler_params=sampler_params)
      info["pr2_router_shift"] = float(info["pr2_router_shift"])
    if extra["ewma"] is not None:
      extra["ewma"] = ewma_update(extra["ewma"], state.params, r.c.rollout.ewma_beta)
  if r.drafter is not None:  # distil the speculative drafter on this batch towards the new policy (ReSpec)
    t_distill = time.perf_counter()
    extra["drafter"], dm = r.drafter.update(extra["drafter"], state.params, ro)
    r.ctx.gen.drafter.params = sampler_drafter(r, r.drafter.sampler_params(extra["drafter"]))
    info.update(dm, time_drafter_distill_s=time.perf_counter() - t_distill)
  return state, m, info


def sampler_drafter(r: Run, params):
  """The distilled drafter's parameters where the sampler drafts: as they are on one device, else a copy replicated
  over the sampler's devices (its mesh, or devices of its own; the drafter is k layers, small next to the policy);
  async over several processes: this process's replica of it, as its workers run the policy's snapshots."""
  if r.sampler_mesh is None:
    return params
  from jaxrl_llm import sharding
  params = sharding.reshard(params, sharding.replicated(r.sampler_mesh))
  return multiprocess.local_view(params) if sampler_replicas(r.c) else params  # as `new_store` views the snapshots


def _skip_failure(c, m: dict, t: int) -> str | None:
  """The run's error message when `optim.max_skips` consecutive updates were non-finite, else None."""
  if not m["update_skipped"] or m["skipped_consecutive"] < c.optim.max_skips:
    return None
  return (f"optim.max_skips={c.optim.max_skips}: {m['skipped_consecutive']} consecutive non-finite updates "
          f"(last at step {t}); stopped after saving a checkpoint. Lower optim.lr, raise "
          "sampler.temperature or check the loss inputs")


# A batch's stats that become metrics: timings, and the counters of async, replay, episodes and the served endpoint.
STAT_PREFIXES = ("time_", "async_", "replay_", "env_", "serve_", "spec_", "slot_", "gen_", "echo_", "pats_")


def _row(r: Run, store: ParamStore, state, t: int, ro: Rollout, m: dict, info: dict) -> dict:
  """The metrics row of learner step `t` (without its wall time); evaluates when `eval.every` says so."""
  c = r.c
  reward_B, mask_BN, lag_B = np.asarray(ro.reward_B), np.asarray(ro.mask_BN), np.asarray(ro.lag_B)
  row = {
      "step": t, "version": store.latest_version, "behavior_version": int(np.min(ro.versions_BN)),
      "lag_mean": float(np.mean(lag_B)), "lag_max": int(np.max(lag_B)),
      "reward_mean": float(np.mean(reward_B)), "reward_std": float(np.std(reward_B)),
      "accuracy": float(np.mean(reward_B >= 1.0)), "completion_len": float(mask_BN.sum(1).mean()),
      "reward_errors": ro.stat("reward_errors"), **info, **m,
      **{k_: v for k_, v in (ro.stats or {}).items() if k_.startswith(STAT_PREFIXES)},
      **sampler_metrics(ro),  # μ's top-k and Monte-Carlo records, a window cache, MoE routes: when the batch has them
      **store.sync_metrics(),  # weight_sync="sparse": payload ratio and changed fraction of the newest publish
  }
  if ro.stat("request_ids", None) is not None:  # async: which requests the batch holds
    row["request_ids"] = ro.stat("request_ids")
  if c.eval.every > 0 and ((t + 1) % c.eval.every == 0 or t + 1 == c.num_steps):
    # eval_accuracy (+ eval_episode_* with an env: episode_eval); LoRA: merged once, not per decode step
    row.update(evaluate_run(r, lora.effective(state.params)))
  return row


def _progress_bar(c, start: int):
  if not c.log.progress or not multiprocess.is_writer():
    return None
  from tqdm import tqdm
  return tqdm(total=c.num_steps, initial=start, desc="learner steps", dynamic_ncols=True)


def _compiled(r: Run) -> dict[str, int]:
  """Compiled programs of the run's train step, sampler and scorer held by this process. The learner's builders
  return one function per static configuration (`learner._once_per_static_args`), so an earlier run in the process
  may have compiled some: run_info counts those this run added."""
  return {"train_step": r.train_step._cache_size(), "generate": generate._cache_size(), "score": r.score._cache_size()}


def _write_run_info(c, r: Run, store: ParamStore, workdir: str, meta: dict, start: int, rows: list[dict], flag,
                    failure: str | None, compiled_before: dict[str, int]) -> None:
  """Writes run_info.json; raises RunError on `failure` or when every update of this call was skipped."""
  skipped = sum(1 for row in rows if row.get("update_skipped"))
  # steps with no token to train on (every sample failed) skip their update too, but nothing was non-finite
  nonfinite = sum(1 for row in rows if row.get("update_skipped") and not row.get("updates_skipped_empty"))
  info = {"eval_accuracy_initial": meta.get("eval_accuracy_initial"),
          **{k: v for k, v in meta.items() if k.startswith("eval_episode_")},  # episode_eval, with an env
          "sft_final_loss": meta.get("sft_final_loss"),
          "time_sft_s": meta.get("time_sft_s"), "resumed_from_step": start,
          **{f"compiles_{k}": n - compiled_before[k] for k, n in _compiled(r).items()}, **store.sync_totals(),
          "prompts_dropped": r.prompts_dropped, "remat_auto": r.remat_auto,
          "updates_skipped": skipped,
          "updates_skipped_empty": sum(int(row.get("updates_skipped_empty") or 0) for row in rows),
          "reward_errors": sum(int(row.get("reward_errors") or 0) for row in rows),
          "stopped_by_signal": flag.signum if flag is not None and flag.requested else None, "error": failure}
  if failure is None and rows and nonfinite == len(rows):
    failure = (f"every update of this run ({nonfinite} of {len(rows)} learner steps) was skipped as non-finite: the "
               "policy did not change. Check optim.lr, sampler.temperature and the loss inputs (metrics.jsonl)")
    info["error"] = failure
  if multiprocess.is_writer():
    with open(os.path.join(workdir, "run_info.json"), "w") as f:
      json.dump(metrics_lib.json_safe(info), f, indent=2, allow_nan=False)
  if failure is not None:
    raise RunError(failure)


def _main_thread() -> bool:
  import threading
  return threading.current_thread() is threading.main_thread()
