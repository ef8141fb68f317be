"""Multi-turn episodes: a policy playing text environments (`jaxrl_llm.envs`), packed as one `Rollout`.

`run_episodes` plays n seeds × G episodes (a GRPO group of G rows per seed: the G environments start
from one state) for up to `max_turns` turns with pinned parameters:

- every turn samples at most `turn_tokens` tokens (key `fold_in(key, turn)`) after each episode so far
  (initial prompt + response so far), through `rollout.turn_sampler`: with `rollout.slots` > 0 (`gen.slots`; on
  a mesh its slots split over the batch axes) by continuous batching (`SlotTurns`): each episode's turn is one
  request to a slot engine, a slot freed by a short turn refilled with the next request (episode b's turn t draws
  with `fold_in(fold_in(fold_in(key, t), b), n)`, so slots change a seed's samples), with `kv_cache` the episode's
  keys/values resident in its slot between turns;
  else by default (`kv_cache`; one process, over its sampler mesh if any) each episode's KV cache is kept across
  turns and a turn prefills only the appended observation; else (or over several processes) every turn re-prefills
  the episode left-padded to one width
  W = P + N (N = `max_episode_tokens`, the response budget) with `sampling.generate`;
- turn barrier: the turn samplers play turn-synchronously (`_play_turns`: every live episode samples turn t,
  then the environments step together). With slots and no `poll` (the synchronous sources) there is no barrier
  (`_play_refill`, cross-turn refill): after each decode chunk the episodes whose turn ended step their
  environments (together, between chunks) and each still-live one queues its next turn at once, while the others'
  turns decode on. Each episode's events keep their order and its keys do not depend on the others, so the
  record equals the turn-synchronous one (tested), `keep_turns` included; only the slot counters differ. With a
  `poll` (async episodes) slots stay turn-synchronous: a turn's version is the one polled before it;
- the policy's tokens are copied into the episode exactly as sampled (never decoded and re-encoded), up
  to and including the stop id; the action text given to the environment is their decoded text
  without the stop id (`tasks.tokenizer.completion_text`);
- the first prompt is `encoder.episode_prompt_ids(reset result, tools=env.tools)` (a str or system/user
  messages; the environment's optional `tools` schemas go to the chat template or a system block);
- the environment's observation (a str or user/tool messages) is rendered to ids by `render_env_message`
  (`encoder.observation_ids`: with a chat template, the template's delta after the policy's turn, closed
  by the end-of-turn id when the turn was cut before a stop id) and appended (not after the last step of
  a finished episode, nor after the last allowed turn: nothing follows it);
- a finished episode generates no more tokens: each turn's sampler call holds the live episodes only,
  padded to a power-of-two batch (at most log2(B) + 1 batch shapes are compiled; pad rows are dropped).

The record: sequence = [left-padded initial prompt (width P) | response (width N)], the response
compact (policy and environment tokens in order, padding only at the end), so positions and segments
are exactly what the sampler saw at every turn and the learner's recomputed log-probs equal
`behavior_logp_BN` (same parameters, dtype and temperature). `mask_BN` is 1 on policy tokens,
`env_mask_BN` 1 on environment tokens, both 0 on padding; `turn_BN` the turn index of each token
(-1 on padding; an observation belongs to the turn whose action it answers); `reward_B` the
episode's return (sum of step rewards).

Every environment call (`reset`, `step`, `close`) runs under the time limit of rewards (`tasks.reward`, on its
worker threads; an overrunning call that runs Python code is interrupted there): an environment that raises ("error"), overruns `timeout_s` ("timeout") or rejects the
action (`envs.InvalidAction`, "invalid") ends that episode with return 0, counted in the stats; the
batch still forms. Episodes that hit the token budget end "truncated" (return so far); an episode whose first
message is longer than the prompt width P is "too_long" (return 0, no tokens: it never starts). The stats:
`episode_status` (counts by status), `episode_statuses`, `episode_turns` and `episode_info` (per row: status, turns,
summed step counters), `env_episodes`, `env_turns` (total) and
`env_turns_mean`, `env_policy_tokens`, `env_tokens`, `env_done`, `env_max_turns`, `env_truncated`,
`env_too_long`, `env_errors`,
`env_timeouts`, `env_invalid`, `env_version_span_max` (the most versions one episode's policy tokens span, minus
one), `env_prefills` (sampler prefills: one per turn, per call with the kept KV cache, per admission batch with
slots), with slots `env_slot_steps` and `env_live_steps` (slot-steps decoded / those of an unfinished turn: the
share 1 - live/slot was wasted on free or finished slots) and `env_slot_resumes` (turns that continued their
episode's resident keys/values instead of a prefill), `reward_errors` (errors
+ timeouts + invalid), and `env_<key>` for each numeric key of the steps' `info` dicts (a 4-tuple step result),
summed over the batch's steps (e.g. `env_tool_calls`; a key that would shadow one of the runner's own stats is
dropped); `merge_stats` adds the counters of several records. A reset or step result of the wrong shape (an
observation that is neither a str nor a list of message dicts, an `info` that is no dict) is an "error".

Context compression (`env.evict`, `rollout.evict`): before a turn an episode whose live context exceeds
`context_budget` tokens is compressed ("drop_oldest": its oldest turns go; "summary": the policy writes a summary
that replaces them). The row then holds one segment per live context (positions from 0, a mask-0 copy of the
compressed context, then the tokens generated under it), so every token is still scored under exactly the context
it was sampled with; `extra` holds SDCC's eviction mask and teacher rows; the stats add `env_evictions`,
`env_copied_tokens`, `env_sdcc_skipped` and `evict_segment_starts`. Without eviction the record is as above.

Versions: the synchronous sources play a whole batch with one pinned snapshot. Async episodes
(`async_engine.make_episode_rollout`) pass a `poll` that offers the newest published parameters before each
turn after the first, so an episode may span versions; `versions_BN` records each token's, and π_old
(`old_logp="recompute"`) scores each token at its own version.

Several processes: in the synchronous sources the sampler call is split over the mesh's devices
(`generate_on_mesh`) but every process steps every environment; async workers play their own process's requests.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_llm import envs, multiprocess
from jaxrl_llm.keys import fold_in
from jaxrl_llm.models.cache import window_record
from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout import evict as evict_lib
from jaxrl_llm.rollout import turn_sampler
from jaxrl_llm.sampling import behavior
from jaxrl_llm.tasks.encoder import Encoder, check_messages
from jaxrl_llm.tasks.reward import safe_reward_batch
from jaxrl_llm.tasks.tokenizer import completion_text, pad_left

EPISODE_STATUSES = ("done", "max_turns", "truncated", "too_long", "error", "timeout", "invalid")


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """Config `env.*`: the environment, its arguments, and the episode limits."""
  name: str
  kwargs: tuple = ()  # (name, value) pairs passed to `envs.get`
  max_turns: int = 4
  turn_tokens: int = 4
  max_episode_tokens: int = 32
  timeout_s: float = 5.0
  workers: int = 8
  prompt_width: int = 16  # P: the initial message's bucket (left-padded)
  newest_each_turn: bool = True  # async: each turn after the first generates from the newest snapshot
  kv_cache: bool = True  # keep each episode's KV cache across turns (one process; `rollout.turn_sampler`)
  evict: str = "none"  # context compression before a turn (`rollout.evict`): "none" | "drop_oldest" | "summary"
  context_budget: int = 0  # live-context tokens above which a turn first evicts (with `evict`)
  keep_last_turns: int = 1  # turns a "drop_oldest" eviction always keeps
  summary_instruction: str = "summarize:"  # "summary": the user message appended to ask the policy for a summary


def render_env_message(encoder: Encoder, message: str | Sequence[dict], turn_ended: bool = True) -> list[int]:
  """Ids of an environment message (an observation) appended to an episode: `encoder.observation_ids`.

  Raw prompts (the character tokenizer, base models): the text's ids, no special tokens (for the
  character tokenizer, one id per character). Chat templates: the template's delta after the policy's
  turn; `turn_ended=False` (the turn was cut before a stop id) closes the turn with the end-of-turn id first.
  """
  return encoder.observation_ids(message, turn_ended=turn_ended)


def _checked_step(result: Any) -> tuple[str | list[dict], float, bool, dict]:
  """`Env.step`'s result validated: (observation, finite real, bool[, info dict]); anything else raises (an
  "error"). The observation is a str or a list of user/tool message dicts; `info` keeps its numeric values."""
  if not isinstance(result, tuple) or len(result) not in (3, 4):
    raise TypeError(f"step must return (obs, reward, done) or (obs, reward, done, info), got {result!r:.200}")
  obs, reward, done = result[:3]
  info = result[3] if len(result) == 4 else {}
  if not isinstance(obs, str):
    obs = check_messages(obs, ("user", "tool"))
  if not isinstance(reward, (numbers.Real, np.bool_)) or not math.isfinite(float(reward)):
    raise TypeError(f"step reward must be a finite number, got {reward!r}")
  if not isinstance(info, dict):
    raise TypeError(f"step info must be a dict, got {type(info).__name__}")
  counters = {str(k): v for k, v in info.items()
              if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))}
  return obs, float(reward), bool(done), counters


def env_calls(calls: Sequence[tuple], timeout_s: float, workers: int = 8) -> list[tuple[str, Any]]:
  """Runs `fn(*args)` for each `(fn, *args)` in `calls` under the reward time limit; returns
  (status, value) per call: "ok" with the result, "invalid" (`envs.InvalidAction`), "error" or "timeout"."""
  box: dict[int, tuple[str, Any]] = {}

  def one(i):
    fn, *args = calls[i]
    try:
      box[i] = ("ok", fn(*args))
    except envs.InvalidAction as e:
      box[i] = ("invalid", str(e))
    return 0.0  # the value `safe_reward_batch` validates; the real result is in `box`

  res = safe_reward_batch(one, [(i,) for i in range(len(calls))], timeout_s, max_workers=workers)
  # A call counts only when the limiter saw it finish ("ok"): a timed-out call that returns later is ignored.
  return [box[i] if s == "ok" and i in box else (s, None) for i, s in enumerate(res.status)]


def episode_seeds(seed: int, step: int, n: int, call: int = 0) -> list[int]:
  """The environment seeds of a learner step's n groups: a pure function of (run seed, step, call)."""
  rng = np.random.default_rng([seed, step, call, 0x45505])
  return [int(s) for s in rng.integers(0, 2**31 - 1, size=n)]


