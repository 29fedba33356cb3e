"""Rollout correction: the gap between the rollout engine's policy and the trainer's, measured and corrected.

The rollout engine (another library, precision or kernel, or weights some versions old in asynchronous RL) samples
from the behaviour policy ``pi_rollout``; the trainer computes the proximal policy ``pi_old`` on the same tokens
(``old_log_probs``; the current policy before its first step when that forward is skipped). As verl's
``algorithm.rollout_correction`` (decoupled mode), with ``rho_t = pi_old(t) / pi_rollout(t)``:

* metrics, on the response tokens: ``|pi_old - pi_rollout|`` in probability space (verl's
  ``training/rollout_probs_diff_{mean,max}``) and ``|log pi_old - log pi_rollout|`` (:func:`rollout_diff_stats`);
  the ``rollout_corr/*`` statistics of the IS weights, the KL between the two policies and the share of tokens
  and sequences rejected (:func:`correction_stats`, :func:`correction_metrics`);
* truncated importance sampling (``rollout_is``, :func:`rollout_is_weights`): per-token weights ``rho_t``
  (``level="token"``) or one weight per sequence ``rho = prod_t rho_t`` broadcast to its tokens
  (``level="sequence"``), bounded to ``[exp(-20), exp(20)]`` for safety, then truncated from above at
  ``threshold`` and zeroed on padding. The policy loss multiplies its per-token terms by them
  (``rollout_is_weights`` of ``portrl.algo``'s policy losses), so the gradient estimates ``E_{pi_old}`` from
  samples of ``pi_rollout``. With ``rollout_is_batch_normalize`` the actor divides the step's weights by their mean
  (``portrl/workers/actor_correction.py``);
* rejection sampling (``rollout_rs``, :func:`rejection_mask`): a token (``token``), or a whole sequence by the
  product of its ratios (``sequence``) or their geometric mean ``exp(mean_t log rho_t)`` (``geometric``), whose
  ratio lies outside ``[lower, upper]`` (``lower`` defaults to ``1 / upper``) leaves the loss: the actor multiplies
  the response mask by the rejection mask before its update, so rejected tokens are out of the loss terms and of
  the token counts the loss is normalised by. The veto (``rollout_token_veto_threshold``) rejects every sequence
  holding a token whose unbounded ratio is below it.

**Decoupled PPO.** With ``rollout_is=token`` and the ``vanilla`` loss the policy loss is the decoupled PPO
objective of asynchronous RL (Hilton et al. 2022, arXiv 2110.00641; AReaL): PPO's clipped term on the ratio to the
proximal policy ``r = pi / pi_old``, times the truncated behaviour weight,
``-min(r A, clip(r, 1 - eps_l, 1 + eps_h) A) * min(pi_old / pi_rollout, rollout_is_threshold)`` (plus the dual
clip of ``vanilla`` for ``A < 0``); ``sequence`` uses one behaviour weight per sequence. The proximal policy is
the trainer's forward at the start of the update, so the clip bounds the update step while the weight corrects
for the stale or mismatched sampler.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

import torch

LEVELS = ("token", "sequence")  # rollout_is
RS_LEVELS = ("token", "sequence", "geometric")  # rollout_rs
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


def _level_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``log rho`` (B, T) of ``level``: per token, or the row's sum (product of ratios) or mean (geometric mean) over
    its response tokens broadcast to every position. ``log_rho`` is already 0 on padding."""
    if level == "token":
        return log_rho
    total = log_rho.sum(-1, keepdim=True)
    if level == "geometric":
        total = total / mask.sum(-1, keepdim=True).clamp(min=1)
    return total.expand_as(log_rho)


def rejection_mask(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                   level: Optional[str] = None, threshold: Optional[float] = None,
                   threshold_lower: Optional[float] = None, veto_threshold: Optional[float] = None) -> torch.Tensor:
    """``response_mask`` (B, T, its dtype) with the rejected tokens set to 0: those whose ratio at ``level``
    (:data:`RS_LEVELS`; None = no bounds) lies outside ``[threshold_lower, threshold]`` (``threshold_lower`` None =
    ``1 / threshold``; bounds inclusive, ratios safety-bounded to ``exp(+-20)`` as the IS weights), and every token
    of a row holding a response token whose unbounded ratio is below ``veto_threshold`` (None = no veto)."""
    if level is not None and level not in RS_LEVELS:
        raise ValueError(f"rollout_rs level {level!r} is unknown; valid: {list(RS_LEVELS)}")
    m = response_mask.detach().cpu().bool()  # float64 on the CPU, whatever the device (some have no float64)
    log_rho = torch.where(m, old_log_prob.detach().cpu().double() - rollout_log_prob.detach().cpu().double(), 0.0)
    keep = m.clone()
    if level is not None:
        upper, lower = rejection_bounds(threshold, threshold_lower)
        lr = _level_log_ratio(log_rho, m, level).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        keep &= (lr >= math.log(lower)) & (lr <= math.log(upper))
    if veto_threshold is not None:
        if not veto_threshold > 0:
            raise ValueError(f"rollout_token_veto_threshold must be > 0, got {veto_threshold}")
        vetoed = ((log_rho < math.log(veto_threshold)) & m).any(-1, keepdim=True)
        keep &= ~vetoed
    return response_mask * keep.to(device=response_mask.device, dtype=response_mask.dtype)


