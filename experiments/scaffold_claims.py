"""Claims of the two training-time scaffolds: ECHO's co-evolving critic and Pats' evidence cards, each against GRPO.

ECHO (cascaded rollouts: an attempt, G critic diagnoses, G refinements; dual-track GRPO) claims higher task success
than critic-free RL; Pats (evidence cards from rollout groups, shown in later rollouts and retired as the policy
improves) claims to improve over its RLVR baseline. Both are measured on the default model from its seed's SFT warm
start (`configs/default.py`, 250 steps, each run its own: the same parameters for every cell of a seed), lag 0,
8 prompts × 8 rows per step, the held-out accuracy greedy and without any scaffold (no critique, no card): what the
policy learnt. ECHO runs on 2-digit addition with partial credit (a wrong answer earns up to 0.5 for digits in
place, so a refinement can improve on its attempt by degrees); Pats on one-digit addition after a 30-step warm start
(a weak policy), whose 80 training prompts recur, so cards are seen again. The batch keeps its
rows: an ECHO step holds half the tasks of a GRPO step (each a critic group and a policy group). Claims compare per
seed (`experiments/report.py`).

    python -m experiments.scaffold_claims           # CI-sized (≈20 min on 2 idle cores)
    python -m experiments.scaffold_claims --full

Writes experiments/results/scaffold_claims.json; `python -m experiments.report` renders it.
"""

from __future__ import annotations

from experiments import common

BASE_CONFIG = "default"
FIXED = {"rollout.prompts_per_step": 8, "eval.num_prompts": 100}
# Pats' premise is a weak policy failing on tasks it meets again: one-digit addition (100 prompts, 20 held out, so
# the 80 others recur every ~10 steps) after a 30-step SFT warm start (one-digit multiplication after the full 250
# was solved at once: training reward 0.998, a card on < 1 % of the rows, nothing to compare)
_ONE_DIGIT = {"task.kwargs.num_digits": 1, "task.kwargs.ops": "+", "task.held_out": 20, "sft.steps": 30}
_ADD = {"task.kwargs.partial_credit": True}  # graded rewards: a refinement can improve on its attempt by a digit
CELLS = {
    "grpo": dict(_ADD),
    "echo": {**_ADD, "rollout.echo.on": True},
    "grpo_1digit": dict(_ONE_DIGIT),
    "pats": {**_ONE_DIGIT, "rollout.pats.on": True},
}
# (claim, source, cell a, cell b, rule, options): rules and options in `report.cell_claims`.
CLAIMS = [
    ("ECHO's co-evolving critic raises task success over GRPO", "ECHO (seed abstract)", "echo", "grpo", "exceeds",
     {"learns": "grpo"}),
    ("Pats' evidence-card scaffold improves over its RLVR baseline", "Pats (seed abstract)", "pats", "grpo_1digit",
     "exceeds", {"learns": "grpo_1digit"}),
]
SETTINGS = {
    # 500 steps: one-digit addition's GRPO after its 30-step warm start does not learn in 150 (0.170 -> 0.183)
    "ci": {"steps": 500, "eval_every": 50, "seeds": 5},
    "full": {"steps": 1000, "eval_every": 100, "seeds": 10},
}


def main(argv=None) -> str:
  # the mechanisms' own metrics, early and late in each run: does the refinement gain rise, do cards help
  return common.cell_grid("scaffold_claims", __doc__.splitlines()[0], argv, CELLS, CLAIMS, SETTINGS, FIXED,
                          base=BASE_CONFIG, sft_flag=True, after=common.metric_thirds(("echo_", "pats_")))


if __name__ == "__main__":
  print(main())