def record_layout(plen_B: np.ndarray, used_B: np.ndarray, P: int, N: int) -> tuple[np.ndarray, np.ndarray]:
  """(positions_BT, segment_ids_BT), int32 [B, P + N], of episodes packed as records: prompts of `plen_B` ids
  left-padded to P, then compact responses of `used_B` ids right-padded to N; positions count from the first
  real prompt token, segment 1 on every real token (policy and environment), 0 on padding."""
  col_P = np.arange(P)
  first_B = P - np.asarray(plen_B)
  seg_BP = col_P[None, :] >= first_B[:, None]
  pos_BP = np.where(seg_BP, col_P[None, :] - first_B[:, None], 0)
  pos_BN = np.asarray(plen_B)[:, None] + np.arange(N)[None, :]
  seg_BN = np.arange(N)[None, :] < np.asarray(used_B)[:, None]
  return (np.concatenate([pos_BP, pos_BN], 1).astype(np.int32), np.concatenate([seg_BP, seg_BN], 1).astype(np.int32))


def row_counters(status: Sequence[str], turns_B, mask_BN, env_mask_BN, ver_BN, info_B: Sequence[dict],
                 declared: Sequence[str] = ()) -> dict:
  """The episode counters of these rows (every row-level `env_*` stat: statuses, turns, tokens, version span, the
  environment's step counters with its `declared` ones at 0 when absent), so a batch cut from a call that played
  several learner steps' episodes (staged) reports each step's own."""
  counts = {k: sum(1 for x in status if x == k) for k in EPISODE_STATUSES}
  policy_BN = np.asarray(mask_BN) > 0
  ver_BN, turns_B = np.asarray(ver_BN), np.asarray(turns_B)
  span_B = (np.where(policy_BN, ver_BN, -1).max(1, initial=-1)
            - np.where(policy_BN, ver_BN, 2**30).min(1, initial=2**30))
  out = {"episode_status": counts, "env_episodes": len(status), "env_turns": int(turns_B.sum()),
         "env_turns_mean": float(turns_B.mean()) if len(status) else 0.0,
         "env_version_span_max": int(max(0, span_B.max(initial=0))),
         "env_policy_tokens": int(policy_BN.sum()), "env_tokens": int(np.asarray(env_mask_BN).sum()),
         "env_errors": counts["error"], "env_timeouts": counts["timeout"], "env_invalid": counts["invalid"],
         "env_truncated": counts["truncated"], "env_done": counts["done"], "env_max_turns": counts["max_turns"],
         "env_too_long": counts["too_long"],
         "reward_errors": counts["error"] + counts["timeout"] + counts["invalid"]}
  sums = dict.fromkeys(declared, 0)
  for info in info_B:
    for k, v in info.items():
      sums[k] = sums.get(k, 0) + v
  out.update({f"env_{k}": v for k, v in sums.items() if f"env_{k}" not in out})
  return out


