"""The shared shape check of every loss call (`losses.check_shapes`, run by `losses.check_needs`)."""

import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm import losses
from jaxrl_llm.types import LossInputs
from jaxrl_llm.vocab_chunks import VocabHead

B, N, k, J, V, D = 3, 5, 4, 2, 7, 6


def _inputs() -> LossInputs:
  """Every shape-checked field present, at consistent shapes."""
  z = lambda *s: jnp.zeros(s, jnp.float32)
  i = lambda *s: jnp.zeros(s, jnp.int32)
  return LossInputs(
      logp_BN=z(B, N), mask_BN=z(B, N), adv_BN=z(B, N), prox_logp_BN=z(B, N), behavior_logp_BN=z(B, N),
      ref_logp_BN=z(B, N), entropy_BN=z(B, N), versions_BN=i(B, N), current_version=jnp.int32(2), lag_B=i(B),
      behavior_topk_ids_BNk=i(B, N, k), behavior_topk_logp_BNk=z(B, N, k), topk_logp_BNk=z(B, N, k),
      turn_BN=i(B, N), teacher_logp_BN=z(B, N), teacher_topk_ids_BNk=i(B, N, k + 1),
      teacher_topk_logp_BNk=z(B, N, k + 1), tokens_BN=i(B, N), student_logits_BNV=z(B, N, V),
      teacher_logits_BNV=z(B, N, V), student_head=VocabHead(z(B, N, D), z(D, V)),
      teacher_head=VocabHead(z(B, N, D + 2), z(D + 2, V)), student_topk_logp_BNk=z(B, N, k + 1),
      teacher_ref_topk_logp_BNk=z(B, N, k + 1), mc_ids_BNJ=i(B, N, J), mc_logp_BNJ=z(B, N, J),
      mc_behavior_logp_BNJ=z(B, N, J), mc_teacher_logp_BNJ=z(B, N, J), sup_drift_B=z(B),
      eviction_mask_BN=z(B, N))


def test_consistent_shapes_pass_eagerly_and_under_jit():
  inputs = _inputs()
  losses.check_shapes(inputs)
  losses.check_shapes(LossInputs(logp_BN=jnp.zeros((B, N)), mask_BN=jnp.ones((B, N)), adv_BN=jnp.zeros((B, N))))

  @jax.jit
  def f(x):
    losses.check_shapes(x)
    return x.logp_BN.sum()

  f(inputs)


@pytest.mark.parametrize("field, value", [
    ("logp_BN", jnp.zeros((B, N, 1))),  # rank 3
    ("mask_BN", jnp.zeros((B, N + 1))),
    ("adv_BN", jnp.zeros((B,))),  # a sequence advantage not broadcast over the tokens
    ("prox_logp_BN", jnp.zeros((B + 1, N))),
    ("versions_BN", jnp.zeros((N, B), jnp.int32)),
    ("eviction_mask_BN", jnp.zeros((B, N - 1))),
    ("lag_B", jnp.zeros((B, 1), jnp.int32)),
    ("sup_drift_B", jnp.zeros((B + 1,))),
    ("current_version", jnp.zeros((1,), jnp.int32)),
    ("behavior_topk_logp_BNk", jnp.zeros((B, N, k + 1))),  # k differs from behavior_topk_ids_BNk
    ("topk_logp_BNk", jnp.zeros((B, N))),  # rank 2
    ("student_topk_logp_BNk", jnp.zeros((B, N, k))),  # k differs from teacher_topk_ids_BNk
    ("teacher_topk_ids_BNk", jnp.zeros((B, N - 1, k + 1), jnp.int32)),
    ("mc_teacher_logp_BNJ", jnp.zeros((B, N, J + 1))),
    ("teacher_logits_BNV", jnp.zeros((B, N, V - 1))),
])
def test_a_wrong_shape_names_its_field(field, value):
  with pytest.raises(ValueError, match=rf"LossInputs\.{field} has shape"):
    losses.check_shapes(_inputs().replace(**{field: value}))


def test_a_vocab_head_is_checked():
  bad = VocabHead(jnp.zeros((B, N + 1, D)), jnp.zeros((D, V)))
  with pytest.raises(ValueError, match=r"LossInputs\.teacher_head\.hidden_BND has shape \(3, 6, 6\)"):
    losses.check_shapes(_inputs().replace(teacher_head=bad))
  bad = VocabHead(jnp.zeros((B, N, D)), jnp.zeros((D + 1, V)))
  with pytest.raises(ValueError, match=r"LossInputs\.student_head\.w_DV"):
    losses.check_shapes(_inputs().replace(student_head=bad))


def test_check_needs_runs_the_shape_check_under_jit():
  """The learner's entry (`check_needs` then `spec.fn`) raises at trace time, naming the field."""
  spec = losses.get("ppo_clip")
  inputs = _inputs().replace(prox_logp_BN=jnp.zeros((B, N + 2)))

  @jax.jit
  def step(x):
    losses.check_needs(spec, x)
    return spec.fn(x, spec.Hparams())[0].sum()

  with pytest.raises(ValueError, match=r"LossInputs\.prox_logp_BN has shape \(3, 7\), expected \[B, N\] = \(3, 5\)"):
    step(inputs)
  step(_inputs())
