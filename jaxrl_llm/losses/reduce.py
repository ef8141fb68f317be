"""Aggregation of per-token losses, done once (never inside a loss).

Modes (verl names, so results compare across frameworks):
  token-mean               Σ_{b,t} m·ℓ / Σ_{b,t} m
  seq-mean-token-mean      (1/B') Σ_b Σ_t m·ℓ / L_b          (GRPO paper)
  seq-mean-token-sum       (1/B') Σ_b Σ_t m·ℓ
  seq-mean-token-sum-norm  (1/B') Σ_b Σ_t m·ℓ / L_norm       (Dr.GRPO; constant L_norm)
B' counts sequences with L_b > 0. For seq-mean-token-sum-norm we follow the Aug-2026 verl convention
(divide by B' and by L_norm); the Jan-2026 verl divided the total by L_norm only.

Rejected tokens: a loss that masks tokens returns its effective mask as aux["keep_BN"]. With
`drop_rejected=False` (AReaL, verl IcePop) the denominator keeps the original token count, so masking
does not inflate the remaining tokens' gradients; with `drop_rejected=True` (verl rejection sampling)
rejected tokens leave the denominator: in the sequence modes L_b counts kept tokens, and a row whose
tokens are all rejected has L_b = 0 and so leaves B' too.

Every mode is a ratio (numerator, denominator) of sums, so micro-batches and devices combine exactly:
sum the parts, then divide once.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm.losses import core

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def reduce_parts(loss_BN, mask_BN, mode: str = "token-mean", *, keep_BN=None, drop_rejected: bool = False,
                 norm_len: float | None = None):
  """Returns (numerator, denominator) of the aggregate; the loss is numerator / max(denominator, 1)."""
  if mode not in MODES:
    raise ValueError(f"loss.agg_mode={mode!r}: must be one of {MODES}")
  if loss_BN.ndim == 1:  # sequence-level loss [B]: mean over non-empty sequences.
    has = (core.seq_len(mask_BN) > 0).astype(jnp.float32)
    return jnp.where(has > 0, loss_BN, 0.0).sum(), has.sum()
  den_mask = keep_BN if (drop_rejected and keep_BN is not None) else mask_BN
  m = core.fmask(den_mask)
  tok = jnp.where(core.fmask(mask_BN) > 0, loss_BN, 0.0)
  if mode == "token-mean":
    return tok.sum(), m.sum()
  per_seq = tok.sum(-1)
  L = m.sum(-1)
  has = (L > 0).astype(jnp.float32)  # B' counts rows with a counted (kept, if dropping) token
  if mode == "seq-mean-token-mean":
    per_seq = per_seq / jnp.maximum(L, 1.0)
  elif mode == "seq-mean-token-sum-norm":
    if norm_len is None or norm_len <= 0:
      raise ValueError("loss.norm_len must be a positive constant for seq-mean-token-sum-norm")
    per_seq = per_seq / norm_len
  return jnp.where(has > 0, per_seq, 0.0).sum(), has.sum()


def reduce(loss_BN, mask_BN, mode: str = "token-mean", **kw):
  """Scalar aggregate of a per-token (or per-sequence) loss; see `reduce_parts`."""
  num, den = reduce_parts(loss_BN, mask_BN, mode, **kw)
  return num / jnp.maximum(den, 1.0)


def combine_metrics(aux: dict) -> dict:
  """(sum, count) metrics -> means; names ending in `_max` hold a max. Reserved keys are dropped."""
  out = {}
  for k, v in aux.items():
    if k in ("keep_BN", "state"):
      continue
    s, c = v
    out[k] = s if k.endswith("_max") else s / jnp.maximum(c, 1.0)
  return out