def merge_stats(stats: Sequence[dict]) -> dict:
  """The episode counters of several `run_episodes` records as one batch's: counts added (`env_*`, `episode_status`,
  `reward_errors`), `env_turns_mean` recomputed over all episodes, `env_version_span_max` the largest."""
  out: dict[str, Any] = {}
  for st in stats:
    for k, v in st.items():
      if k == "episode_status":
        out[k] = {s_: out.get(k, {}).get(s_, 0) + n for s_, n in v.items()}
      elif k == "env_version_span_max":
        out[k] = max(out.get(k, 0), v)
      elif k.startswith("env_") and k != "env_turns_mean" or k == "reward_errors":
        out[k] = out.get(k, 0) + v
  if "env_episodes" in out:
    out["env_turns_mean"] = out.get("env_turns", 0) / max(out["env_episodes"], 1)
  return out


def _bucket(n: int, cap: int) -> int:
  """The sampler batch of n live episodes: the next power of two, at most `cap` (few shapes to compile)."""
  return min(cap, 1 << max(0, n - 1).bit_length())


def _turn_sampler(gen, s: EnvSettings, width: int, mesh):
  """The turn sampler of a batch (`rollout.turn_sampler`): continuous batching with `gen.slots` > 0, else the kept KV
  cache with `env.kv_cache` in one process (over its sampler mesh, if any), else a re-prefill per turn. Each
  speculates when `sampler.spec_gamma` asks (a draft-and-verify step of its decode loop)."""
  if getattr(gen, "slots", 0):  # several processes: each engine decodes on a replica of its own (`Generation`)
    return turn_sampler.SlotTurns(gen, width, gen.slots, gen.slot_chunk, None if multiprocess.multi() else mesh,
                                  resident=s.kv_cache)
  if s.kv_cache and not multiprocess.multi():  # several processes: each holds only its shards of the cache
    return turn_sampler.CachedTurns(gen, width, mesh)
  return turn_sampler.Reprefill(gen, width, mesh)


