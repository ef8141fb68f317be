"""Outcome-reward advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++, and the DAPO group filter.

Every function is pure and jittable. Inputs are per sequence:
  reward_B    float outcome reward of each response;
  group_id_B  int in [0, num_groups): the prompt group of each response. Groups need not be contiguous
              (statistics use `segment_sum` with a static `num_groups`);
  valid_B     optional {0,1}: responses that exist (padding rows of a fixed-size batch get 0). Invalid
              rows neither enter any statistic nor receive an advantage (their advantage is 0).

Conventions follow verl (`compute_grpo_outcome_advantage` and friends), so numbers compare across
frameworks: the group std is unbiased (ddof=1, torch's default; `jnp.std` defaults to ddof=0), and a
group holding a single response gets mean 0 and std 1, so its advantage is its raw reward
(methods-rl.md §1). `to_tokens` broadcasts a sequence advantage over its response tokens.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def _valid(reward_B: Array, valid_B: Optional[Array]) -> Array:
  if valid_B is None:
    return jnp.ones(reward_B.shape, jnp.float32)
  return (valid_B > 0).astype(jnp.float32)


def group_stats(reward_B: Array, group_id_B: Array, num_groups: int, valid_B: Optional[Array] = None,
                ddof: int = 1) -> tuple[Array, Array, Array]:
  """Per-response (group mean, group std, group size), each [B], over the valid members of its group.

  The std divides by (n - ddof). Groups with at most one valid response get mean 0 and std 1 (verl's
  convention for singleton groups, whatever ddof), so their advantage is the raw reward.
  """
  v = _valid(reward_B, valid_B)
  r = jnp.where(v > 0, reward_B.astype(jnp.float32), 0.0)
  n_G = jax.ops.segment_sum(v, group_id_B, num_segments=num_groups)
  s_G = jax.ops.segment_sum(r, group_id_B, num_segments=num_groups)
  mean_G = s_G / jnp.maximum(n_G, 1.0)
  mean_B = mean_G[group_id_B]
  dev2_B = jnp.where(v > 0, jnp.square(r - mean_B), 0.0)
  ss_G = jax.ops.segment_sum(dev2_B, group_id_B, num_segments=num_groups)
  var_G = ss_G / jnp.maximum(n_G - ddof, 1.0)
  singleton_G = n_G <= 1.0  # verl: a lone response has no group to compare with.
  mean_G = jnp.where(singleton_G, 0.0, mean_G)
  std_G = jnp.where(singleton_G, 1.0, jnp.sqrt(var_G))
  return mean_G[group_id_B], std_G[group_id_B], n_G[group_id_B]


def grpo(reward_B: Array, group_id_B: Array, num_groups: int, *, valid_B: Optional[Array] = None,
         std_normalize: bool = True, ddof: int = 1, eps: float = 1e-6) -> Array:
  """GRPO advantage Â_i = (R_i − mean_G R)/(std_G R + eps), or R_i − mean_G R with std_normalize=False.

  Paper: Shao et al. 2024 (DeepSeekMath). std: unbiased (ddof=1) as in verl/torch; `eps` is added to
  the std (verl), not inside the square root. Singleton groups: mean 0, std 1 → Â = R/(1+eps).
  Groups whose rewards are all equal get Â ≡ 0 (see `dapo_keep_mask`).
  """
  v = _valid(reward_B, valid_B)
  mean_B, std_B, _ = group_stats(reward_B, group_id_B, num_groups, valid_B, ddof)
  adv = reward_B.astype(jnp.float32) - mean_B
  if std_normalize:
    den = std_B + eps
    adv = jnp.where(den > 0, adv / jnp.where(den > 0, den, 1.0), 0.0)  # eps=0 on a constant group: Â=0, not NaN.
  return jnp.where(v > 0, adv, 0.0)


def dr_grpo(reward_B: Array, group_id_B: Array, num_groups: int, *, valid_B: Optional[Array] = None) -> Array:
  """Dr.GRPO advantage Â_i = R_i − mean_G R (no std division: removes GRPO's difficulty bias).

  Paper: Liu et al. 2025 (arXiv 2503.20783). Pair it with `reduce(..., "seq-mean-token-sum-norm")`.
  Singleton groups: mean 0 → Â = R (verl with norm_adv_by_std_in_grpo=False).
  """
  return grpo(reward_B, group_id_B, num_groups, valid_B=valid_B, std_normalize=False)


def rloo(reward_B: Array, group_id_B: Array, num_groups: int, *, valid_B: Optional[Array] = None) -> Array:
  """RLOO advantage: Â_i = R_i − (1/(n−1)) Σ_{j≠i} R_j, the leave-one-out mean of the other group members.

  Equivalently n/(n−1)·(R_i − mean_G R). Paper: Kool et al. 2019; Ahmadian et al. 2024.
  Singleton groups have no other member: Â = R (verl compute_rloo_outcome_advantage).
  """
  v = _valid(reward_B, valid_B)
  r = jnp.where(v > 0, reward_B.astype(jnp.float32), 0.0)
  n_G = jax.ops.segment_sum(v, group_id_B, num_segments=num_groups)
  s_G = jax.ops.segment_sum(r, group_id_B, num_segments=num_groups)
  n_B, s_B = n_G[group_id_B], s_G[group_id_B]
  loo_B = (s_B - r) / jnp.maximum(n_B - 1.0, 1.0)
  adv = jnp.where(n_B > 1, r - loo_B, r)
  return jnp.where(v > 0, adv, 0.0)


def reinforce_pp(reward_B: Array, group_id_B: Optional[Array] = None, num_groups: Optional[int] = None, *,
                 valid_B: Optional[Array] = None, weight_B: Optional[Array] = None, eps: float = 1e-8) -> Array:
  """REINFORCE++ advantage: batch-global whitening, Â_i = (x_i − mean_batch x)/sqrt(var_batch x + eps).

  Paper: Hu 2025 (arXiv 2501.03262). Variant:
    - without groups (`group_id_B=None`): x_i = R_i (verl `reinforce_plus_plus` with γ=1 and an
      outcome reward: every token's return is R_i);
    - with groups: x_i = R_i − mean_G R (verl `reinforce_plus_plus_baseline`, singletons mean 0),
      then the same batch-global whitening (no per-group std).
  The batch variance is unbiased (Bessel on the total weight, as verl's `masked_whiten`). verl whitens
  over *tokens*, so longer responses weigh more; by default each valid response weighs 1 here. Pass
  `weight_B` = response lengths to reproduce verl's token-weighted statistics exactly.
  """
  v = _valid(reward_B, valid_B)
  x = reward_B.astype(jnp.float32)
  if group_id_B is not None:
    if num_groups is None:
      raise ValueError("reinforce_pp: num_groups is required when group_id_B is given")
    x = dr_grpo(reward_B, group_id_B, num_groups, valid_B=valid_B)
  w = v if weight_B is None else jnp.where(v > 0, weight_B.astype(jnp.float32), 0.0)
  x = jnp.where(w > 0, x, 0.0)
  n = w.sum()
  mean = (w * x).sum() / jnp.maximum(n, 1e-30)
  var = (w * jnp.square(x - mean)).sum() / jnp.maximum(n, 1e-30)
  var = var * n / jnp.maximum(n - 1.0, 1e-30)  # Bessel correction on the total weight (token count in verl).
  var = jnp.where(n > 1.0, var, 0.0)
  return jnp.where(v > 0, (x - mean) * jax.lax.rsqrt(var + eps), 0.0)


def dapo_keep_mask(reward_B: Array, group_id_B: Array, num_groups: int, *, valid_B: Optional[Array] = None,
                   atol: float = 0.0) -> Array:
  """DAPO dynamic-sampling filter: 1.0 for responses whose group's rewards are not all equal, else 0.0.

  Groups with zero reward variance (all correct / all wrong, or a single response) give Â ≡ 0 under
  GRPO and only dilute the batch; DAPO drops them and over-samples (Yu et al. 2025). Equality is
  max − min <= atol over the group's valid members. Invalid rows get 0.
  """
  v = _valid(reward_B, valid_B)
  r = reward_B.astype(jnp.float32)
  hi_G = jax.ops.segment_max(jnp.where(v > 0, r, -jnp.inf), group_id_B, num_segments=num_groups)
  lo_G = jax.ops.segment_min(jnp.where(v > 0, r, jnp.inf), group_id_B, num_segments=num_groups)
  spread_B = (hi_G - lo_G)[group_id_B]
  keep = jnp.isfinite(spread_B) & (spread_B > atol)
  return jnp.where((v > 0) & keep, 1.0, 0.0)


def to_tokens(adv_B: Array, mask_BT: Array) -> Array:
  """Broadcasts sequence advantages over time: adv_BT[b, t] = adv_B[b] where mask_BT[b, t] > 0, else 0."""
  return jnp.where(mask_BT > 0, adv_B[:, None].astype(jnp.float32), 0.0)
