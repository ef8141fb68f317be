"""EPO: PPO-clip plus entropy regularisation smoothed against a per-turn entropy history (multi-turn agents)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import core, registry

sg = core.sg
SMOOTH_PENALTIES = ("indicator", "hinge")


@dataclasses.dataclass(frozen=True)
class Hparams:
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: Optional[float] = 3.0  # verl's compute_policy_loss (which EPO calls) always dual-clips at 3.
  entropy_coef: float = 1e-3  # β (`entropy_coeff`).
  smooth_coef: float = 1.0  # λ (`entropy_smooth_coeff`).
  band_low: float = 0.8  # in-band: band_low·H_hist < H < band_high·H_hist.
  band_high: float = 1.2
  out_range_penalty: float = 0.1  # the indicator's value out of band (scales the hinge too).
  smooth_penalty: str = "hinge"  # "hinge" (paper: has a gradient) | "indicator" (released code: no gradient).
  smooth_from_turn: int = 25  # penalty on turns >= this; a run: env.max_turns // 2 (code: max_step // 2).
  smooth_schedule: bool = True  # multiply the penalty by the epoch weight w_k (`enable_smooth_weights`).
  schedule_steps: int = 150  # horizon of w_k (`entropy_smooth_max_epochs`).
  schedule_slow: float = 2.0  # first-half decay rate (1 → 0.8).
  schedule_fast: float = 3.0  # second-half decay rate γ (0.8 → 0).
  max_turns: int = 64  # size of the per-turn entropy history; turns >= max_turns get no penalty.


def init_state(hp: Hparams):
  """Empty history: per-turn entropy sums and token counts, and the step counter of the schedule."""
  # two arrays, not one shared twice: the learner donates its state, and a buffer is donated only once
  z = lambda: jnp.zeros((hp.max_turns,), jnp.float32)
  return {"ent_sum_U": z(), "ent_count_U": z(), "step": jnp.zeros((), jnp.int32)}


def smooth_weight(step, hp: Hparams):
  """Phase schedule w_k: 1 → 0.8 over the first half (1 − 0.2(1 − e^{−a·p})), then 0.8·e^{−γ·p} → 0."""
  half = hp.schedule_steps // 2
  k = jnp.clip(jnp.asarray(step, jnp.float32), 0.0, float(hp.schedule_steps))
  p1 = k / max(half, 1)
  p2 = (k - half) / max(hp.schedule_steps - half, 1)
  w = jnp.where(k <= half, 1.0 - 0.2 * (1.0 - jnp.exp(-hp.schedule_slow * p1)), 0.8 * jnp.exp(-hp.schedule_fast * p2))
  if hp.schedule_steps <= 0:  # code: no horizon → weight 1
    w = jnp.ones_like(w)
  return w


def smooth_penalty(ent_BN, hist_BN, has_hist_BN, hp: Hparams):
  """P_t: out-of-band penalty of each token's entropy against its turn's historical mean.

  indicator: out_range_penalty·1[H ∉ (lo·h, hi·h)], a constant without gradient (released code);
  hinge:     out_range_penalty·(relu(lo·h − H) + relu(H − hi·h)), whose gradient pushes H back in band.
  Returns (P_BN, out_of_band_BN); the band is open (strict bounds, as in the code).
  """
  lo, hi = hp.band_low * hist_BN, hp.band_high * hist_BN
  out = has_hist_BN & ~((ent_BN > lo) & (ent_BN < hi))
  if hp.smooth_penalty == "indicator":
    p = jnp.where(out, hp.out_range_penalty, 0.0)
  elif hp.smooth_penalty == "hinge":
    p = hp.out_range_penalty * (jax.nn.relu(lo - ent_BN) + jax.nn.relu(ent_BN - hi))
  else:
    raise ValueError(f"loss.hparams.smooth_penalty={hp.smooth_penalty!r}: must be one of {SMOOTH_PENALTIES}")
  return jnp.where(has_hist_BN, p, 0.0), out


def update_history(state, ent_BN, turn_BN, mask_BN, hp: Hparams):
  """Adds this batch's per-turn entropy sums and token counts (detached); advances the step."""
  ok = (mask_BN > 0) & (turn_BN >= 0) & (turn_BN < hp.max_turns)
  idx = jnp.clip(turn_BN, 0, hp.max_turns - 1).reshape(-1)
  s = jax.ops.segment_sum(jnp.where(ok, sg(ent_BN), 0.0).reshape(-1), idx, num_segments=hp.max_turns)
  c = jax.ops.segment_sum(ok.astype(jnp.float32).reshape(-1), idx, num_segments=hp.max_turns)
  return {"ent_sum_U": state["ent_sum_U"] + s, "ent_count_U": state["ent_count_U"] + c, "step": state["step"] + 1}


