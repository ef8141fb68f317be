"""On-policy distillation of multi-turn agents (configs/opd_agent_tiny.py): the teacher, trained on demonstration
episodes of the binary-search player, scores every token of an episode in its context; its log-probs equal an
independent full-vocabulary forward of the teacher at every policy token, the environment's tokens carry no loss,
and the run trains in the synchronous and the stale sources."""

import os

import jax
import numpy as np
import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import load_file
from jaxrl_llm.distill import opd
from jaxrl_llm.distill import teacher as teacher_lib
from jaxrl_llm.rollout.sources.common import sync_rollout
from test_loop import fresh_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
  return str(tmp_path_factory.mktemp("teachers"))


def load(teachers, **over):
  c = load_file(os.path.join(ROOT, "configs", "opd_agent_tiny.py"))
  c.log.tensorboard = False
  c.checkpoint.every, c.eval.every, c.num_steps = 0, 0, 2
  c.distill.teacher_cache_dir = teachers
  for k, v in over.items():
    sec, key = k.split("__")
    c[sec][key] = v
  return c


def test_teacher_scores_every_policy_token_of_an_episode_in_context(teachers):
  c = load(teachers)
  r, state, extra, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  batch, _ = loop.make_batch(r, store, state, extra, ro)
  m = np.asarray(batch.mask_BN) > 0
  turns = np.asarray(ro.turn_BN)
  assert m.any() and (~m & (np.asarray(ro.segment_ids_BT)[:, -m.shape[1]:] > 0)).any()  # env tokens: mask 0
  assert turns[m].max() >= 1  # policy tokens of later turns, after an observation
  # independent: the teacher's full-vocabulary log-softmax at every completion position of the episode rows
  cfg, params = teacher_lib.load_teacher(c, c.env.prompt_width, r.train_examples, r.model_cfg.vocab_size, r.encoder)
  logits = teacher_lib.teacher_logits(params, cfg, batch.sequence_BT, batch.positions_BT, batch.segment_ids_BT,
                                      m.shape[1])
  lp = np.asarray(jax.nn.log_softmax(logits / opd.scoring_temperature(c), axis=-1))
  want = np.take_along_axis(lp, np.asarray(batch.sequence_BT)[:, -m.shape[1]:, None], axis=-1)[..., 0]
  np.testing.assert_allclose(np.asarray(batch.extra["teacher_logp_BN"])[m], want[m], atol=2e-5)
  # the teacher learned the optimal player: its first guess after "guess:" is the middle digit far more than chance
  first = np.argmax(m, axis=1)
  p_first = np.exp(np.asarray(batch.extra["teacher_logp_BN"])[np.arange(len(first)), first])
  assert p_first.max() > 0.5


@pytest.mark.parametrize("mode", ["sync", "fixed_lag", "async"])
def test_agent_distillation_trains_in_every_source(tmp_path, teachers, mode):
  c = load(teachers, rollout__mode=mode, rollout__lag=0 if mode == "sync" else 1)
  rows = loop.run(c, str(tmp_path))
  assert len(rows) == 2 and all(r["grad_norm"] > 0 and np.isfinite(r["opd_k1"]) and r["opd_k1"] > 0 for r in rows)
  assert all(r["env_turns_mean"] >= 1 for r in rows)


@pytest.mark.parametrize("slots", [0, 4])
def test_episode_records_of_mu_sit_at_the_policy_tokens(teachers, slots):
  """With sampler.behavior_topk / mc_samples an episode records μ's candidates at every policy token (from the kept
  cache, or the slot engine), and nothing at the environment's tokens."""
  c = load(teachers, sampler__behavior_topk=3, sampler__mc_samples=2, rollout__slots=slots)
  r, state, extra, store = fresh_run(c)
  ro = sync_rollout(r.ctx, store, [0], 0, 0)[0]
  m = ro.mask_BN > 0
  tokens = ro.sequence_BT[:, -m.shape[1]:]
  np.testing.assert_array_equal(ro.mc_ids_BNJ[..., 0][m], tokens[m])  # candidate 0 is the sampled token
  np.testing.assert_allclose(ro.mc_behavior_logp_BNJ[..., 0][m], ro.behavior_logp_BN[m], atol=1e-6)
  assert (ro.behavior_topk_logp_BNk[..., 0][m] >= ro.behavior_logp_BN[m] - 1e-5).all()  # top-1 is the likeliest
  assert (ro.mc_ids_BNJ[~m] == c.sampler.get("pad_id", 0)).all() and (ro.behavior_topk_logp_BNk[~m] == 0).all()
  assert (np.asarray(ro.turn_BN)[m] >= 1).any()  # later turns recorded too


def test_agent_distillation_with_the_monte_carlo_estimator(tmp_path, teachers):
  """AsyncOPD's MC reverse KL on agent episodes: the teacher scores the recorded candidates in each episode."""
  c = load(teachers, sampler__mc_samples=3, loss__name="opd_reverse_kl_mc")
  rows = loop.run(c, str(tmp_path))
  assert all(r["grad_norm"] > 0 and np.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("drafter", ["layers", "distilled"])
def test_speculative_decoding_of_episode_turns(tmp_path, drafter):
  """Episode turns speculate (re-prefilled turns through `generate`'s draft-and-verify); μ stays the policy's."""
  from jaxrl_llm.config import load_file
  c = load_file(os.path.join(ROOT, "configs", "agent_tiny.py"))
  c.log.tensorboard, c.checkpoint.every, c.num_steps, c.loss.entropy_coef = False, 0, 2, 0.01
  c.model.n_layers = 2
  c.sampler.update({"spec_gamma": 2, "spec_draft_layers": 1, "spec_drafter": drafter})
  rows = loop.run(c, str(tmp_path))
  assert all(0 <= r["spec_accept_rate"] <= 1 and r["mismatch_abs_max"] < 1e-5 and r["grad_norm"] > 0 for r in rows)
  assert all(r["env_turns_mean"] > 1 for r in rows)  # later turns, after observations, speculated too
  if drafter == "distilled":
    assert all(r["spec_drafter_kl"] > 0 for r in rows)
