"""Host-side PRNG key derivation.

`jax.random.fold_in` called outside `jit` runs its primitives one eager dispatch at a time, which
costs more per call than the rest of a small model's host work per step; jitted it is a single
dispatch with the same bits. The loop, the async engine and the benchmarks derive their per-step
keys with this one.
"""

import jax

fold_in = jax.jit(jax.random.fold_in)
