"""Speculative decoding vs plain decode, measured in the same run: tokens/s, acceptance, speedup.

  python -m bench.speculative                                   # toy model M and (if present) SmolLM2-135M-Instruct
  python -m bench.speculative --models smollm2 --batches 1,4 --gammas 2,4 --draft-layers 8 --new-tokens 32
  python -m bench.speculative --models smollm2 --drafter distilled --distill-steps 200 --distill-lr 1e-4
  python -m bench.speculative --models smollm2 --drafter head --distill-steps 80 --distill-inner 4 --distill-lr 1e-3 \
      --layouts min

Each row times one whole `generate` call (prefill + decode, best of `--repeats` after a warm-up) of `B` prompts and
N new tokens with stopping disabled (every row decodes all N tokens, so both sides emit the same count):
plain `sampling.generate` against `sampling.speculative.generate` with the policy's first k layers as the drafter
(its own prefill included), with each `--layouts` way of sharing the cache index. The toy model is
`workloads.SAMPLER_MODEL` with random weights (its acceptance says little about a trained model); SmolLM2 runs on
chat-templated arithmetic prompts (`arithmetic_chat`, workload R's) at temperature 1, the RL setting.
Speedup = plain seconds / speculative seconds. `--prompt-sets S`: each row runs S disjoint sets of B prompts and
sums their seconds (acceptance and tokens per call: call-weighted means), for batch 1 where one prompt's N tokens
are only a handful of calls.

`--drafter distilled --distill-steps K`: the drafter is a copy of the first k layers (`distill.drafter`) distilled
for K steps before measuring, each step on a fresh batch of the model's own samples (plain decoding, temperature 1,
`--distill-batch` prompts of the same prompt set, keys the measurement never uses): the acceptance a drafter kept
fresh by ReSpec's distillation reaches on the workload (the distillation's time is not in the rows).
`--drafter head`: the same, with an EAGLE-style head on the policy's last hidden states (`sampling.head_drafter`,
fresh at init) in place of the copied layers; k is then not used. `--head-vocab K`: the head drafts over the K
tokens most frequent in its distillation batches (`sampler.spec_head_vocab`), trained on the KL restricted to them.
`--head-ttt U`: the head trains its first U drafts of a call, each from its own previous prediction (EAGLE-3's
training-time test, `sampler.spec_head_ttt`); `--head-ttt 1,4` trains one head per value on the same sampled batches
and measures each against the same plain decoding (a paired comparison).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common, workloads
from jaxrl_llm.distill import drafter as drafter_lib
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.sampling import head_drafter, speculative


def toy_model(N: int, P: int = 32):
  """(params, cfg, prompts_BP builder, pad id): model M with random weights and random prompts."""
  cfg = ModelConfig(**workloads.SAMPLER_MODEL, max_seq_len=P + N + 8)
  params = init_params(cfg, jax.random.key(0))
  prompts = lambda B, s=0: (jax.random.randint(jax.random.key(1 + s), (B, P), 4, cfg.vocab_size, jnp.int32),
                            jnp.full((B,), P, jnp.int32))
  return params, cfg, prompts, 0


def smollm2_model(N: int, model_dir: str, layer_unroll: int | None):
  """(params, cfg, prompts builder, pad id): SmolLM2 with workload R's chat-templated arithmetic prompts."""
  from jaxrl_llm.models import load_hf
  from jaxrl_llm.policy_init import tokenizer_for_checkpoint
  from jaxrl_llm.tasks import get_task
  from jaxrl_llm.tasks.encoder import Encoder, measured_width
  cfg, params = load_hf(model_dir, param_dtype="float32")
  encoder = Encoder(tokenizer_for_checkpoint(model_dir), chat_template="chat")
  task = get_task("arithmetic_chat", num_digits=2)
  examples = [task.make_example(np.random.default_rng(s)) for s in range(64)]
  P = measured_width(encoder, [ex["prompt"] for ex in examples])
  cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, P + N + 8),
                            layer_unroll=cfg.layer_unroll if layer_unroll is None else layer_unroll)
  pad = encoder.tokenizer.pad_id

  def prompts(B, s=0):  # prompt set s: examples s·B ... (s + 1)·B - 1 (64 in all)
    ids = [encoder.prompt_ids(ex["prompt"]) for ex in examples[s * B:(s + 1) * B]]
    rows = np.full((B, P), pad, np.int32)
    for b, x in enumerate(ids):
      rows[b, P - len(x):] = x
    return jnp.asarray(rows), jnp.asarray([len(x) for x in ids], jnp.int32)
  return params, cfg, prompts, pad


