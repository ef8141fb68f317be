"""MoE routing replay off-policy: no replay, R3 (the sampler's expert ids) and R2 (the learner's own step-start ids).

The tiny policy with an MoE MLP (4 experts, top-2; the run's own SFT warm start of 500 steps,
`configs/default.py`, 2-digit addition) is sampled in bfloat16 while the learner runs in float32, so some routing decisions differ between
sampler and learner (a real gap, measured by `tests/test_moe.py`), and trained with `ppo_clip` at fixed lag 0 and
8 with 2 minibatches per step (so R2's replay has updates to act on). Per run: held-out accuracy (late),
the training reward of the last fifth of the steps, and the mean |log π_old − log μ| (`mismatch_abs_mean`:
what replay is meant to shrink).

Claims decided (`experiments/report.py`, `routing_replay_section`): routing replay is needed off-policy (R3 vs
none at lag 8; R3 paper, arXiv 2510.11370), Qwen's finding that R2 does better at low off-policiness and R3
at high (lag 0 vs lag 8), and PR2's (arXiv 2606.00395): routing with routers predicted `lag` updates ahead
(`jaxrl_llm/route_predictor.py`) beats R3 at lag 8 and brings μ closer to the policy it trains (KL(μ ‖ π_θ)).

    python -m experiments.routing_replay           # CI-sized
    python -m experiments.routing_replay --full

Writes experiments/results/routing_replay.json; `python -m experiments.report` renders it.
"""

from __future__ import annotations

from experiments import common

BASE = {"optim.lr": 2e-4, "optim.warmup_steps": 5, "rollout.prompts_per_step": 8, "rollout.group_size": 8,
        "eval.num_prompts": 256, "rollout.mode": "fixed_lag", "rollout.old_logp": "recompute",
        "loss.name": "ppo_clip", "optim.minibatches": 2, "sampler.dtype": "bfloat16", **common.TASKS["arithmetic"]}
ARCH = {"model.num_experts": 4, "model.experts_per_token": 2}  # the warm start needs the same architecture
# 500 SFT steps (not the default 250): after 250 the MoE policy starts at ~0.1 accuracy and 100 RL steps do not
# move it, so no replay claim is testable.
SFT_STEPS = 500
ARMS = {"none": {"model.routing_replay": False}, "R3": {"model.routing_replay": "R3"},
        "R2": {"model.routing_replay": "R2"}, "PR2": {"model.routing_replay": "PR2"}}
# PR2 predicts each router as many updates ahead as a sample waits at this lag (one update per step here).
ARM_AT_LAG = {"PR2": lambda lag: {"model.pr2_horizon": max(1, lag)}}
SETTINGS = {
    "ci": {"steps": 100, "eval_every": 25, "seeds": 3, "lags": [0, 8]},
    "full": {"steps": 400, "eval_every": 25, "seeds": 5, "lags": [0, 4, 16]},
}


def main(argv=None) -> str:
  p = common.base_parser(__doc__.splitlines()[0])
  p.add_argument("--arms", default="", help="comma-separated subset of none,R3,R2,PR2")
  p.add_argument("--sft-steps", type=int, default=SFT_STEPS, help="each run's SFT warm start")
  args = p.parse_args(argv)
  name, setting, seeds, steps, eval_every = common.resolve_setting(args, SETTINGS)
  arms = args.arms.split(",") if args.arms else list(ARMS)
  runs = [{"arm": a, "lag": lag, "seed": s} for s in range(seeds) for lag in setting["lags"] for a in arms]
  # Each run does its own SFT warm start (the same for every arm of a seed): an MoE policy has no Hugging Face
  # family to export a shared warm start to (`models.hf`).
  over = lambda r: {**BASE, **ARCH, **ARMS[r["arm"]], **ARM_AT_LAG.get(r["arm"], lambda _: {})(r["lag"]),
                    "rollout.lag": r["lag"], "seed": r["seed"], "num_steps": steps, "eval.every": eval_every,
                    "sft.steps": args.sft_steps}
  # Every arm of a seed runs here: arms run elsewhere (another machine, commit) start from other warm starts.
  return common.run_seeded("routing_replay", args, argv, runs, over, {
      "setting": name, "steps": steps, "seeds": seeds, "eval_every": eval_every, "base_config": args.base,
      "base_overrides": {**BASE, **ARCH, "sft.steps": args.sft_steps}, "arms": ARMS, "lags": setting["lags"]})


if __name__ == "__main__":
  print(main())
