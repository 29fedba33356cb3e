"""Rollout correction: the gap between the rollout engine's policy and the trainer's, measured and corrected.

The rollout engine (another library, precision or kernel) samples from ``pi_rollout``; the trainer computes
``pi_old`` on the same tokens with the same weights. They differ by numerics, and by a lot when a weight sync
did not happen. As verl (``algorithm.rollout_correction``, decoupled mode):

* metrics, on the response tokens: ``|pi_old - pi_rollout|`` in probability space (verl's
  ``training/rollout_probs_diff_{mean,max}``) and ``|log pi_old - log pi_rollout|``;
* truncated importance sampling: per-token weights ``rho_t = pi_old(t) / pi_rollout(t)`` (``level="token"``)
  or one weight per sequence ``rho = prod_t rho_t`` broadcast to its tokens (``level="sequence"``), bounded
  to ``[exp(-20), exp(20)]`` for safety, then truncated from above at ``threshold`` and zeroed on padding.
  The policy loss multiplies its per-token terms by them (``rollout_is_weights`` of ``portrl.algo``'s policy
  losses), so the gradient estimates ``E_{pi_old}`` from samples of ``pi_rollout``.
"""

from __future__ import annotations

from typing import Dict

import torch

LEVELS = ("token", "sequence")
SAFETY_BOUND = 20.0  # |log rho| is clamped to this before exp (verl's bound)


def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       level: str = "token", threshold: float = 2.0) -> torch.Tensor:
    """Truncated importance weights ``min(rho, threshold)`` (B, T), 0 on padding; see the module docstring."""
    if level not in LEVELS:
        raise ValueError(f"rollout_is level {level!r} is unknown; valid: {list(LEVELS)}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    mask = response_mask.to(old_log_prob.dtype)
    log_rho = (old_log_prob.detach().float() - rollout_log_prob.float()) * mask
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = torch.exp(log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return rho.clamp(max=float(threshold)) * mask


def rollout_diff_stats(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                       response_mask: torch.Tensor) -> Dict[str, float]:
    """Sums and maxima of ``|p_old - p_rollout|`` and ``|log p_old - log p_rollout|`` over the response
    tokens, as partial statistics that add over micro-batches and ranks: ``{"probs_sum", "probs_max",
    "log_probs_sum", "log_probs_max", "tokens"}``."""
    m = response_mask.bool()
    old, ro = old_log_prob.detach().float()[m], rollout_log_prob.float()[m]
    if old.numel() == 0:
        return {"probs_sum": 0.0, "probs_max": 0.0, "log_probs_sum": 0.0, "log_probs_max": 0.0, "tokens": 0.0}
    dp, dl = (old.exp() - ro.exp()).abs(), (old - ro).abs()
    return {"probs_sum": float(dp.sum()), "probs_max": float(dp.max()), "log_probs_sum": float(dl.sum()),
            "log_probs_max": float(dl.max()), "tokens": float(old.numel())}
