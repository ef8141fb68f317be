"""The learner's gather of π_θ at the rollout's candidates (μ's top-k, Monte-Carlo draws, a teacher's top-k):
values and gradients equal an independent full-logits computation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import learner, losses
from jaxrl_llm.losses import core
from jaxrl_llm.models import ModelConfig, forward, init_params
from jaxrl_llm.record import Rollout
from jaxrl_llm.sampling import SamplerConfig, generate

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
B, P, N, K, J, KT = 4, 5, 5, 6, 4, 3
T = 0.8
PARAMS = init_params(CFG, jax.random.key(0))


def _w(ids, i):
  """Fixed pseudo-random weights of each gathered entry, a function of its id and slot (so they follow the rows
  into micro-batches)."""
  return jnp.sin(0.37 * ids + 1.3 * jnp.arange(ids.shape[-1])[None, None, :] + i)


@dataclasses.dataclass(frozen=True)
class _Hp:
  pass


def _probe(inputs, hp):
  """A loss of the gathered log-probs only (random weights: a value that names each entry)."""
  del hp
  m = inputs.mask_BN
  a = (inputs.topk_logp_BNk * _w(inputs.behavior_topk_ids_BNk, 0)).sum(-1)
  b = (inputs.mc_logp_BNJ * _w(inputs.mc_ids_BNJ, 1)).sum(-1)
  c = (inputs.student_topk_logp_BNk * _w(inputs.teacher_topk_ids_BNk, 2)).sum(-1)
  return core.apply_mask(a + b + c, m), {"probe_a": core.metric(a, m), "probe_b": core.metric(b, m),
                                         "probe_c": core.metric(c, m)}


@pytest.fixture(scope="module")
def probe():
  losses.registry.register("_probe_gather", _probe, _Hp, needs=("behavior_topk", "mc", "student_topk"))
  yield "_probe_gather"
  losses.registry.unregister("_probe_gather")


def _batch():
  sc = SamplerConfig(max_new_tokens=N, temperature=T, behavior_topk=K, mc_samples=J)
  prompts = jax.random.randint(jax.random.key(1), (B, P), 4, 32)
  out = jax.tree.map(np.asarray, generate(PARAMS, prompts, jnp.array([5, 3, 4, 2]), jax.random.key(2), CFG, sc))
  teacher_ids = np.asarray(jax.random.randint(jax.random.key(3), (B, N, KT), 0, 32), np.int32)
  return Rollout(sequence_BT=out["sequence_BT"], positions_BT=out["positions_BT"], segment_ids_BT=out["segment_ids_BT"],
                 mask_BN=out["mask_BN"], behavior_logp_BN=out["behavior_logp_BN"],
                 versions_BN=np.zeros((B, N), np.int32), adv_BN=np.zeros((B, N), np.float32),
                 lag_B=np.zeros((B,), np.int32), behavior_topk_ids_BNk=out["behavior_topk_ids_BNk"],
                 behavior_topk_logp_BNk=out["behavior_topk_logp_BNk"], mc_ids_BNJ=out["mc_ids_BNJ"],
                 mc_behavior_logp_BNJ=out["mc_behavior_logp_BNJ"],
                 extra={"teacher_topk_ids_BNk": teacher_ids, "mc_teacher_logp_BNJ": np.zeros((B, N, J), np.float32)})


def _independent(params, batch):
  """(loss, (a, b, c) metrics) from full [B, N, V] logits: log_softmax(logits / T) gathered at the ids."""
  logits = forward(params, jnp.asarray(batch.sequence_BT[:, :-1]), CFG,
                   positions_BT=jnp.asarray(batch.positions_BT[:, :-1]),
                   segment_ids_BT=jnp.asarray(batch.segment_ids_BT[:, :-1]))[:, P - 1:]
  lp = jax.nn.log_softmax(logits / T, axis=-1)
  at = lambda ids: jnp.take_along_axis(lp, jnp.asarray(ids), axis=-1)
  m = jnp.asarray(batch.mask_BN)
  a = (at(batch.behavior_topk_ids_BNk) * _w(batch.behavior_topk_ids_BNk, 0)).sum(-1)
  b = (at(batch.mc_ids_BNJ) * _w(batch.mc_ids_BNJ, 1)).sum(-1)
  t = batch.extra["teacher_topk_ids_BNk"]
  c = (at(t) * _w(t, 2)).sum(-1)
  mean = lambda x: (x * m).sum() / m.sum()
  return mean(a + b + c), (mean(a), mean(b), mean(c))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_gathered_logprobs_and_their_gradient_equal_full_logits(probe, grad_accum):
  batch = _batch()
  assert batch.mask_BN.sum() > B
  (want, (a, b, c)), grads = jax.value_and_grad(_independent, has_aux=True)(PARAMS, batch)
  want_norm = float(np.sqrt(sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(grads))))
  tx = learner.make_optimizer(1e-3, grad_clip=0.0)
  step = learner.make_train_step(CFG, tx, probe, temperature=T, agg_mode="token-mean", grad_accum=grad_accum)
  state = learner.init_state(jax.tree.map(jnp.array, PARAMS), tx)
  _, m = step(state, batch, jax.random.key(0))
  for name, v in (("probe_a", a), ("probe_b", b), ("probe_c", c), ("loss", want)):
    np.testing.assert_allclose(float(m[name]), float(v), rtol=1e-5, atol=1e-5, err_msg=name)
  assert want_norm > 0
  np.testing.assert_allclose(float(m["grad_norm"]), want_norm, rtol=1e-4)


def test_a_loss_that_needs_candidates_the_batch_lacks_is_refused(probe):
  batch = _batch().replace(mc_ids_BNJ=None)
  tx = learner.make_optimizer(1e-3)
  step = learner.make_train_step(CFG, tx, probe, temperature=T)
  with pytest.raises(ValueError, match="needs \\['mc'\\]"):
    step(learner.init_state(jax.tree.map(jnp.array, PARAMS), tx), batch, jax.random.key(0))