def run_episodes(gen, params, seeds: Sequence[int], group_size: int, settings: EnvSettings, key, version: int,
                 width: int | None = None, keep_turns: bool = False, poll: Callable | None = None,
                 on_mesh: bool = True) -> Rollout:
  """n = len(seeds) groups × G episodes with parameters `params` of `version` (module docstring).

  `gen`: the run's `Generation` (sampler model and settings, encoder, mesh); `width`: the prompt
  bucket P (default `gen.width`); an episode whose first message is longer than P is "too_long".
  `poll` (async episodes): a `sampling.partial.Poll`, asked before every turn after the first for newer
  parameters (`poll(current_version) -> (version, params) | None`) and told the end (`poll(None)`); each
  token's version is recorded in `versions_BN` (an observation carries the version of the turn it answers).
  `on_mesh=False`: generate on the caller's default device, not over `gen.mesh` (rollout worker threads).
  `keep_turns`: stats["turn_outputs"] holds every turn's sampler output and live rows (tests).
  """
  env_list: list = []
  try:
    return _run_episodes(gen, params, seeds, group_size, settings, key, version, width, keep_turns, poll,
                         gen.mesh if on_mesh else None, env_list)
  finally:
    if poll is not None:
      poll(None)
    # Environments holding resources (a simulator process, a server) release them now, under the time limit: a
    # close that fails or hangs costs nothing more (the batch is formed).
    closes = [(env.close,) for env in env_list if callable(getattr(env, "close", None))]
    if closes:
      env_calls(closes, settings.timeout_s, settings.workers)


def _run_episodes(gen, params, seeds, group_size, settings, key, version, width, keep_turns, poll, mesh,
                  env_list: list) -> Rollout:
  W = (width or gen.width) + settings.max_episode_tokens
  turns = _turn_sampler(gen, settings, W, mesh)
  batch = _Batch(gen, seeds, group_size, settings, version, width, env_list, turns)
  if isinstance(turns, turn_sampler.SlotTurns) and poll is None:
    _play_refill(batch, params, key, keep_turns)
  else:
    _play_turns(batch, params, key, poll, keep_turns)
  return batch.record(keep_turns)


