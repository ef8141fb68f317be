"""The jitted host-side fold_in derives exactly the keys of `jax.random.fold_in`, so runs keep their bits."""

import jax
import numpy as np

from jaxrl_llm.keys import fold_in


def test_jitted_fold_in_gives_the_same_keys():
  root = jax.random.key(3)
  for data in (0, 1, 7, 12345, np.int64(42), np.int32(2**31 - 1)):
    want = jax.random.key_data(jax.random.fold_in(root, data))
    np.testing.assert_array_equal(jax.random.key_data(fold_in(root, data)), want)
  # Nested, as the loop derives a rollout key from (version, step).
  np.testing.assert_array_equal(jax.random.key_data(fold_in(fold_in(root, 2), 5)),
                                jax.random.key_data(jax.random.fold_in(jax.random.fold_in(root, 2), 5)))