def epo(inputs, hp: Hparams):
  """EPO: ℓ_t = ℓ^PPO_t − β·(H_t − λ·w_k·P_t), i.e. L = L_PPO − β·[H̄ − λ·P̄_smooth] after `reduce`.

  ℓ^PPO is the clipped surrogate (r = π_θ/π_old, dual clip c=3 as in verl); H_t = `entropy_BN`;
  P_t penalises entropy outside [band_low, band_high] × the historical mean entropy of the token's
  turn (only for turns >= smooth_from_turn, and only once that turn has history); w_k is the
  phase schedule on the loss-call step (1 → 0.8 → 0 over `schedule_steps`).
  Paper: Xu et al. 2025, "EPO: Entropy-regularized Policy Optimization" (arXiv 2509.22576); code
  `WujiangXu/EPO:verl/workers/actor/dp_actor.py` (generate_entropy_penalty). methods-rl §7.6.
  Faithful to the paper by default: `smooth_penalty="hinge"` penalises the distance outside the band
  (0.1 per unit of entropy), so the smoothing term has a gradient that pushes H back into the band.
  The released code's P is a constant 0.1 out-of-band indicator (`smooth_penalty="indicator"`): it
  shifts the loss value but contributes **no gradient**, leaving EPO as PPO plus an entropy bonus.
  The smoothing starts at half the run's turn limit (`env.max_turns // 2`, the code's `max_step // 2`;
  `smooth_from_turn` overrides it; 25 outside a run: half the code's 50-step ALFWorld limit).
  Differences from the code, by design: the history is a per-turn running mean carried in
  aux["state"] (sums and token counts over all past calls, detached; the current batch is added
  *after* computing the penalty) instead of the trainer-supplied array; the turn gate is per token
  (the code switches the whole micro-batch on if any sample's step >= max_step/2); the code's
  "seq" mask mode is not provided.
  On-policy (π_θ = π_old): the PPO part has the vanilla PG gradient −Â·∇log π; the entropy terms
  depend on log π_θ only through `entropy_BN` (their gradient reaches the parameters through the
  entropy the learner computes), so the gradient w.r.t. `logp_BN` is exactly PG's.
  """
  mask = inputs.mask_BN
  lr = core.safe_log_ratio(inputs.logp_BN, inputs.prox_logp_BN, mask)
  ratio = jnp.exp(lr)
  ppo, clipped = core.clipped_surrogate(ratio, inputs.adv_BN, hp.eps_low, hp.eps_high, hp.dual_clip)

  ok = (mask > 0) & jnp.isfinite(inputs.entropy_BN)
  ent = jnp.where(ok, inputs.entropy_BN, 0.0).astype(jnp.float32)
  state = inputs.state
  turn = inputs.turn_BN
  in_range = (turn >= 0) & (turn < hp.max_turns)
  idx = jnp.clip(turn, 0, hp.max_turns - 1)
  count = state["ent_count_U"][idx]
  hist = state["ent_sum_U"][idx] / jnp.maximum(count, 1.0)
  active = ok & in_range & (count > 0) & (turn >= hp.smooth_from_turn)
  w_k = smooth_weight(state["step"], hp) if hp.smooth_schedule else jnp.ones((), jnp.float32)
  pen, out_band = smooth_penalty(ent, hist, active, hp)
  pen = w_k * pen

  loss = ppo - hp.entropy_coef * (ent - hp.smooth_coef * pen)
  one = jnp.ones((), jnp.float32)
  aux = {
      "clip_frac": core.metric(clipped, mask),
      "entropy": core.metric(ent, mask),
      "smooth_penalty": core.metric(pen, mask),
      "out_of_band_frac": core.metric(out_band, mask),
      "smooth_weight": (w_k, one),
      **core.ratio_diagnostics(lr, mask, "ratio"),
      "state": update_history(state, ent, turn, ok, hp),
  }
  return core.apply_mask(loss, mask), aux


def run_defaults(c) -> dict:
  """Smoothing from half the episode's turn limit (the released code's max_step // 2)."""
  env = c.get("env")
  return {"smooth_from_turn": env.max_turns // 2} if env is not None and "max_turns" in env else {}


registry.register("epo", epo, Hparams, needs=("prox_logp", "entropy", "turn", "state"), init_state=init_state,
                  run_defaults=run_defaults)