def _play_turns(bt: "_Batch", params, key, poll: Callable | None, keep_turns: bool) -> None:
  """Turn-synchronous play: every live episode samples turn t (one `turns.turn` call, key `fold_in(key, t)`), then
  their environments step together."""
  s, B = bt.s, bt.B
  for t in range(s.max_turns):
    if not bt.live.any():
      break
    newer = poll(bt.version) if poll is not None and t > 0 else None
    if newer is not None:  # async: this turn generates from the newest published parameters
      bt.version, params = newer
    for b in np.flatnonzero(bt.live):
      bt.evict_before(b, t)
    if not bt.live.any():  # every eviction lacked room ("truncated")
      break
    # Only live episodes generate: their rows, padded (with copies of the first) to a power-of-two bucket.
    idx = np.flatnonzero(bt.live)
    rows_b = idx if len(idx) == B else np.concatenate([idx, np.full(_bucket(len(idx), B) - len(idx), idx[0])])
    contexts = [bt.live_context(b)[0] for b in rows_b]
    # turn 0: the G rows of a group hold one prompt (prefilled once); later turns differ row by row
    cfg_t = bt.samp_cfg if len(rows_b) == B and t == 0 else dataclasses.replace(bt.samp_cfg, group_size=1)
    got = bt.turns.turn(params, bt.version, rows_b.tolist(), contexts, fold_in(key, t), cfg_t)
    names = ("tokens_BN", "lengths_B", "behavior_logp_BN", *(k for k in bt.recs if k in got))
    out = {k: np.zeros((B,) + got[k].shape[1:], got[k].dtype) for k in names}
    for k in out:
      out[k][idx] = np.asarray(got[k])[:len(idx)]
    routes = got.get("routes_BXLk") if bt.routes_BTLk is not None else None
    if keep_turns:
      bt.turn_outputs.append({"tokens_BN": out["tokens_BN"], "lengths_B": out["lengths_B"],
                              "behavior_logp_BN": out["behavior_logp_BN"], "live_B": bt.live.copy(),
                              "start_B": bt.used_B.copy(), "version": bt.version})
    calls, rows = [], []
    for i, b in enumerate(idx):
      if routes is not None:  # before `take` moves the episode's end: the turn's context is the live one
        bt.put_routes(b, routes[i], int(out["lengths_B"][b]))
      action = bt.take(b, t, out["tokens_BN"][b], out["behavior_logp_BN"][b], int(out["lengths_B"][b]),
                       {k: out[k][b] for k in bt.recs})
      if action is not None:
        calls.append((bt.envs[b].step, action))
        rows.append(b)
    for b, (st, val) in zip(rows, env_calls(calls, s.timeout_s, s.workers)):
      bt.answer(b, t, st, val)


def _play_refill(bt: "_Batch", params, key, keep_turns: bool) -> None:
  """Cross-turn refill (`SlotTurns`, no `poll`): no turn barrier. Every live episode's turn 0 is queued on the slot
  engine; after each decode chunk the episodes whose turn finished step their environments (together, under the
  time limit) and each one still live queues its next turn at once, while the other episodes' turns decode on.
  Episode b's turn t draws with `fold_in(fold_in(key, t), b)`, as `_play_turns` with `SlotTurns` does, and each
  episode's events (evictions, summaries, observations) happen in its own order, so both give the same record."""
  s, turns = bt.s, bt.turns
  turn_of: dict[int, int] = {}

  def queue(b: int, t: int) -> None:
    bt.evict_before(b, t)
    if bt.live[b]:
      turn_of[b] = t
      turns.submit(b, bt.live_context(b)[0], fold_in(key, t), b, bt.samp_cfg)

  for b in np.flatnonzero(bt.live):
    queue(b, 0)
  while not turns.idle:
    done = turns.step(params, bt.version)
    calls, rows = [], []
    for b, o in done:
      t = turn_of[b]
      if keep_turns:
        bt.keep_turn(t, b, o)
      if bt.routes_BTLk is not None and "routes_XLk" in o:
        bt.put_routes(b, o["routes_XLk"], o["length"])
      action = bt.take(b, t, o["tokens_N"], o["behavior_logp_N"], o["length"], {k: o[k] for k in bt.recs})
      if action is not None:
        calls.append((bt.envs[b].step, action))
        rows.append(b)
    for b, (st, val) in zip(rows, env_calls(calls, s.timeout_s, s.workers) if calls else ()):
      bt.answer(b, turn_of[b], st, val)
    for b, _ in done:
      if bt.live[b] and turn_of[b] + 1 < s.max_turns:
        queue(b, turn_of[b] + 1)


