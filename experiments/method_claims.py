"""Seed-paper claims that one pair of runs decides: SAT at lag 8 vs lag 1, Delightful PG vs IS-weighted PG under
staleness, ALP under a bf16 sampler.

Cells (`CELLS`), each trained from the SFT warm start of `configs/default.py` on 2-digit addition over seeds;
every claim (`CLAIMS`) compares two cells' held-out accuracy (late) by the rule named in it
(`experiments/report.py`: `exceeds` for "beats", `stays_within` for "as good as"), with MARGIN and 2 se.

    python -m experiments.method_claims           # CI-sized
    python -m experiments.method_claims --full

Writes experiments/results/method_claims.json; `python -m experiments.report` renders it.
"""

from __future__ import annotations

from experiments import common

BASE = {"optim.lr": 2e-4, "optim.warmup_steps": 5, "rollout.prompts_per_step": 8, "rollout.group_size": 8,
        "eval.num_prompts": 256, "rollout.old_logp": "recompute", **common.TASKS["arithmetic"]}
LAG = lambda k: {"rollout.mode": "fixed_lag", "rollout.lag": k}
CELLS = {
    "sat_lag1": {"loss.name": "sat", **LAG(1)},
    "sat_lag8": {"loss.name": "sat", **LAG(8)},
    "delightful_pg_lag8": {"loss.name": "delightful_pg", **LAG(8)},
    "tis_lag8": {"loss.name": "tis", **LAG(8)},
    "ppo_clip_bf16": {"loss.name": "ppo_clip", "rollout.mode": "sync", "sampler.dtype": "bfloat16"},
    "alp_bf16": {"loss.name": "alp", "rollout.mode": "sync", "sampler.dtype": "bfloat16"},
}
# (claim, source, cell a, cell b, rule): "exceeds" = a beats b; "within" = a is as good as b (b not above by > MARGIN)
CLAIMS = [
    ("SAT keeps its accuracy at lag 8 as at lag 1", "SAT (methods-rl)", "sat_lag8", "sat_lag1", "within"),
    ("Delightful PG beats IS-weighted PG (TIS) under staleness (lag 8; the paper has no off-policy result)",
     "Delightful PG (methods-rl §7.2)", "delightful_pg_lag8", "tis_lag8", "exceeds"),
    ("ALP beats uncorrected PPO under a bf16 sampler's mismatch", "ALP (methods-addendum §5)", "alp_bf16",
     "ppo_clip_bf16", "exceeds"),
]
SETTINGS = {
    "ci": {"steps": 100, "eval_every": 25, "seeds": 5},
    "full": {"steps": 400, "eval_every": 25, "seeds": 5},
}


def main(argv=None) -> str:
  return common.cell_grid("method_claims", __doc__.splitlines()[0], argv, CELLS, CLAIMS, SETTINGS, BASE, warm=BASE)


if __name__ == "__main__":
  print(main())
