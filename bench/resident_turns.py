"""Episode turns with continuous batching: every turn re-prefilled into a slot, against the episode's keys/values
resident in its slot (`rollout.turn_sampler.SlotTurns(resident=True)`: `env.kv_cache` with `rollout.slots`).

  python -m bench.resident_turns [--episodes 16] [--slots 16] [--turns 6] [--turn-tokens 32] [--obs 64]
      [--prompt 256] [--d-model 256] [--layers 4] [--rounds 3] [--markdown F]

A toy model (V = 512, at init) plays hand-driven episodes: each turn samples `--turn-tokens` tokens per episode
(no stop id) and appends them and an observation of `--obs` ids, so the context grows from `--prompt` ids by
turn tokens + observation per turn and the episode width is W = prompt + turns × (turn tokens + obs). Re-prefilled,
every turn prefills each context left-padded to W; resident, a later turn appends the last token and the
observation (one forward over a power-of-two bucket of them) and decodes over cache rows of W more slots. Both run
the same turns with the same keys; the line says whether every token came out the same (float rounding may flip a
near tie). Reported: seconds per batch of episodes (best of `--rounds`, the two taking turns after a warm-up run
each that compiles), the speed-up, and the turns resumed / prefill calls of the resident run.
"""

from __future__ import annotations

import argparse
import time
import types

import jax
import numpy as np

from bench.common import run_header, write_profile
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.rollout.turn_sampler import SlotTurns
from jaxrl_llm.sampling import SamplerConfig

V = 512


def setup(args) -> tuple:
  """(gen stand-in, params, the turns' SamplerConfig, W)."""
  cfg = ModelConfig(vocab_size=V, d_model=args.d_model, n_layers=args.layers, n_heads=max(1, args.d_model // 64),
                    n_kv_heads=max(1, args.d_model // 128), head_dim=64, d_ff=4 * args.d_model)
  sc = SamplerConfig(max_new_tokens=args.turn_tokens, stop_ids=(), temperature=1.0, pad_id=0)
  gen = types.SimpleNamespace(model_cfg=cfg, sampler_cfg=sc, draft_params=lambda: None)
  W = args.prompt + args.turns * (args.turn_tokens + args.obs)
  return gen, init_params(cfg, jax.random.key(0)), sc, W


def play(args, gen, params, sc, W: int, resident: bool) -> tuple[list[list[int]], SlotTurns]:
  """Every episode's final context, and the sampler (its counters)."""
  rng = np.random.default_rng(0)
  ctx = [rng.integers(1, V, args.prompt).tolist() for _ in range(args.episodes)]
  turns = SlotTurns(gen, W, slots=args.slots, chunk=args.chunk, resident=resident)
  rows = list(range(args.episodes))
  for t in range(args.turns):
    out = turns.turn(params, 0, rows, ctx, jax.random.fold_in(jax.random.key(1), t), sc)
    for b in rows:
      ctx[b] = ctx[b] + out["tokens_BN"][b, :out["lengths_B"][b]].tolist()
      if t + 1 < args.turns:
        ctx[b] = ctx[b] + rng.integers(1, V, args.obs).tolist()
  return ctx, turns


def measure(args) -> dict:
  gen, params, sc, W = setup(args)
  best = {False: float("inf"), True: float("inf")}
  got = {}
  for r in range(args.rounds + 1):  # round 0 compiles
    for resident in (False, True):
      t0 = time.perf_counter()
      got[resident] = play(args, gen, params, sc, W, resident)
      if r:
        best[resident] = min(best[resident], time.perf_counter() - t0)
  res = got[True][1]
  return {"reprefill_s": best[False], "resident_s": best[True], "speedup": best[False] / best[True],
          "identical": got[False][0] == got[True][0], "resumed": res.resumed, "prefills": res.prefills,
          "reprefill_prefills": got[False][1].prefills, "width": W,
          "turns": args.turns * args.episodes}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--episodes", type=int, default=16)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--turns", type=int, default=6)
  p.add_argument("--turn-tokens", type=int, default=32)
  p.add_argument("--obs", type=int, default=64)
  p.add_argument("--prompt", type=int, default=256)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--chunk", type=int, default=8)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--markdown", default=None)
  args = p.parse_args(argv)
  head = run_header()
  m = measure(args)
  body = (f"{args.episodes} episodes × {args.turns} turns through {args.slots} slots (chunk {args.chunk}), "
          f"{args.turn_tokens} tokens + {args.obs} observation ids a turn after a {args.prompt}-id prompt "
          f"(W = {m['width']}), d_model {args.d_model}, {args.layers} layers, V = {V}; best of {args.rounds}.\n\n"
          "| turns | seconds per batch | prefill calls | turns resumed |\n|---|---|---|---|\n"
          f"| re-prefilled | {m['reprefill_s']:.2f} | {m['reprefill_prefills']} | 0 |\n"
          f"| resident | {m['resident_s']:.2f} ({m['speedup']:.2f}×) | {m['prefills']} | {m['resumed']} of "
          f"{m['turns']} |\n\nSame tokens: {'yes' if m['identical'] else 'no (a near tie flipped)'}.")
  write_profile(args.markdown, "Resident episode turns", "bench.resident_turns", argv, head, body)


if __name__ == "__main__":
  main()
