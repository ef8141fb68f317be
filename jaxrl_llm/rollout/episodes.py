"""Multi-turn episodes: a policy playing text environments (`jaxrl_llm.envs`), packed as one `Rollout`.

`run_episodes` plays n seeds × G episodes (a GRPO group of G rows per seed: the G environments start
from one state) for up to `max_turns` turns with pinned parameters:

- every turn samples at most `turn_tokens` tokens (key `fold_in(key, turn)`) after each episode so far
  (initial prompt + response so far), through `rollout.turn_sampler`: with `rollout.slots` > 0 (`gen.slots`, one
  device; it takes precedence over `kv_cache`) by continuous batching: each live episode's turn is one request
  to a slot engine, a slot freed by a short turn refilled with the next episode (row i of the turn draws with
  `fold_in(fold_in(turn key, i), n)`, so slots change a seed's samples); else by default (`kv_cache`, one
  device) each episode's KV cache is kept across turns and a turn prefills only the appended observation; else
  (or on a mesh) every turn re-prefills the episode left-padded to one width W = P + N
  (N = `max_episode_tokens`, the response budget) with `sampling.generate`. The turns stay synchronous: every
  live episode's turn ends before the environments step;
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

Every environment call (`reset`, `step`) runs under the time limit of rewards (`tasks.reward`, on its
worker threads): an environment that raises ("error"), overruns `timeout_s` ("timeout") or rejects the
action (`envs.InvalidAction`, "invalid") ends that episode with return 0, counted in the stats; the
batch still forms. Episodes that hit the token budget end "truncated" (return so far); an episode whose first
message is longer than the prompt width P is "too_long" (return 0, no tokens: it never starts). The stats:
`episode_status` (counts by status), `episode_statuses` (per row), `env_episodes`, `env_turns` (total) and
`env_turns_mean`, `env_policy_tokens`, `env_tokens`, `env_done`, `env_max_turns`, `env_truncated`,
`env_too_long`, `env_errors`,
`env_timeouts`, `env_invalid`, `env_version_span_max` (the most versions one episode's policy tokens span, minus
one), `env_prefills` (sampler prefills: one per turn, per call with the kept KV cache, per admission batch with
slots), with slots `env_slot_steps` and `env_live_steps` (slot-steps decoded / those of an unfinished turn: the
share 1 - live/slot was wasted on free or finished slots), `reward_errors` (errors
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

from jaxrl_llm import envs
from jaxrl_llm.keys import fold_in
from jaxrl_llm.record import Rollout
from jaxrl_llm.rollout import evict as evict_lib
from jaxrl_llm.rollout import turn_sampler
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
  kv_cache: bool = True  # keep each episode's KV cache across turns (one device; `rollout.turn_sampler`)
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
  """The turn sampler of a batch: continuous batching with `gen.slots` > 0 (one device: refused on a mesh), else
  the kept KV cache with `env.kv_cache` on one device, else a re-prefill per turn (`rollout.turn_sampler`)."""
  if getattr(gen, "slots", 0):
    if mesh is not None:
      raise ValueError("continuous batching of episode turns (rollout.slots) runs on one device, not on a sampler mesh")
    return turn_sampler.SlotTurns(gen, width, gen.slots, gen.slot_chunk)
  if s.kv_cache and mesh is None:
    return turn_sampler.CachedTurns(gen, width)
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
    for env in env_list:  # environments holding resources (a simulator process, a server) release them now
      if callable(getattr(env, "close", None)):
        try:
          env.close()
        except Exception:  # pylint: disable=broad-except  # a failing close costs nothing more: the batch is formed
          pass


def _run_episodes(gen, params, seeds, group_size, settings, key, version, width, keep_turns, poll, mesh,
                  env_list: list) -> Rollout:
  s, G = settings, group_size
  P, N = width or gen.width, s.max_episode_tokens
  B = len(seeds) * G
  tok = gen.encoder.tokenizer
  pad = gen.sampler_cfg.pad_id
  kwargs = dict(s.kwargs)
  env_list.extend(envs.get(s.name, **kwargs) for _ in range(B))
  status: list[str | None] = [None] * B
  reward_B = np.zeros((B,), np.float32)

  # Reset: the G episodes of a group share one seed.
  first = env_calls([(e.reset, int(seeds[b // G])) for b, e in enumerate(env_list)], s.timeout_s, s.workers)
  prompts: list[list[int]] = []
  for b, (st, msg) in enumerate(first):
    try:
      msg = msg if st != "ok" or isinstance(msg, str) else check_messages(msg, ("system", "user"))
    except ValueError:  # neither a str nor system/user messages: the environment's error
      st = "error"
    if st != "ok":
      status[b], msg = st, ""
    ids = gen.encoder.episode_prompt_ids(msg, tools=getattr(env_list[b], "tools", None) if st == "ok" else None)
    if len(ids) > P:  # this episode cannot start: counted, the batch goes on
      status[b] = "too_long"
      ids = gen.encoder.episode_prompt_ids("")
      if len(ids) > P:
        raise ValueError(f"environment {s.name!r}: even an empty first message is {len(ids)} tokens, longer than "
                         f"the prompt width P={P} (env.prompt_width)")
    prompts.append(ids)
  prompt_BP, plen_B = pad_left(prompts, P, pad)

  resp_BN = np.full((B, N), pad, np.int32)
  mask_BN = np.zeros((B, N), np.float32)
  env_mask_BN = np.zeros((B, N), np.float32)
  turn_BN = np.full((B, N), -1, np.int32)
  logp_BN = np.zeros((B, N), np.float32)
  ver_BN = np.full((B, N), version, np.int32)
  used_B = np.zeros((B,), np.int64)
  turns_B = np.zeros((B,), np.int32)
  live = np.asarray([st is None for st in status])
  W = P + N
  samp_cfg = dataclasses.replace(gen.sampler_cfg, max_new_tokens=s.turn_tokens, behavior_topk=0, mc_samples=0)
  turns = _turn_sampler(gen, s, W, mesh)
  turn_outputs = []
  info_sums: dict[str, float] = {}
  stop_set = set(tok.stop_ids)
  evicting = s.evict != "none"
  seg_starts: list[list[int]] = [[] for _ in range(B)]  # response columns where segments 2, 3, ... begin
  pending: list[tuple] = []  # SDCC: (row, uncompressed context, first column of the next turn, turn)
  n_evicted = n_copied = 0

  def live_context(b: int) -> tuple[list[int], list[int]]:
    """(ids, turn ids) of episode b's live context: its current segment (with the first message in segment 1)."""
    a = seg_starts[b][-1] if seg_starts[b] else 0
    head = [] if seg_starts[b] else prompts[b]
    return head + resp_BN[b, a:used_B[b]].tolist(), [-1] * len(head) + turn_BN[b, a:used_B[b]].tolist()

  def open_segment(b: int, new: list[int], new_turns: list[int], uncompressed: list[int], t_next: int) -> None:
    """Episode b's context becomes `new` (an eviction): a new segment opens with it (mask 0); SDCC will distill
    turn `t_next` from the `uncompressed` context. No room for it and one more policy token: "truncated"."""
    nonlocal n_evicted, n_copied
    u = int(used_B[b])
    if u + len(new) >= N:
      status[b], live[b] = "truncated", False
      return
    resp_BN[b, u:u + len(new)] = new
    turn_BN[b, u:u + len(new)] = new_turns
    ver_BN[b, u:] = version
    seg_starts[b].append(u)
    used_B[b] += len(new)
    pending.append((b, uncompressed, u + len(new), t_next))
    turns.forget(b)
    n_evicted += 1
    n_copied += len(new)

  summarizing: dict[int, tuple] = {}  # "summary": row -> (its last observation, uncompressed context ids)

  for t in range(s.max_turns):
    if not live.any():
      break
    newer = poll(version) if poll is not None and t > 0 else None
    if newer is not None:  # async: this turn generates from the newest published parameters
      version, params = newer
    for b in (np.flatnonzero(live) if s.evict == "drop_oldest" and t > 0 else ()):
      ctx, turn_L = live_context(b)
      keep = evict_lib.drop_oldest(turn_L, s.context_budget, s.keep_last_turns)
      if keep is not None:
        open_segment(b, [i for i, k in zip(ctx, keep) if k], np.asarray(turn_L)[keep].tolist(), ctx, t)
    if not live.any():  # every eviction lacked room ("truncated")
      break
    # Only live episodes generate: their rows, padded (with copies of the first) to a power-of-two bucket.
    idx = np.flatnonzero(live)
    rows_b = idx if len(idx) == B else np.concatenate([idx, np.full(_bucket(len(idx), B) - len(idx), idx[0])])
    contexts = [live_context(b)[0] for b in rows_b]
    # turn 0: the G rows of a group hold one prompt (prefilled once); later turns differ row by row
    cfg_t = samp_cfg if len(rows_b) == B and t == 0 else dataclasses.replace(samp_cfg, group_size=1)
    got = turns.turn(params, version, rows_b.tolist(), contexts, fold_in(key, t), cfg_t)
    out = {k: np.zeros((B,) + got[k].shape[1:], got[k].dtype) for k in ("tokens_BN", "lengths_B", "behavior_logp_BN")}
    for k in out:
      out[k][idx] = got[k][:len(idx)]
    if keep_turns:
      turn_outputs.append({"tokens_BN": out["tokens_BN"], "lengths_B": out["lengths_B"],
                           "behavior_logp_BN": out["behavior_logp_BN"], "live_B": live.copy(),
                           "start_B": used_B.copy(), "version": version})
    calls, rows = [], []
    for b in np.flatnonzero(live):
      n_b = int(out["lengths_B"][b])
      k = min(n_b, N - int(used_B[b]))
      u = int(used_B[b])
      resp_BN[b, u:u + k] = out["tokens_BN"][b, :k]
      logp_BN[b, u:u + k] = out["behavior_logp_BN"][b, :k]
      mask_BN[b, u:u + k] = 1.0
      turn_BN[b, u:u + k] = t
      ver_BN[b, u:] = version  # this turn's tokens and its observation (padding keeps the last version)
      used_B[b] += k
      turns_B[b] = t + 1
      if k < n_b:  # the budget cut the turn
        status[b], live[b] = "truncated", False
        continue
      if b in summarizing:  # this turn was the summary: it replaces every earlier turn; the last observation follows
        obs, uncompressed = summarizing.pop(b)
        summary = out["tokens_BN"][b, :k].tolist()
        again = render_env_message(gen.encoder, obs, turn_ended=bool(summary) and summary[-1] in stop_set)
        open_segment(b, prompts[b] + summary + again, [-1] * len(prompts[b]) + [t] * (k + len(again)), uncompressed,
                     t + 1)
        continue
      calls.append((env_list[b].step, completion_text(tok, out["tokens_BN"][b, :k])))
      rows.append(b)
    results = env_calls(calls, s.timeout_s, s.workers)
    for b, (st, val) in zip(rows, results):
      if st == "ok":
        try:
          obs, r, done, info = _checked_step(val)
        except Exception:  # pylint: disable=broad-except  # a malformed step result is the environment's error
          st = "error"
      if st != "ok":
        status[b], live[b], reward_B[b] = st, False, 0.0
        continue
      reward_B[b] += r
      for k, v in info.items():
        info_sums[k] = info_sums.get(k, 0) + v
      if done:
        status[b], live[b] = "done", False
        continue
      if t == s.max_turns - 1:  # the turn limit: no observation is appended after the last turn
        status[b], live[b] = "max_turns", False
        continue
      u = int(used_B[b])
      # the policy's turn ended when its last token (this turn's) is a stop id; else the turn was cut
      ended = u > 0 and turn_BN[b, u - 1] == t and mask_BN[b, u - 1] > 0 and int(resp_BN[b, u - 1]) in stop_set
      ids = render_env_message(gen.encoder, obs, turn_ended=bool(ended))
      if (s.evict == "summary" and t + 2 < s.max_turns
          and len(live_context(b)[0]) + len(ids) > s.context_budget):  # the next turn summarizes, then one acts
        uncompressed = live_context(b)[0] + ids
        obs = check_messages(obs, ("user", "tool"))
        ids = render_env_message(gen.encoder, obs + [{"role": "user", "content": s.summary_instruction}],
                                 turn_ended=bool(ended))
        summarizing[b] = (obs, uncompressed)
      if u + len(ids) >= N:  # no room for the observation and at least one more policy token
        status[b], live[b] = "truncated", False
        continue
      resp_BN[b, u:u + len(ids)] = ids
      env_mask_BN[b, u:u + len(ids)] = 1.0
      turn_BN[b, u:u + len(ids)] = t
      used_B[b] += len(ids)
  for b in range(B):
    if status[b] is None:
      status[b] = "max_turns"

  positions_BT, segment_ids_BT = record_layout(plen_B, used_B, P, N)
  extra = None
  if evicting:
    positions_BT, segment_ids_BT = evict_lib.segment_layout(positions_BT, segment_ids_BT, seg_starts, used_B, P)
    extra, sdcc_skipped = evict_lib.teacher_layout(pending, resp_BN, mask_BN, turn_BN, 2 * (P + N), pad)
  counts = {k: sum(1 for x in status if x == k) for k in EPISODE_STATUSES}
  policy_BN = mask_BN > 0
  span_B = np.where(policy_BN, ver_BN, -1).max(1, initial=-1) - np.where(policy_BN, ver_BN, 2**30).min(1, initial=2**30)
  stats = {"episode_status": counts, "env_episodes": B, "env_turns": int(turns_B.sum()),
           "env_turns_mean": float(turns_B.mean()) if B else 0.0,
           "env_version_span_max": int(max(0, span_B.max(initial=0))), "env_prefills": turns.prefills,
           "env_policy_tokens": int(mask_BN.sum()), "env_tokens": int(env_mask_BN.sum()),
           "env_errors": counts["error"], "env_timeouts": counts["timeout"], "env_invalid": counts["invalid"],
           "env_truncated": counts["truncated"], "env_done": counts["done"], "env_max_turns": counts["max_turns"],
           "env_too_long": counts["too_long"],
           "reward_errors": counts["error"] + counts["timeout"] + counts["invalid"],
           "episode_statuses": tuple(status)}
  if evicting:
    stats.update(env_evictions=n_evicted, env_copied_tokens=n_copied, env_sdcc_skipped=sdcc_skipped,
                 evict_segment_starts=tuple(tuple(x) for x in seg_starts))
  stats.update({f"env_{k}": v for k, v in info_sums.items() if f"env_{k}" not in stats})
  if isinstance(turns, turn_sampler.SlotTurns):
    stats.update(env_slot_steps=turns.slot_steps, env_live_steps=turns.live_steps)
  if keep_turns:
    stats["turn_outputs"] = turn_outputs
  return Rollout(sequence_BT=np.concatenate([prompt_BP, resp_BN], 1), positions_BT=positions_BT,
                 segment_ids_BT=segment_ids_BT, mask_BN=mask_BN, behavior_logp_BN=logp_BN,
                 versions_BN=ver_BN, reward_B=reward_B,
                 group_B=np.arange(B, dtype=np.int32) // G, turn_BN=turn_BN, env_mask_BN=env_mask_BN, extra=extra,
                 stats=stats)