class _Batch:
  """The host state of one batch of episodes (environments, statuses, the response buffers) and what happens to
  one episode between its turns: `evict_before` (a "drop_oldest" eviction), `take` (writes a turn's tokens; the
  action to step with), `answer` (the environment's result; the observation appended), `record` (the Rollout).
  The drivers (`_play_turns`, `_play_refill`) decide when each episode's turn is sampled."""

  def __init__(self, gen, seeds, group_size, s: EnvSettings, version: int, width: int | None, env_list: list, turns):
    G = group_size
    P, N = width or gen.width, s.max_episode_tokens
    B = len(seeds) * G
    self.gen, self.s, self.G, self.P, self.N, self.B, self.version, self.turns = gen, s, G, P, N, B, version, turns
    self.tok = gen.encoder.tokenizer
    self.pad = pad = gen.sampler_cfg.pad_id
    env_list.extend(envs.get(s.name, **dict(s.kwargs)) for _ in range(B))
    self.envs = env_list
    self.status: list[str | None] = [None] * B
    self.reward_B = np.zeros((B,), np.float32)
    self.turn_reward_BK = np.zeros((B, s.max_turns), np.float32)  # each turn's step reward (turn-level credit)

    # Reset: the G episodes of a group share one seed.
    first = env_calls([(e.reset, int(seeds[b // G])) for b, e in enumerate(env_list)], s.timeout_s, s.workers)
    prompts: list[list[int]] = []
    for b, (st, msg) in enumerate(first):
      try:
        msg = msg if st != "ok" or isinstance(msg, str) else check_messages(msg, ("system", "user"))
      except ValueError:  # neither a str nor system/user messages: the environment's error
        st = "error"
      if st != "ok":
        self.status[b], msg = st, ""
      ids = gen.encoder.episode_prompt_ids(msg, tools=getattr(env_list[b], "tools", None) if st == "ok" else None)
      if len(ids) > P:  # this episode cannot start: counted, the batch goes on
        self.status[b] = "too_long"
        ids = gen.encoder.episode_prompt_ids("")
        if len(ids) > P:
          raise ValueError(f"environment {s.name!r}: even an empty first message is {len(ids)} tokens, longer than "
                           f"the prompt width P={P} (env.prompt_width)")
      prompts.append(ids)
    self.prompts = prompts
    self.prompt_BP, self.plen_B = pad_left(prompts, P, pad)

    self.resp_BN = np.full((B, N), pad, np.int32)
    self.mask_BN = np.zeros((B, N), np.float32)
    self.env_mask_BN = np.zeros((B, N), np.float32)
    self.turn_BN = np.full((B, N), -1, np.int32)
    self.logp_BN = np.zeros((B, N), np.float32)
    self.ver_BN = np.full((B, N), version, np.int32)
    self.used_B = np.zeros((B,), np.int64)
    self.turns_B = np.zeros((B,), np.int32)
    self.live = np.asarray([st is None for st in self.status])
    self.samp_cfg = dataclasses.replace(gen.sampler_cfg, max_new_tokens=s.turn_tokens)
    # μ's top-k / Monte-Carlo candidates of every policy token, in the response layout (pad ids / 0 elsewhere)
    self.recs = {name: np.array(x) for name, x in behavior.init_records(B, N, self.samp_cfg).items()}
    self.turn_outputs: list[dict] = []
    # each row's step counters (`info`); the environment's declared ones (`Env.counters`) are in every batch's stats
    self.info_B: list[dict[str, float]] = [{} for _ in range(B)]
    self.declared = tuple(getattr(next(iter(self.envs), None), "counters", ()))
    self.stop_set = set(self.tok.stop_ids)
    self.evicting = s.evict != "none"
    self.seg_starts: list[list[int]] = [[] for _ in range(B)]  # response columns where segments 2, 3, ... begin
    self.pending: list[tuple] = []  # SDCC: (row, uncompressed context, first column of the next turn, turn)
    self.n_evicted = self.n_copied = 0
    self.summarizing: dict[int, tuple] = {}  # "summary": row -> (its last observation, uncompressed context ids)
    # MoE routing replay: each row token's expert ids from the last time the sampler fed it (`put_routes`)
    self.routes_BTLk = None
    if gen.keep_routes and gen.model_cfg.is_moe:
      L, k = gen.model_cfg.n_layers, gen.model_cfg.experts_per_token
      self.routes_BTLk = np.broadcast_to(np.arange(k, dtype=np.int32), (B, P + N, L, k)).copy()

  def live_context(self, b: int) -> tuple[list[int], list[int]]:
    """(ids, turn ids) of episode b's live context: its current segment (with the first message in segment 1)."""
    a = self.seg_starts[b][-1] if self.seg_starts[b] else 0
    head = [] if self.seg_starts[b] else self.prompts[b]
    u = self.used_B[b]
    return head + self.resp_BN[b, a:u].tolist(), [-1] * len(head) + self.turn_BN[b, a:u].tolist()

  def open_segment(self, b: int, new: list[int], new_turns: list[int], uncompressed: list[int], t_next: int) -> None:
    """Episode b's context becomes `new` (an eviction): a new segment opens with it (mask 0); SDCC will distill
    turn `t_next` from the `uncompressed` context. No room for it and one more policy token: "truncated"."""
    u = int(self.used_B[b])
    if u + len(new) >= self.N:
      self.status[b], self.live[b] = "truncated", False
      return
    self.resp_BN[b, u:u + len(new)] = new
    self.turn_BN[b, u:u + len(new)] = new_turns
    self.ver_BN[b, u:] = self.version
    self.seg_starts[b].append(u)
    self.used_B[b] += len(new)
    self.pending.append((b, uncompressed, u + len(new), t_next))
    self.turns.forget(b)
    self.n_evicted += 1
    self.n_copied += len(new)

  def evict_before(self, b: int, t: int) -> None:
    """Before live episode b's turn t > 0: a "drop_oldest" eviction when its context exceeds the budget."""
    s = self.s
    if s.evict != "drop_oldest" or t == 0:
      return
    ctx, turn_L = self.live_context(b)
    keep = evict_lib.drop_oldest(turn_L, s.context_budget, s.keep_last_turns)
    if keep is not None:
      self.open_segment(b, [i for i, k in zip(ctx, keep) if k], np.asarray(turn_L)[keep].tolist(), ctx, t)

  def put_routes(self, b: int, routes_XLk: np.ndarray, n_b: int) -> None:
    """Episode b's turn routes (`turn_sampler.routes_by_position`: its live context, then its `n_b` new tokens) into
    the row: context token i at its column (the prompt's, or the current segment's), the new tokens after `used`.
    A token fed again in a later turn (every context is) takes that turn's routes: the learner replays the last
    routing each token saw, which is exact within a version (routing depends on the prefix only) and, across an
    async version switch between turns, the newest (as partial rollouts' re-prefill records it)."""
    a = self.seg_starts[b][-1] if self.seg_starts[b] else 0
    head = 0 if self.seg_starts[b] else len(self.prompts[b])
    u, P = int(self.used_B[b]), self.P
    k = min(n_b, self.N - u)
    cols = np.concatenate([np.arange(P - head, P), P + np.arange(a, u), P + u + np.arange(k)]).astype(np.int64)
    self.routes_BTLk[b, cols] = routes_XLk[:len(cols)]

  def keep_turn(self, t: int, b: int, o: dict) -> None:
    """`keep_turns` under `_play_refill`: episode b's turn t output in turn t's record (as `_play_turns` keeps it)."""
    while len(self.turn_outputs) <= t:
      n = self.samp_cfg.max_new_tokens
      self.turn_outputs.append({"tokens_BN": np.zeros((self.B, n), np.int32),
                                "lengths_B": np.zeros((self.B,), np.int32),
                                "behavior_logp_BN": np.zeros((self.B, n), np.float32),
                                "live_B": np.zeros((self.B,), bool), "start_B": None, "version": self.version,
                                "_start": {}})
    rec = self.turn_outputs[t]
    rec["tokens_BN"][b], rec["behavior_logp_BN"][b] = o["tokens_N"], o["behavior_logp_N"]
    rec["lengths_B"][b] = o["length"]
    rec["live_B"][b] = True
    rec["_start"][b] = int(self.used_B[b])

  def take(self, b: int, t: int, tokens_N: np.ndarray, logp_N: np.ndarray, n_b: int,
           recs: dict | None = None) -> str | None:
    """Writes episode b's turn t (its first `n_b` sampled tokens, as far as the budget allows, and μ's records of
    them, `recs`: name -> [n, k]); returns the action text its environment steps with, or None (the budget cut the
    turn: "truncated"; or it was the summary)."""
    N, u = self.N, int(self.used_B[b])
    k = min(n_b, N - u)
    self.resp_BN[b, u:u + k] = tokens_N[:k]
    self.logp_BN[b, u:u + k] = logp_N[:k]
    for name, x in (recs or {}).items():
      self.recs[name][b, u:u + k] = x[:k]
    self.mask_BN[b, u:u + k] = 1.0
    self.turn_BN[b, u:u + k] = t
    self.ver_BN[b, u:] = self.version  # this turn's tokens and its observation (padding keeps the last version)
    self.used_B[b] += k
    self.turns_B[b] = t + 1
    if k < n_b:  # the budget cut the turn
      self.status[b], self.live[b] = "truncated", False
      return None
    if b in self.summarizing:  # this turn was the summary: it replaces every earlier turn; the last observation follows
      obs, uncompressed = self.summarizing.pop(b)
      summary = tokens_N[:k].tolist()
      again = render_env_message(self.gen.encoder, obs, turn_ended=bool(summary) and summary[-1] in self.stop_set)
      self.open_segment(b, self.prompts[b] + summary + again, [-1] * len(self.prompts[b]) + [t] * (k + len(again)),
                        uncompressed, t + 1)
      return None
    return completion_text(self.tok, tokens_N[:k])

  def answer(self, b: int, t: int, st: str, val: Any) -> None:
    """Episode b's environment answered its turn t (`env_calls`' (status, result)): the reward added, the episode
    ended (failure, done, turn limit, no room) or its observation appended (or the summary request, "summary")."""
    s, N = self.s, self.N
    if st == "ok":
      try:
        obs, r, done, info = _checked_step(val)
      except Exception:  # pylint: disable=broad-except  # a malformed step result is the environment's error
        st = "error"
    if st != "ok":
      self.status[b], self.live[b], self.reward_B[b] = st, False, 0.0
      self.turn_reward_BK[b] = 0.0
      return
    self.reward_B[b] += r
    self.turn_reward_BK[b, t] += r
    for k, v in info.items():
      self.info_B[b][k] = self.info_B[b].get(k, 0) + v
    if done:
      self.status[b], self.live[b] = "done", False
      return
    if t == s.max_turns - 1:  # the turn limit: no observation is appended after the last turn
      self.status[b], self.live[b] = "max_turns", False
      return
    u = int(self.used_B[b])
    # the policy's turn ended when its last token (this turn's) is a stop id; else the turn was cut
    ended = (u > 0 and self.turn_BN[b, u - 1] == t and self.mask_BN[b, u - 1] > 0
             and int(self.resp_BN[b, u - 1]) in self.stop_set)
    ids = render_env_message(self.gen.encoder, obs, turn_ended=bool(ended))
    if (s.evict == "summary" and t + 2 < s.max_turns
        and len(self.live_context(b)[0]) + len(ids) > s.context_budget):  # the next turn summarizes, then one acts
      uncompressed = self.live_context(b)[0] + ids
      obs = check_messages(obs, ("user", "tool"))
      ids = render_env_message(self.gen.encoder, obs + [{"role": "user", "content": s.summary_instruction}],
                               turn_ended=bool(ended))
      self.summarizing[b] = (obs, uncompressed)
    if u + len(ids) >= N:  # no room for the observation and at least one more policy token
      self.status[b], self.live[b] = "truncated", False
      return
    self.resp_BN[b, u:u + len(ids)] = ids
    self.env_mask_BN[b, u:u + len(ids)] = 1.0
    self.turn_BN[b, u:u + len(ids)] = t
    self.used_B[b] += len(ids)

  def record(self, keep_turns: bool) -> Rollout:
    """The batch as one Rollout with its stats (module docstring); episodes still live ran out of turns."""
    B, P, N, status, turns = self.B, self.P, self.N, self.status, self.turns
    for b in range(B):
      if status[b] is None:
        status[b] = "max_turns"
    used_B, mask_BN, ver_BN, turns_B = self.used_B, self.mask_BN, self.ver_BN, self.turns_B
    positions_BT, segment_ids_BT = record_layout(self.plen_B, used_B, P, N)
    extra = None
    if self.evicting:
      positions_BT, segment_ids_BT = evict_lib.segment_layout(positions_BT, segment_ids_BT, self.seg_starts, used_B, P)
      extra, sdcc_skipped = evict_lib.teacher_layout(self.pending, self.resp_BN, mask_BN, self.turn_BN, 2 * (P + N),
                                                     self.pad)
    info_B = tuple(dict(x) for x in self.info_B)
    stats = {**row_counters(status, turns_B, mask_BN, self.env_mask_BN, ver_BN, info_B, self.declared),
             "env_prefills": turns.prefills, "episode_statuses": tuple(status),
             "episode_turns": tuple(int(x) for x in turns_B), "episode_info": info_B}
    if self.evicting:
      stats.update(env_evictions=self.n_evicted, env_copied_tokens=self.n_copied, env_sdcc_skipped=sdcc_skipped,
                   evict_segment_starts=tuple(tuple(x) for x in self.seg_starts))
    if isinstance(turns, turn_sampler.SlotTurns):
      stats.update(env_slot_steps=turns.slot_steps, env_live_steps=turns.live_steps, env_slot_resumes=turns.resumed)
    if getattr(turns, "spec", None):  # speculative decoding: the turns' mean acceptance and tokens per call
      stats.update({k: float(np.mean([d[k] for d in turns.spec])) for k in turns.spec[0]})
    if getattr(turns, "kv_bits", None) is not None:  # the cache format the turns decoded from
      stats["gen_kv_bits"] = turns.kv_bits
    if keep_turns:
      for rec in self.turn_outputs:  # `_play_refill`'s: a row not in turn t had ended, so its count is final
        if "_start" in rec:
          start = rec.pop("_start")
          rec["start_B"] = np.asarray([start.get(b, used_B[b]) for b in range(B)], used_B.dtype)
      stats["turn_outputs"] = self.turn_outputs
    return Rollout(sequence_BT=np.concatenate([self.prompt_BP, self.resp_BN], 1), positions_BT=positions_BT,
                   segment_ids_BT=segment_ids_BT, mask_BN=mask_BN, behavior_logp_BN=self.logp_BN,
                   versions_BN=ver_BN, reward_B=self.reward_B, turn_reward_BK=self.turn_reward_BK,
                   group_B=np.arange(B, dtype=np.int32) // self.G, turn_BN=self.turn_BN, env_mask_BN=self.env_mask_BN,
                   routes_BTLk=self.routes_BTLk, extra=extra, stats=stats, **self.recs,
                   # a sinks + window cache: every turn sampler masks it by position, as the learner's shadow mask
                   **window_record(self.samp_cfg.kv_window_arg, B))
