"""Cost of the math-verify reward per batch: thread lanes against killable worker processes.

`python -m bench.reward_executor` scores a GSM8K/MATH-like batch (`--batch` completions, half of them
compared symbolically by math-verify, e.g. `\\frac{1}{2}` against `0.5`) with `reward.executor=thread`
and `=process`, `--repeats` times each, and prints the best and median seconds per batch; the first
process batch (worker start-up: imports of sympy and math-verify) is reported on its own. Also the time
of one batch whose reference answer is `10^{10^{10^{10}}}` (bounded before sympy evaluates it).
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxrl_llm.tasks import math_answer, reward as reward_lib


def _batch(n: int) -> list[tuple[str, str, str]]:
  pairs = [("\\frac{1}{2}", "so the answer is \\boxed{0.5}"), ("72", "#### 72 dollars"),
           ("2\\sqrt{3}", "Answer: $\\sqrt{12}$"), ("-3", "x = -3")]
  return [("p", *pairs[i % len(pairs)]) for i in range(n)]


def _time(fn, args, policy, repeats: int) -> list[float]:
  out = []
  for _ in range(repeats):
    t = time.perf_counter()
    rb = reward_lib.score_batch(fn, args, policy)
    out.append(time.perf_counter() - t)
    assert rb.counts["ok"] == len(args), rb.counts
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--workers", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=5)
  a = ap.parse_args()
  fn, args = math_answer.MathReward(5.0), _batch(a.batch)
  fn("p", "1", "\\boxed{1/1}")  # sympy and math-verify imported in this process before any timing
  for executor in ("thread", "process"):
    policy = reward_lib.RewardPolicy(executor=executor, workers=a.workers)
    first = _time(fn, args, policy, 1)[0]
    ts = _time(fn, args, policy, a.repeats)
    print(f"{executor:8s} batch {a.batch}, {a.workers} workers: first {first:.3f} s, then best {min(ts):.4f} s, "
          f"median {statistics.median(ts):.4f} s")
  tower = [("p", "10^{10^{10^{10}}}", "the answer is 7")] * a.batch
  for executor in ("thread", "process"):
    ts = _time(fn, tower, reward_lib.RewardPolicy(executor=executor, workers=a.workers), a.repeats)
    print(f"{executor:8s} batch {a.batch} against 10^{{10^{{10^{{10}}}}}}: best {min(ts):.4f} s")


if __name__ == "__main__":
  main()
