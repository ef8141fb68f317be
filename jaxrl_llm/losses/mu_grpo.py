"""μ-GRPO: relaxed clipping plus a negative-advantage veto of post-trigger suffixes (staged training)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = core.sg


@dataclasses.dataclass(frozen=True)
class Hparams:
  eps_low: float = 1.0  # clip range [0, 5] for the stale regime (project page); GRPO uses [0.8, 1.2]
  eps_high: float = 4.0
  veto: bool = True
  veto_ratio: float = 1e-4  # trigger: sg(r) < veto_ratio ([GUESS]: the page's worked example; sweep 1e-4..1e-2)
  # "suffix_excl_trigger" (S_κ, every token after the first trigger), "nontrigger_suffix" (H_κ = S_κ minus
  # later triggers), "sequence" (the whole response once any trigger appears).
  veto_scope: str = "suffix_excl_trigger"


_SCOPES = ("suffix_excl_trigger", "nontrigger_suffix", "sequence")


def veto_keep_mask(ratio_BN, adv_BN, mask_BN, veto_ratio, scope):
  """Effective mask after the negative-advantage veto, as float {0, 1}.

  Triggers are counted tokens of responses with Â < 0 (masked sequence mean) whose detached ratio
  is below `veto_ratio`; "after" is strictly after the first trigger (cumsum − self > 0).
  """
  m = mask_BN > 0
  neg_B = core.seq_advantage(adv_BN, mask_BN) < 0
  trig = neg_B[:, None] & m & (sg(ratio_BN) < veto_ratio)
  t = trig.astype(jnp.int32)
  after = (jnp.cumsum(t, axis=1) - t) > 0
  if scope == "suffix_excl_trigger":
    drop = after
  elif scope == "nontrigger_suffix":
    drop = after & ~trig
  else:
    drop = jnp.broadcast_to(trig.any(axis=1, keepdims=True), m.shape)
  return (m & ~drop).astype(jnp.float32), trig


def mu_grpo(inputs, hp: Hparams):
  """μ-GRPO: PPO-clip on r = π_θ/μ with a relaxed range [1−ε_low, 1+ε_high] = [0, 5] and a veto.

  Veto: in responses with Â < 0, a trigger token has sg(r) < 1e-4; its prefix is one the current
  policy no longer supports, so the post-trigger updates are unsafe and masked (`veto_scope`). The
  trigger itself keeps its (near-zero) update under the default scope S_κ. `aux["keep_BN"]` is the
  effective mask; by default `reduce` keeps the original token count in the denominator (unspecified
  by the paper, [GUESS] as AReaL). Ratios use the stored behaviour log-probs (no recomputed π_old).
  Paper: Tian, Xie, Wei, arXiv 2605.17570 (project page); pinned in methods-addendum §2. Pair with the
  `staged` run mode (4 stages × 1024 updates).
  On-policy (π_θ = μ): r = 1 never triggers nor clips: the vanilla PG gradient.
  """
  if hp.veto_scope not in _SCOPES:
    raise ValueError(f"loss.hparams.veto_scope={hp.veto_scope!r}: must be one of {_SCOPES}")
  mask = inputs.mask_BN
  lr = core.safe_log_ratio(inputs.logp_BN, inputs.behavior_logp_BN, mask)
  ratio = jnp.exp(lr)
  loss, clipped = core.clipped_surrogate(ratio, inputs.adv_BN, hp.eps_low, hp.eps_high)
  aux = {"clip_frac": core.metric(clipped, mask), **core.ratio_diagnostics(lr, mask, "ratio")}
  if not hp.veto:
    return core.apply_mask(loss, mask), aux
  keep, trig = veto_keep_mask(ratio, inputs.adv_BN, mask, hp.veto_ratio, hp.veto_scope)
  has_B = core.seq_len(mask) > 0
  aux.update(keep_BN=keep, veto_frac=core.metric(1.0 - keep, mask), trigger_frac=core.metric(trig, mask),
             vetoed_seq_frac=core.seq_metric(trig.any(axis=1), has_B))
  return core.apply_mask(loss, keep), aux


registry.register("mu_grpo", mu_grpo, Hparams, needs=("behavior_logp",))