def rejection_bounds(threshold: Optional[float], threshold_lower: Optional[float]) -> tuple:
    """``(upper, lower)`` of rejection sampling: ``threshold`` and ``threshold_lower`` (None = ``1 / upper``);
    ValueError unless ``0 < lower <= upper``."""
    if threshold is None or not threshold > 0:
        raise ValueError(f"rollout_rs_threshold must be > 0 with rollout_rs set, got {threshold}")
    lower = 1.0 / float(threshold) if threshold_lower is None else float(threshold_lower)
    if not 0 < lower <= threshold:
        raise ValueError(f"rollout_rs_threshold_lower must be in (0, rollout_rs_threshold={threshold}], got {lower}")
    return float(threshold), lower


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


def correction_stats(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                     kept_mask: torch.Tensor, level: str = "token", threshold: float = 2.0,
                     veto_threshold: Optional[float] = None) -> Dict[str, float]:
    """Partial statistics of one micro-batch that add over micro-batches and ranks (keys ending in ``_max`` combine
    by maximum, the others by sum; ``neg_is_min_max`` is ``-min``): over the response tokens of ``response_mask``
    (before rejection), the IS weights ``rho`` at ``level`` (safety-bounded, not truncated) -- count, sum, sum of
    squares, extremes, how many above ``threshold`` / below ``1 / threshold`` --, ``log pi_rollout - log pi_old``
    and its k3 form; the tokens and rows ``kept_mask`` rejected, and the rows ``veto_threshold`` vetoed."""
    m, kept = response_mask.detach().cpu().bool(), kept_mask.detach().cpu().bool()  # float64 on the CPU: any device
    log_rho = torch.where(m, old_log_prob.detach().cpu().double() - rollout_log_prob.detach().cpu().double(), 0.0)
    w = torch.exp(_level_log_ratio(log_rho, m, level).clamp(-SAFETY_BOUND, SAFETY_BOUND))[m]
    d = log_rho[m]
    rows = m.any(-1)
    dropped = m & ~kept
    out = {"tokens": float(m.sum()), "seqs": float(rows.sum()), "masked_tokens": float(dropped.sum()),
           "masked_seqs": float(dropped.any(-1).sum()), "is_sum": float(w.sum()), "is_sq_sum": float(w.square().sum()),
           "is_high": float((w > threshold).sum()), "is_low": float((w < 1.0 / threshold).sum()),
           "kl_sum": float(-d.sum()), "k3_kl_sum": float((d.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() - d - 1).sum()),
           "is_max": float(w.max()) if w.numel() else 0.0,
           "neg_is_min_max": float(-w.min()) if w.numel() else -math.inf,
           "veto_seqs": 0.0, "veto_tokens": 0.0}
    if veto_threshold is not None:
        bad = (log_rho < math.log(veto_threshold)) & m
        out["veto_seqs"], out["veto_tokens"] = float(bad.any(-1).sum()), float(bad.sum())
    return out


def correction_metrics(stats: Mapping[str, float]) -> Dict[str, float]:
    """verl's ``rollout_corr/*`` metrics from :func:`correction_stats` combined over micro-batches and ranks
    (empty when there were no response tokens): ``rollout_is_{mean,std,min,max}`` (std: population, over tokens),
    ``rollout_is_ratio_fraction_{high,low}`` (share of tokens whose weight is above the truncation threshold / below
    its inverse), ``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction`` (share of response tokens /
    sequences that left the loss, by rejection sampling and veto together), ``rollout_is_veto_fraction`` /
    ``rollout_is_catastrophic_token_fraction`` (sequences vetoed / tokens below the veto threshold), ``kl``
    (``mean(log pi_rollout - log pi_old)``) and ``k3_kl`` (``mean(rho - log rho - 1)``, token level)."""
    n, seqs = stats["tokens"], stats["seqs"]
    if n <= 0:
        return {}
    mean = stats["is_sum"] / n
    values = {"rollout_is_mean": mean, "rollout_is_std": math.sqrt(max(0.0, stats["is_sq_sum"] / n - mean * mean)),
              "rollout_is_min": -stats["neg_is_min_max"], "rollout_is_max": stats["is_max"],
              "rollout_is_ratio_fraction_high": stats["is_high"] / n,
              "rollout_is_ratio_fraction_low": stats["is_low"] / n,
              "rollout_rs_masked_fraction": stats["masked_tokens"] / n,
              "rollout_rs_seq_masked_fraction": stats["masked_seqs"] / seqs,
              "rollout_is_veto_fraction": stats["veto_seqs"] / seqs,
              "rollout_is_catastrophic_token_fraction": stats["veto_tokens"] / n,
              "kl": stats["kl_sum"] / n, "k3_kl": stats["k3_kl_sum"] / n}
    return {f"rollout_corr/{k}": float(v) for k, v in values.items()}
