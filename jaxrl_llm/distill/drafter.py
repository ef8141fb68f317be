"""A speculative-decoding drafter with its own weights, kept fresh by distillation on recent rollouts (ReSpec).

`sampler.spec_drafter="distilled"`: the drafter is a separate small model of the policy's architecture with
k = `sampler.spec_draft_layers` layers, initialised as copies of the policy's embedding, first k layers, final norm
and head, so at init it drafts exactly what the "layers" drafter (`speculative.layers_drafter`, a view of the
policy) drafts. After every learner step it takes `spec_distill_steps` Adam steps (`spec_distill_lr`) on that
step's rollout batch, against the new policy, minimising the token-mean forward KL

  KL(π_policy(·|prefix) ‖ π_drafter(·|prefix)) = Σ_v p(v) (log p(v) − log q(v))

over the completion tokens, full vocabulary, chunk by chunk (`losses.dense.divergence`: no [B, N, V] array at a
real vocabulary). Both distributions are taken at the sampler's temperature (the drafter drafts from its tempered
distribution); top-k / top-p truncation is not modelled. The policy gets no gradient (stop-gradient).

Reward weighting (`spec_distill_reward_weight` = α, ReSpec's "reward-weighted updates"; the paper gives no formula,
so this one is a [GUESS]): row b weighs w_b = max(0, 1 + α·(r_b − mean r) / std r) over the batch (w = 1 when every
reward is equal), so high-reward rollouts count more and, at large α, rows far below the mean drop out; α = 0 is
the unweighted loss. The loss is the w-weighted token mean Σ_bt w_b m_bt KL_bt / Σ_bt w_b m_bt.

`sampler.spec_drafter="head"`: the drafter is a head on the policy's last hidden states (`sampling.head_drafter`,
EAGLE-style), trained by the same steps on the same batches with EAGLE's objective (`head_loss`): teacher-forced
on the policy's own features, the forward KL of its next-token distribution (EAGLE's classification loss, there a
cross-entropy against the policy's soft labels: the same gradient) plus `reg_weight` times the smooth-L1 distance
of its predicted feature to the policy's (EAGLE's regression loss; EAGLE weighs the two 0.1 : 1, hence the default
reg_weight = 10 with the KL at weight 1).

A head's reduced draft vocabulary (`sampler.spec_head_vocab` = K > 0, `head_drafter.with_vocab`): the state counts
the completion tokens of every batch it was distilled on (`counts_V`, checkpointed with it), and the head drafts
over the K most frequent so far (before any batch: ids 0 .. K-1). It is trained as it drafts: the KL is the one
between the policy's and the head's distributions restricted to those K tokens and renormalised, KL(p_S ‖ q_S),
whose minimum q = p_S gives the largest acceptance rate any q on S can, p(S) (`spec_head_vocab_hit`: the share of
the batch's completion tokens inside the S it was drafted with, an estimate of it).

A head's training-time test (`sampler.spec_head_ttt` = U > 1, EAGLE-3's): a call's second and later drafts read
the head's own predicted feature, which one-step teacher forcing never trains on; `head_loss` then unrolls U drafts
per chain over its own predictions (the tokens still the sampled ones) and weighs draft u's terms 0.8^(u-1), as
EAGLE-3's `ploss_weight`. EAGLE-3 unrolls 7; the default here is 1 (off), because on SmolLM2-135M
(bench/profiles/speculative_head_ttt.md) it helped only at γ ≥ 3 (at γ = 2, the best setting at batch 4, it cost
a little acceptance), 7 did no better than 4, and the distillation steps took longer (1.4× at U = 4, 1.8× at 7).

Speculative decoding stays exact whatever the drafter (`sampling.speculative`): distillation changes the acceptance
rate, never the tokens' distribution or μ.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxrl_llm.losses import dense
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.logprobs import query_hidden
from jaxrl_llm.models.transformer import lm_head_weights
from jaxrl_llm.sampling import head_drafter, speculative
from jaxrl_llm.vocab_chunks import VocabHead

Array = jax.Array


class DrafterState(struct.PyTreeNode):
  """The distilled drafter: its parameters (embedding, k stacked layers, final norm, head; or a head drafter's),
  Adam's state and the counts of the completion tokens it was distilled on (float32 [V])."""
  params: Any
  opt_state: Any
  counts_V: Any


def init_params(policy_params: dict, model_cfg: ModelConfig, n_layers: int) -> dict:
  """Copies (own buffers, not views) of the policy's embedding, first `n_layers` layers, final norm and head (a LoRA
  policy's with its adapters merged: the drafter is a plain model)."""
  view = speculative.layers_drafter(lora.effective(policy_params), model_cfg, n_layers)
  return jax.tree.map(lambda x: jnp.array(x, copy=True), view)


def init_state(policy_params: dict, model_cfg: ModelConfig, n_layers: int, lr: float,
               kind: str = "distilled") -> DrafterState:
  """A fresh drafter and its Adam state: the policy's first layers (`init_params`), or for `kind="head"` a head
  (`head_drafter.init_head`, key 0: every run's head starts the same)."""
  if kind == "head":
    params = head_drafter.init_head(model_cfg, jax.random.key(0))
  else:
    params = init_params(policy_params, model_cfg, n_layers)
  return DrafterState(params=params, opt_state=optax.adam(lr).init(params),
                      counts_V=jnp.zeros((model_cfg.vocab_size,), jnp.float32))


def reward_weights(reward_B: Array, alpha: float) -> Array:
  """w_b = max(0, 1 + α·(r_b − mean r) / std r) ([GUESS], module docstring); 1 for every row when α = 0 or the
  rewards are all equal."""
  r_B = jnp.asarray(reward_B, jnp.float32)
  std = jnp.std(r_B)
  z_B = jnp.where(std > 0, (r_B - jnp.mean(r_B)) / jnp.where(std > 0, std, 1.0), 0.0)
  return jnp.maximum(0.0, 1.0 + alpha * z_B)


class _Heads(NamedTuple):
  """What `dense.divergence` reads: the drafter (student) and policy (teacher) as hidden states + lm-head."""
  mask_BN: Array
  student_head: VocabHead
  teacher_head: VocabHead
  student_logits_BNV: Any = None
  teacher_logits_BNV: Any = None


def _completion_head(params: dict, sequence_BT: Array, positions_BT: Array, segment_ids_BT: Array, n_new: int,
                     cfg: ModelConfig) -> VocabHead:
  """The model's next-token distributions at the last `n_new` tokens (position j: given everything before
  completion token j, the context the sampler drew it in), as hidden states + lm-head."""
  P = sequence_BT.shape[1] - n_new
  h_BND = query_hidden(params, sequence_BT[:, :-1], cfg, query_start=P - 1, positions_BT=positions_BT[:, :-1],
                       segment_ids_BT=segment_ids_BT[:, :-1])
  return VocabHead(hidden_BND=h_BND, w_DV=lm_head_weights(params, cfg))


def distill_loss(draft_params: dict, policy_params: dict, sequence_BT: Array, positions_BT: Array,
                 segment_ids_BT: Array, mask_BN: Array, weight_B: Array, model_cfg: ModelConfig,
                 temperature: float) -> Array:
  """Σ_bt w_b m_bt KL_bt / Σ_bt w_b m_bt, KL_bt = KL(π_policy ‖ π_drafter) at completion token t of row b, both at
  `temperature` (0 when every weight or mask is 0). The policy is stop-gradient: only the drafter learns."""
  N = mask_BN.shape[1]
  d_cfg = dataclasses.replace(model_cfg, n_layers=speculative.drafter_depth(draft_params))
  mask_BN = jnp.asarray(mask_BN, jnp.float32)
  teacher = _completion_head(jax.lax.stop_gradient(policy_params), sequence_BT, positions_BT, segment_ids_BT, N,
                             model_cfg)
  student = _completion_head(draft_params, sequence_BT, positions_BT, segment_ids_BT, N, d_cfg)
  kl_BN = dense.divergence(_Heads(mask_BN, student, teacher), lambda lq, lp: dense.kl_dense(lp, lq), temperature)
  wm_BN = jnp.asarray(weight_B, jnp.float32)[:, None] * mask_BN
  den = jnp.sum(wm_BN)
  return jnp.where(den > 0, jnp.sum(wm_BN * kl_BN) / jnp.where(den > 0, den, 1.0), 0.0)


def policy_features(policy_params: dict, sequence_BT: Array, positions_BT: Array, segment_ids_BT: Array, n_new: int,
                    model_cfg: ModelConfig) -> Array:
  """f_BND: the policy's final-normed hidden state before each of the last `n_new` tokens (column j: at the token
  before completion token j, the feature whose head gives token j's distribution); no gradient."""
  head = _completion_head(jax.lax.stop_gradient(lora.effective(policy_params)), sequence_BT, positions_BT,
                          segment_ids_BT, n_new, model_cfg)
  return head.hidden_BND


def head_loss(head: dict, policy_params: dict, sequence_BT: Array, positions_BT: Array, segment_ids_BT: Array,
              mask_BN: Array, weight_B: Array, model_cfg: ModelConfig, temperature: float, reg_weight: float = 10.0,
              f_BND: Array | None = None, vocab_K: Array | None = None, ttt: int = 1) -> tuple[Array, Array]:
  """(loss, KL) of a head drafter (`head_drafter`) teacher-forced on the batch as it drafts at run time: completion
  column j ≥ 1 is drafted from (feature of column j - 1, completion token j - 1), with no feature (zeros) for
  column 1, the first one a request drafts. KL: Σ w m KL(π_policy ‖ q) / Σ w m over columns 1.., both at
  `temperature`; loss = KL + `reg_weight` · the same mean of the smooth-L1 distance (β = 1, mean over D) of the
  predicted feature to the policy's. `f_BND`: `policy_features` when already computed. `vocab_K`: the head's draft
  vocabulary (`head_drafter.vocab`): both distributions restricted to it and renormalised.

  `ttt` = U > 1: EAGLE-3's training-time test. At run time the u-th draft of a call (u ≥ 2) reads the head's own
  feature predicted by draft u - 1, not the policy's; step u of the loss drafts column j from the feature step
  u - 1 predicted for column j - 1 (the same teacher-forced tokens), for the columns j ≥ u such a chain reaches
  from a real feature (or from the first call's zeros), and the loss sums the steps' terms with weights 0.8^(u-1)
  (EAGLE-3's `ploss_weight`; there a cross-entropy only, here each step's KL + regression). The gradient flows
  through the chain, as there. The KL returned is step 1's."""
  N = mask_BN.shape[1]
  if f_BND is None:
    f_BND = policy_features(policy_params, sequence_BT, positions_BT, segment_ids_BT, N, model_cfg)
  f_BND = jax.lax.stop_gradient(f_BND)
  tokens_BN = sequence_BT[:, -N:]
  feat_in_BnD = jnp.concatenate([jnp.zeros_like(f_BND[:, :1]), f_BND[:, 1:N - 1]], axis=1)
  emb_BnD = head_drafter.embed(jax.lax.stop_gradient(policy_params), tokens_BN[:, :N - 1], model_cfg)
  mask_Bn = jnp.asarray(mask_BN, jnp.float32)[:, 1:]
  w_DV = jax.lax.stop_gradient(lm_head_weights(lora.effective(policy_params), model_cfg))
  if vocab_K is not None:
    w_DV = jnp.take(w_DV, vocab_K, axis=1)
  f_next_BnD = f_BND[:, 1:]  # every step's target: the policy's feature of the drafted column
  target = VocabHead(hidden_BND=f_next_BnD, w_DV=w_DV)
  wm_Bn = jnp.asarray(weight_B, jnp.float32)[:, None] * mask_Bn
  loss, kls = 0.0, []
  for u in range(ttt):  # u = step - 1; column j = n + 1 is reached at step u + 1 when j >= u + 1
    pred_BnD = head_drafter.predict(head, feat_in_BnD, emb_BnD, model_cfg)
    wm_u_Bn = wm_Bn * (jnp.arange(N - 1) >= u)[None, :]
    heads = _Heads(mask_Bn, VocabHead(hidden_BND=pred_BnD, w_DV=w_DV), target)
    kl_Bn = dense.divergence(heads, lambda lq, lp: dense.kl_dense(lp, lq), temperature)
    reg_Bn = jnp.mean(optax.huber_loss(pred_BnD.astype(jnp.float32), f_next_BnD.astype(jnp.float32)), axis=-1)
    den = jnp.where(jnp.sum(wm_u_Bn) > 0, jnp.sum(wm_u_Bn), 1.0)
    kl, reg = jnp.sum(wm_u_Bn * kl_Bn) / den, jnp.sum(wm_u_Bn * reg_Bn) / den
    loss, kls = loss + 0.8 ** u * (kl + reg_weight * reg), kls + [kl]
    # the next step drafts column j from this step's prediction for column j - 1 (column 1's input is never read)
    feat_in_BnD = jnp.concatenate([jnp.zeros_like(pred_BnD[:, :1]), pred_BnD[:, :-1]], axis=1)
  return loss, kls[0]


@functools.partial(jax.jit, static_argnames=("model_cfg", "temperature", "lr", "steps", "alpha", "reg_weight",
                                             "vocab", "ttt"))
def distill_step(state: DrafterState, policy_params: dict, sequence_BT: Array, positions_BT: Array,
                 segment_ids_BT: Array, mask_BN: Array, reward_B: Array, *, model_cfg: ModelConfig,
                 temperature: float, lr: float, steps: int = 1, alpha: float = 0.0,
                 reg_weight: float = 10.0, vocab: int = 0, ttt: int = 1) -> tuple[DrafterState, dict]:
  """`steps` Adam steps (learning rate `lr`) of `distill_loss` (a head: `head_loss`, the policy's features computed
  once; with `vocab` = K > 0 over its draft vocabulary after this batch's tokens are counted) on one batch, rows
  weighted by `reward_weights` (α = `alpha`). Returns (state, {"spec_drafter_kl": the KL before the first step,
  "spec_drafter_kl_last": the KL before the last step, and with K > 0 "spec_head_vocab_hit": the share of the
  batch's completion tokens in the draft vocabulary of the counts before it, the one a sync run drafted them with});
  the policy's parameters are read, never changed."""
  tx = optax.adam(lr)
  weight_B = reward_weights(reward_B, alpha)
  N = mask_BN.shape[1]
  tokens_BN, m_BN = sequence_BT[:, -N:], jnp.asarray(mask_BN, jnp.float32)
  before_V, counts_V = state.counts_V, state.counts_V.at[tokens_BN].add(m_BN)
  state, extra = state.replace(counts_V=counts_V), {}
  if head_drafter.is_head(state.params):
    vocab_K = head_drafter.top_vocab(counts_V, vocab) if vocab else None
    if vocab:  # the vocabulary before this batch's counts: the one its tokens were drafted with (in sync)
      in_V = jnp.zeros(counts_V.shape, jnp.float32).at[head_drafter.top_vocab(before_V, vocab)].set(1.0)
      extra["spec_head_vocab_hit"] = jnp.sum(m_BN * in_V[tokens_BN]) / jnp.maximum(jnp.sum(m_BN), 1.0)
    f_BND = policy_features(policy_params, sequence_BT, positions_BT, segment_ids_BT, N, model_cfg)
    loss_fn = lambda dp: head_loss(dp, policy_params, sequence_BT, positions_BT, segment_ids_BT, mask_BN, weight_B,
                                   model_cfg, temperature, reg_weight, f_BND, vocab_K, ttt)
  else:
    loss_fn = lambda dp: (lambda kl: (kl, kl))(distill_loss(dp, policy_params, sequence_BT, positions_BT,
                                                            segment_ids_BT, mask_BN, weight_B, model_cfg, temperature))

  def one(st: DrafterState, _):
    (_, kl), g = jax.value_and_grad(loss_fn, has_aux=True)(st.params)
    updates, opt_state = tx.update(g, st.opt_state, st.params)
    return st.replace(params=optax.apply_updates(st.params, updates), opt_state=opt_state), kl

  state, kl_S = jax.lax.scan(one, state, None, length=steps)
  return state, {"spec_drafter_kl": kl_S[0], "spec_drafter_kl_last": kl_S[-1], **extra}


@dataclasses.dataclass(frozen=True)
class DrafterDistill:
  """A run's drafter distillation (`sampler.spec_drafter="distilled"` or "head"): its static settings, `init` and
  `update`.

  model_cfg: the policy's (learner's) model config; layers: k; temperature: the sampler's; lr, steps, alpha:
  `sampler.spec_distill_lr`, `spec_distill_steps`, `spec_distill_reward_weight`; kind: "distilled" (the policy's
  first k layers) or "head" (`sampling.head_drafter`, `sampler.spec_drafter="head"`); reg_weight:
  `sampler.spec_head_reg_weight` (a head's feature regression, `head_loss`); vocab: `sampler.spec_head_vocab` (a
  head's draft vocabulary size K, 0 = the whole vocabulary); ttt: `sampler.spec_head_ttt` (a head's training-time
  test steps, `head_loss`).
  """
  model_cfg: ModelConfig
  layers: int
  temperature: float
  lr: float = 1e-4
  steps: int = 1
  alpha: float = 0.0
  kind: str = "distilled"
  reg_weight: float = 10.0
  vocab: int = 0
  ttt: int = 1

  def init(self, policy_params: dict) -> DrafterState:
    if not 0 <= self.vocab < self.model_cfg.vocab_size:
      raise ValueError(f"sampler.spec_head_vocab={self.vocab} must be in [0, {self.model_cfg.vocab_size}) (the "
                       "model's vocabulary; 0 drafts over all of it)")
    return init_state(policy_params, self.model_cfg, self.layers, self.lr, self.kind)

  def sampler_params(self, state: DrafterState) -> dict:
    """The drafter's parameters as the sampler drafts with them: a head with its draft vocabulary when K > 0."""
    return head_drafter.with_vocab(state.params, state.counts_V, self.vocab)

  def update(self, state: DrafterState, policy_params: dict, ro) -> tuple[DrafterState, dict]:
    """Distils the drafter on rollout record `ro` (its sequences, completion mask and rewards) against
    `policy_params`; returns the new state and the metrics as floats. A drafter replicated over a mesh gets the
    batch replicated there too: over several processes every process holds the same host batch, and a program
    over their devices takes only global arrays."""
    sh = getattr(jax.tree.leaves(state.params)[0], "sharding", None)
    on_mesh = isinstance(sh, jax.sharding.NamedSharding) and sh.is_fully_replicated
    put = (lambda x, dt=None: jax.device_put(np.asarray(x, dt), sh)) if on_mesh else jnp.asarray
    state, m = distill_step(state, policy_params, put(ro.sequence_BT), put(ro.positions_BT),
                            put(ro.segment_ids_BT), put(ro.mask_BN, jnp.float32),
                            put(ro.reward_B, jnp.float32), model_cfg=self.model_cfg,
                            temperature=float(self.temperature), lr=float(self.lr), steps=self.steps,
                            alpha=float(self.alpha), reg_weight=float(self.reg_weight), vocab=self.vocab,
                            ttt=self.ttt)
    return state, {k: float(np.asarray(v)) for k, v in m.items()}
