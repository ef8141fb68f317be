"""HisPO (LongCat-Flash-Prover): hierarchical sequence/token masks on the train/infer ratio + triplet clip."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = jax.lax.stop_gradient

CLIP_RATIOS = ("total", "stale")


@dataclasses.dataclass(frozen=True)
class Hparams:
  # The reports publish no values; these are the spec's [GUESS] starting points (methods-addendum §3.3).
  delta_seq: float = 1e-2  # keep a response iff |exp(mean_t log r_dis) - 1| < δ_seq.
  delta_tok: float = 0.5  # keep a token iff |r_dis - 1| < δ_tok (IcePop-like band (0.5, 1.5)).
  eps_neg_low: float = 0.2  # lower clip 1 - ε, binds for Â < 0.
  eps_pos_high: float = 0.28  # upper clip 1 + ε, binds for Â > 0.
  eps_neg_high: float = 3.0  # dual-clip constant c > 1 for Â < 0.
  clip_ratio: str = "total"  # "total": clip r = π_θ/μ (eq. 9); "stale": sg(r_dis)·clip on π_θ/π_old.

  def __post_init__(self):
    if self.clip_ratio not in CLIP_RATIOS:
      raise ValueError(f"loss.hparams.clip_ratio={self.clip_ratio!r}: must be one of {CLIP_RATIOS}")
    if not self.eps_neg_high > 1.0:
      raise ValueError(f"loss.hparams.eps_neg_high={self.eps_neg_high}: the dual-clip constant must be > 1")


def hierarchical_mask(log_r_dis_BN, mask_BN, delta_seq: float, delta_tok: float):
  """H = 1[|exp(mean_t log r_dis) - 1| < δ_seq]·1[|r_dis_t - 1| < δ_tok] within the mask. Returns (H, seq_ok_B, tok_ok)."""
  seq_ok_B = jnp.abs(jnp.expm1(core.seq_mean(log_r_dis_BN, mask_BN))) < delta_seq
  tok_ok = jnp.abs(jnp.expm1(log_r_dis_BN)) < delta_tok
  h = (mask_BN > 0) & seq_ok_B[:, None] & tok_ok
  return h.astype(jnp.float32), seq_ok_B, tok_ok


def hispo(inputs, hp: Hparams):
  """HisPO: ℓ_t = -H_t·triplet(r_t, Â_t), r = π_θ/μ = r_dis·r_stale, r_dis = π_old/μ, r_stale = π_θ/π_old.

  Hierarchical mask (eq. 8): H_t = 1[|exp(mean_{j∈y} log r_dis_j) - 1| < δ_seq]·1[|r_dis_t - 1| < δ_tok];
  the sequence gate drops the whole response, the token gate single tokens (train/infer discrepancy).
  Staleness control is the clip applied to retained tokens. Triplet clip (LongCat-Flash-Thinking eq. 4):
    Â ≥ 0: min(r·Â, min(r, 1+ε_pos_high)·Â)
    Â < 0: max(min(r·Â, clip(r, 1-ε_neg_low, 1+ε_pos_high)·Â), ε_neg_high·Â)
  which is exactly PPO-clip with (ε_low, ε_high) = (ε_neg_low, ε_pos_high) plus dual clip c = ε_neg_high,
  so it is computed with `core.clipped_surrogate`. Eq. 9 clips the total ratio r (default);
  clip_ratio="stale" instead computes sg(r_dis)·triplet(r_stale) ([GUESS]: the decoupled form, equal in
  value to the total-ratio loss when neither clip binds; r_dis ≈ 1 on retained tokens anyway).
  π_old is the trainer's recomputation at the behaviour version. Absolute bars in the gates are our
  reading of the PDF; defaults are [GUESS] (no values published). No KL term (the paper removed it).
  Aggregation: the paper normalises by G·T_max (Dr.GRPO-style): use reduce mode seq-mean-token-sum-norm
  with norm_len = the maximum generation length. Masked tokens are in aux["keep_BN"].
  Paper: Meituan LongCat team, LongCat-Flash-Prover technical report (arXiv 2603.21065) §3.3, eqs. (8)-(9).
  On-policy (π_θ = π_old = μ): r_dis = 1 passes both gates, r = 1, gradient = vanilla PG -Â·∇log π.
  """
  mask = inputs.mask_BN
  log_r_dis = core.safe_log_ratio(sg(inputs.prox_logp_BN), sg(inputs.behavior_logp_BN), mask)
  h, seq_ok_B, tok_ok = hierarchical_mask(log_r_dis, mask, hp.delta_seq, hp.delta_tok)
  if hp.clip_ratio == "total":
    lr = core.safe_log_ratio(inputs.logp_BN, sg(inputs.behavior_logp_BN), mask)
    weight = h
  else:
    lr = core.safe_log_ratio(inputs.logp_BN, sg(inputs.prox_logp_BN), mask)
    weight = h * jnp.exp(log_r_dis)
  surr, clipped = core.clipped_surrogate(jnp.exp(lr), inputs.adv_BN, hp.eps_neg_low, hp.eps_pos_high,
                                         hp.eps_neg_high)
  has_B = core.seq_len(mask) > 0
  aux = {"keep_BN": h, "masked_frac": core.metric(1.0 - h, mask),
         "seq_masked_frac": core.seq_metric(~seq_ok_B, has_B),
         "tok_masked_frac": core.metric(~tok_ok, mask), "clip_frac": core.metric(clipped, h),
         **core.ratio_diagnostics(log_r_dis, mask, "mismatch_ratio"), **core.ratio_diagnostics(lr, mask, "ratio")}
  return core.apply_mask(weight * surr, mask), aux


registry.register("hispo", hispo, Hparams, needs=("prox_logp", "behavior_logp"))
