"""What one speculative call costs against one plain decode step, on the real model: the ceiling of the speed-up.

  python -m bench.spec_cost                                  # SmolLM2 (`make smollm2` first), batch 1
  python -m bench.spec_cost --batch 4 --gammas 2,3,4 --markdown bench/profiles/speculative_call_cost.md

A speculative call verifies γ drafts in one policy forward of γ + 1 tokens per row, so its cost against a plain step
sets what a drafter must reach: speculation pays when a call emits more tokens than it costs plain steps. Measured
here, in the same process, with stopping disabled (every row decodes all N tokens):
  - a plain decode step at each width R (`--rows`): (time of `generate` with N new tokens − time with 1) / (N − 1),
    for batch·R rows, the width a verification call's forward has at γ = R − 1;
  - a speculative call at each γ, with a fresh head drafter (`sampling.head_drafter`, the `--head-vocab` most
    frequent token ids of no counts: ids 0 .. K − 1): it rarely agrees with the policy, so every call emits one
    token and the call count is N − 1; (time − the 1-token time) / calls. What the call does is the same for a
    trained head: its cost does not depend on what is accepted.
The table's last column, call / plain step, is the break-even in tokens per call; `python -m bench.speculative`
measures what a trained head reaches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from bench import common
from jaxrl_llm.sampling import SamplerConfig, generate, head_drafter, speculative


def _per_step(fn_n, fn_1, steps: int, repeats: int) -> float:
  """Seconds per step beyond the first token: (best time of fn_n − best of fn_1) / steps."""
  t_n = common.time_calls(fn_n, repeats=repeats)["best_s"]
  t_1 = common.time_calls(fn_1, repeats=repeats)["best_s"]
  return (t_n - t_1) / steps


def measure(model_dir: str, batch: int, rows: tuple[int, ...], gammas: tuple[int, ...], N: int, head_vocab: int,
            repeats: int) -> list[dict]:
  """One row per plain width R and per γ: milliseconds per step / call and the ratio to the plain step at `batch`."""
  from bench.speculative import smollm2_model
  params, cfg, prompts, pad = smollm2_model(N, model_dir, None)
  scfg = SamplerConfig(max_new_tokens=N, stop_ids=(), pad_id=pad, temperature=1.0)
  one = dataclasses.replace(scfg, max_new_tokens=1)
  key = jax.random.key(0)
  out = []
  for R in sorted(set(rows) | {1}):
    p_BP, l_B = (jnp.repeat(x, R, axis=0) for x in prompts(batch, 0))  # batch·R rows
    s = _per_step(lambda: generate(params, p_BP, l_B, key, cfg, scfg),
                  lambda: generate(params, p_BP, l_B, key, cfg, one), N - 1, repeats)
    out.append({"what": f"plain step, {batch * R} row(s)", "rows": batch * R, "ms": 1e3 * s})
  plain = out[0]["ms"]
  head = head_drafter.init_head(cfg, jax.random.key(5))
  if head_vocab:  # no counts: ids 0 .. K - 1 (`top_vocab`'s ties)
    head = head_drafter.with_vocab(head, jnp.zeros((cfg.vocab_size,), jnp.float32), head_vocab)
  p_BP, l_B = prompts(batch, 0)
  for g in gammas:
    run = lambda n: speculative.generate(params, head, p_BP, l_B, key, cfg,
                                         dataclasses.replace(scfg, max_new_tokens=n), g, "rows")
    calls = int(run(N)["spec_calls"])
    s = _per_step(lambda: run(N), lambda: run(1), calls, repeats)
    out.append({"what": f"speculative call, γ = {g}", "rows": batch * (g + 1), "ms": 1e3 * s, "calls": calls})
  for r in out:
    r["over_plain"] = r["ms"] / plain
  return out


def table(rows: list[dict]) -> str:
  lines = ["| what | rows in the forward | ms | / plain step |", "|---|---|---|---|"]
  lines += [f"| {r['what']} | {r['rows']} | {r['ms']:.2f} | {r['over_plain']:.2f} |" for r in rows]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=None, help="a Hugging Face folder (default: the imported SmolLM2)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--rows", default="1,2,4,8", help="plain step widths, in multiples of --batch")
  p.add_argument("--gammas", default="2,3,4")
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--head-vocab", type=int, default=4096, help="the head's draft vocabulary (0: all)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--markdown", default=None, help="also write the table here, the command and the machine above it")
  a = p.parse_args(argv)
  if a.new_tokens < 2 or a.batch < 1 or a.repeats < 1:
    raise SystemExit(f"--new-tokens >= 2, --batch >= 1, --repeats >= 1 (got {a.new_tokens}, {a.batch}, {a.repeats})")
  from bench.grpo_real import default_model_dir
  head = common.run_header()
  rows = measure(a.model or default_model_dir(), a.batch, tuple(int(x) for x in a.rows.split(",")),
                 tuple(int(x) for x in a.gammas.split(",")), a.new_tokens, a.head_vocab, a.repeats)
  print(json.dumps(rows))
  common.write_profile(a.markdown, f"A speculative call against a plain decode step (batch {a.batch}, head vocabulary "
                       f"{a.head_vocab})", "bench.spec_cost", argv, head, table(rows))
  return 0


if __name__ == "__main__":
  from jaxrl_llm import hugepages
  hugepages.reexec_with_huge_pages()  # with JAXRL_LLM_HUGE_PAGES=1, as the CLI
  raise SystemExit(main())
