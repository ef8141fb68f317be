"""Weight-only int8 sampler weights: exact round-trip golden values and a real, measured mismatch."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.rollout.param_store import ParamStore
from jaxrl_llm.sampling.quantize import int8_weight_only, quantize_dequantize_int8


def test_round_trip_golden():
  w = jnp.array([[0.5, -1.0], [0.25, 2.0], [-0.127, 0.3]], jnp.float32)  # [in=3, out=2]
  q = np.asarray(quantize_dequantize_int8(w, 0))
  s = np.array([0.5, 2.0]) / 127.0  # per output column: max |w| over inputs
  want = np.clip(np.round(np.asarray(w) / s), -127, 127) * s
  np.testing.assert_allclose(q, want, rtol=0, atol=1e-7)
  assert np.abs(q - np.asarray(w)).max() <= s.max() / 2 + 1e-7
  assert q[1, 1] == np.float32(2.0)  # the channel maximum is exact


def test_store_publishes_quantised_weights_and_keeps_learner_copy():
  cfg = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32)
  p = init_params(cfg, jax.random.key(0))
  store = ParamStore(keep_learner_copy=True, sampler_transform=int8_weight_only)
  store.publish(p)
  snap = store.acquire()
  assert not np.array_equal(snap.params["layers"]["wq"], p["layers"]["wq"])  # a real mismatch
  np.testing.assert_array_equal(snap.params["embed"], p["embed"])  # embeddings untouched
  np.testing.assert_array_equal(snap.learner_params["layers"]["wq"], p["layers"]["wq"])
  rel = np.abs(np.asarray(snap.params["layers"]["w_up"]) - np.asarray(p["layers"]["w_up"])).max() / np.abs(p["layers"]["w_up"]).max()
  assert 0 < rel < 1 / 127
