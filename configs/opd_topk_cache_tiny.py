"""The teacher's top-k cache under staleness on the tiny OPD run: replayed groups are served, not re-scored.

Run:  python -m jaxrl_llm --config=configs/opd_topk_cache_tiny.py --workdir=/tmp/opd_topk_cache_tiny

A delta over configs/opd_tiny.py: the top-k loss (opd_topk_kl, which reads teacher_topk_ids_BNk /
teacher_topk_logp_BNk), lagged rollouts (fixed_lag, lag 1) with experience replay (8 groups, 2 fresh
prompts a step, unlimited reuse), and `distill.topk_cache` on (fields: jaxrl_llm/distill/extras.py).
The teacher scores a row (ids, log-probs, residual mass: what `teacher.score_completions` returns) once;
a row seen again (a replayed group) is served from the host cache, keyed by its content. Metrics:
topk_cache_hits / topk_cache_misses (rows served / scored this step), topk_cache_rows (rows held).

Nothing here is a guess: a frozen teacher scores a row the same way each time, so the cache changes
the cost, not the supervision (up to the rounding of the scored batch's shape). The cache is not
checkpointed: a resumed run scores its rows again.
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("opd_tiny.py"))
  c.loss.name = "opd_topk_kl"
  c.rollout.mode = "fixed_lag"
  c.rollout.lag = 1
  c.rollout.replay.capacity = 8  # groups
  c.rollout.replay.fresh_per_step = 2  # prompts per sampler call: half of each batch is replayed
  c.distill.topk_cache = ml_collections.ConfigDict({
      "enabled": True,  # serve a row the teacher scored before from the host cache instead of re-scoring it
      "capacity": 4096,  # rows held (the least recently used leave first)
  })
  return c
