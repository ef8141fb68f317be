"""On-policy distillation utilities: teacher top-k caches, OPD schedulers, context-compression replays.

Pure functions; any carried state is an explicit argument and return value. Modules:
  topk_cache     teacher top-k ids / log-probs / residual log-mass, built in T-chunks
  adwin          ADWIN adaptive prefix horizon ([GUESS] reconstruction)
  mopd           Open-MOPD multi-teacher routing, token-share balancing, gap-following, reward refresh
  memory_walker  exact replays of rollouts with context eviction (LogitTree, packed 4D mask)
  drafter        a speculative-decoding drafter of its own, distilled on recent rollouts (ReSpec)
"""
