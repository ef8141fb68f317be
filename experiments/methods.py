"""The correction methods compared by the ablations: display name -> config overrides.

A method is a loss plus the few config fields its paper assumes. Two choices worth knowing:
- `grpo` is PPO-clip with GRPO's seq-mean-token-mean aggregation (the default demo);
  `ppo_clip` is the same loss with token-mean, so the pair is the aggregation ablation.
- `decoupled_ppo` anchors its proximal policy at the parameters *before this update*
  (`rollout.old_logp=step_start`, AReaL's π_prox); every other method anchors π_old at the
  behaviour version recomputed by the learner (`recompute`), i.e. the stale policy itself.
"""

from __future__ import annotations

METHODS: dict[str, dict] = {
    "grpo": {"loss.name": "ppo_clip", "loss.agg_mode": "seq-mean-token-mean"},
    "ppo_clip": {"loss.name": "ppo_clip", "loss.agg_mode": "token-mean"},
    "gspo": {"loss.name": "gspo"},
    "cispo": {"loss.name": "cispo"},
    "tis": {"loss.name": "tis"},
    "mis": {"loss.name": "mis"},
    "icepop": {"loss.name": "icepop"},
    "decoupled_ppo": {"loss.name": "decoupled_ppo", "rollout.old_logp": "step_start"},
    "a3po": {"loss.name": "a3po"},
    "m2po": {"loss.name": "m2po"},
    "vespo": {"loss.name": "vespo"},
    "dppo": {"loss.name": "dppo"},
    "drpo": {"loss.name": "drpo"},
    "sat": {"loss.name": "sat"},
    "mu_grpo": {"loss.name": "mu_grpo"},
    "delightful_pg": {"loss.name": "delightful_pg"},
}

# Baseline of every "X is more stable than GRPO" claim.
BASELINE = "grpo"


def overrides(method: str) -> dict:
  """Config overrides of `method` (KeyError naming the valid methods otherwise)."""
  try:
    return dict(METHODS[method])
  except KeyError:
    raise KeyError(f"unknown method {method!r}; valid: {', '.join(METHODS)}") from None