def distill(params, cfg: ModelConfig, prompts, pad: int, draft_layers: int, N: int, steps: int, lr: float,
            batch: int, kind: str = "distilled", inner: int = 1, vocab: int = 0,
            ttts: tuple[int, ...] = (1,)) -> list[tuple[dict, dict]]:
  """[(drafter params, info)], one per training-time test length in `ttts`: the first `draft_layers` layers copied
  (or, `kind="head"`, a fresh head) and distilled for `steps` steps, each on a fresh batch of the model's own
  samples (`batch` prompts, temperature 1) and of `inner` Adam steps (a head with `vocab` = K > 0: over its draft
  vocabulary; with a length U > 1: EAGLE-3's training-time test over U drafts). Several lengths train several heads
  from the same init on the same batches (one sampling per batch). info: the KL before and after (and the share of
  the last batch's tokens in the draft vocabulary), seconds of sampling and of each drafter's steps."""
  if kind != "head" and tuple(ttts) != (1,):
    raise SystemExit("--head-ttt: only with --drafter head")
  states = [drafter_lib.init_state(params, cfg, draft_layers, lr, kind) for _ in ttts]
  scfg = SamplerConfig(max_new_tokens=N, stop_ids=(), pad_id=pad, temperature=1.0)
  prompt_BP, len_B = prompts(batch)
  kls, secs, ms = [[] for _ in ttts], [0.0 for _ in ttts], [None for _ in ttts]
  sample_s = 0.0
  for i in range(steps):
    t0 = time.perf_counter()
    out = common.block(generate(params, prompt_BP, len_B, jax.random.fold_in(jax.random.key(3), i), cfg, scfg))
    sample_s += time.perf_counter() - t0
    for h, ttt in enumerate(ttts):
      t0 = time.perf_counter()
      states[h], ms[h] = common.block(drafter_lib.distill_step(
          states[h], params, out["sequence_BT"], out["positions_BT"], out["segment_ids_BT"], out["mask_BN"],
          jnp.zeros((batch,)), model_cfg=cfg, temperature=1.0, lr=lr, steps=inner, vocab=vocab, ttt=ttt))
      secs[h] += time.perf_counter() - t0
      kls[h].append(float(ms[h]["spec_drafter_kl"]))
    if i % max(1, steps // 10) == 0 or i == steps - 1:
      print(json.dumps({"distill_step": i, "kl": [round(k[-1], 4) for k in kls],
                        **({"vocab_hit": round(float(ms[0]["spec_head_vocab_hit"]), 4)} if vocab else {})}),
            flush=True)
  got = []
  for h, ttt in enumerate(ttts):
    hit = {"head_vocab": vocab, "head_vocab_hit": float(ms[h]["spec_head_vocab_hit"])} if vocab and steps else {}
    got.append((head_drafter.with_vocab(states[h].params, states[h].counts_V, vocab), {
        "drafter": kind, "distill_steps": steps, "distill_inner": inner, "distill_lr": lr, **hit,
        **({"head_ttt": ttt} if kind == "head" else {}),
        "distill_kl_first": kls[h][0] if steps else None, "distill_kl_last": kls[h][-1] if steps else None,
        "distill_sample_s": sample_s, "distill_s": secs[h]}))
  return got


def measure(name: str, params, cfg: ModelConfig, prompts, pad: int, batches, gammas, draft_layers: int, N: int,
            repeats: int, layouts=("min",), drafters: list[tuple[dict | None, dict | None]] = ((None, None),),
            sets: int = 1) -> list[dict]:
  """One row per (batch, γ, layout, drafter): plain and speculative seconds and tokens/s, acceptance, tokens per
  call, speedup, over `sets` disjoint prompt sets of B prompts (seconds summed, acceptance over all calls): at batch
  1 one prompt's 32 tokens are a handful of calls. `drafters`: (params, info) of each drafter (params None: the
  policy's first `draft_layers` layers, a view), measured against the same plain seconds."""
  rows = []
  scfg = SamplerConfig(max_new_tokens=N, stop_ids=(), pad_id=pad, temperature=1.0)
  key = jax.random.key(2)
  drafters = [(speculative.layers_drafter(params, cfg, draft_layers) if d is None else d, info)
              for d, info in drafters]
  for B in batches:
    sets_ = [prompts(B, s) for s in range(sets)]
    plain = sum(common.time_calls(lambda: generate(params, p_BP, l_B, key, cfg, scfg), repeats=repeats)["best_s"]
                for p_BP, l_B in sets_)
    for gamma, layout, (drafter, drafter_info) in ((g, lay, d) for g in gammas for lay in layouts for d in drafters):
      spec_s, calls, accepted, emitted = 0.0, 0, 0.0, 0.0
      for p_BP, l_B in sets_:
        run = lambda: speculative.generate(params, drafter, p_BP, l_B, key, cfg, scfg, gamma, layout)
        spec_s += common.time_calls(run, repeats=repeats)["best_s"]
        out = run()
        n = int(out["spec_calls"])
        calls, accepted = calls + n, accepted + n * float(out["spec_accept_rate"])
        emitted += n * float(out["spec_tokens_per_call"])
      rows.append({"model": name, "batch": B, "gamma": gamma, "layout": layout, "draft_layers": draft_layers,
                   "drafter": "layers", **(drafter_info or {}), "new_tokens": N, "prompt_sets": sets,
                   "plain_s": plain, "spec_s": spec_s, "plain_tokens_per_s": sets * B * N / plain,
                   "spec_tokens_per_s": sets * B * N / spec_s, "speedup": plain / spec_s,
                   "accept_rate": accepted / calls, "tokens_per_call": emitted / calls, "calls": calls})
      print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
  return rows


def table(rows: list[dict]) -> str:
  """A markdown table of the rows."""
  head = "| model | drafter | B | γ | layout | k | plain tok/s | spec tok/s | speedup | accept | tokens/call |"
  lines = [head, "|" + "---|" * 11]
  for r in rows:
    drafter = r["drafter"] if r["drafter"] == "layers" else f"{r['drafter']} ({r['distill_steps']} steps)"
    drafter += f", {r['head_vocab']} tokens" if r.get("head_vocab") else ""
    drafter += f", test {r['head_ttt']}" if r.get("head_ttt") else ""
    k = "–" if r["drafter"] == "head" else r["draft_layers"]
    lines.append(f"| {r['model']} | {drafter} | {r['batch']} | {r['gamma']} | {r['layout']} | {k} | "
                 f"{r['plain_tokens_per_s']:.1f} | "
                 f"{r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}× | {r['accept_rate']:.2f} | "
                 f"{r['tokens_per_call']:.2f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
  p.add_argument("--models", default="toy,smollm2", help="comma list of toy, smollm2 (skipped if not downloaded)")
  p.add_argument("--batches", default="1,4,16")
  p.add_argument("--gammas", default="2,4")
  p.add_argument("--layouts", default="min,rows", help="speculative.LAYOUTS to measure")
  p.add_argument("--draft-layers", type=int, default=0, help="drafter depth k (default: 1 for toy, 8 for SmolLM2)")
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--layer-unroll", type=int, default=None, help="SmolLM2's layer_unroll (default: as loaded)")
  p.add_argument("--drafter", default="layers", choices=("layers", "distilled", "head"),
                 help="layers: a view of the first k layers; distilled: a copy of them distilled first; head: an "
                      "EAGLE-style head, distilled first")
  p.add_argument("--distill-steps", type=int, default=100, help="--drafter distilled: distillation steps")
  p.add_argument("--distill-lr", type=float, default=1e-4, help="--drafter distilled: Adam learning rate")
  p.add_argument("--distill-batch", type=int, default=16, help="--drafter distilled: prompts per distillation step")
  p.add_argument("--distill-inner", type=int, default=1, help="Adam steps per distillation batch")
  p.add_argument("--head-vocab", type=int, default=0, help="--drafter head: its draft vocabulary size (0: all)")
  p.add_argument("--head-ttt", default="1", help="--drafter head: training-time test steps (1: off); a comma list "
                 "trains one head per value on the same batches, each measured against the same plain decoding")
  p.add_argument("--prompt-sets", type=int, default=1, help="disjoint prompt sets of B prompts each row runs")
  p.add_argument("--out", default=None, help="also write the rows as JSON here")
  p.add_argument("--markdown", default=None, help="also write the table here, the command and the machine above it")
  args = p.parse_args(argv)
  batches = [int(x) for x in args.batches.split(",")]
  gammas = [int(x) for x in args.gammas.split(",")]
  rows, head = [], common.run_header()  # the commit and date of the code that runs, read before it runs
  for name in args.models.split(","):
    if name == "toy":
      params, cfg, prompts, pad = toy_model(args.new_tokens)
      k = args.draft_layers or 1
    elif name == "smollm2":
      from bench.grpo_real import default_model_dir
      model_dir = default_model_dir()
      if not (pathlib.Path(model_dir) / "config.json").is_file():
        print(f"skipping smollm2: no checkpoint at {model_dir} (make smollm2)")
        continue
      params, cfg, prompts, pad = smollm2_model(args.new_tokens, model_dir, args.layer_unroll)
      k = args.draft_layers or 8
    else:
      raise SystemExit(f"unknown model {name!r}")
    drafters = [(None, None)]
    if args.drafter != "layers":
      drafters = distill(params, cfg, prompts, pad, k, args.new_tokens, args.distill_steps, args.distill_lr,
                         args.distill_batch, args.drafter, args.distill_inner, args.head_vocab,
                         tuple(int(x) for x in args.head_ttt.split(",")))
    rows += measure(name, params, cfg, prompts, pad, batches, gammas, k, args.new_tokens, args.repeats,
                    tuple(args.layouts.split(",")), drafters, args.prompt_sets)
  print(f"load average at the end: {os.getloadavg()}")
  print(table(rows))
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
  if args.markdown:
    pathlib.Path(args.markdown).write_text(
        f"{common.measured_line('bench.speculative', argv, head)}\n\n{table(rows)}\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
