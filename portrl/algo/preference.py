"""Pairwise and self-play losses: DPO (sigmoid / IPO), SPPO, and VAPO's positive-example LM loss."""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from portrl.algo.aggregation import agg_loss
from portrl.algo.groups import group_rows
from portrl.algo.masked import as_bool_mask, compute_dtype


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: Optional[torch.Tensor] = None, ref_rejected_logps: Optional[torch.Tensor] = None,
             beta: float = 0.1, label_smoothing: float = 0.0, loss_type: str = "sigmoid",
             reference_free: bool = False) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """DPO over pairs of summed sequence log-probs (all ``(P,)``).

    ``z = (π_c − π_r) − (ref_c − ref_r)`` (ref terms 0 when ``reference_free``).
    * ``sigmoid`` (Rafailov et al. 2023, arXiv 2305.18290; conservative DPO with label smoothing ls):
      ``−log σ(βz)(1−ls) − log σ(−βz)·ls``;
    * ``ipo`` (Azar et al. 2023, arXiv 2310.12036): ``(z − 1/(2β))²``.
    The loss is the mean over pairs. Metrics: ``dpo/margin`` (mean βz), ``dpo/accuracy`` (share z > 0).
    """
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if policy_chosen_logps.shape != policy_rejected_logps.shape or policy_chosen_logps.numel() == 0:
        raise ValueError("dpo_loss: chosen and rejected log-probs must be non-empty with equal shapes")
    dt = compute_dtype(policy_chosen_logps, policy_rejected_logps)
    z = policy_chosen_logps.to(dt) - policy_rejected_logps.to(dt)
    if not reference_free:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError("dpo_loss: needs ref_chosen_logps and ref_rejected_logps unless reference_free=True")
        z = z - (ref_chosen_logps.detach().to(dt) - ref_rejected_logps.detach().to(dt))
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(beta * z) * (1 - label_smoothing) - F.logsigmoid(-beta * z) * label_smoothing
    elif loss_type == "ipo":
        per_pair = (z - 1 / (2 * beta)).square()
    else:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r}; valid: ipo, sigmoid")
    metrics = {"dpo/margin": (beta * z).mean().detach(), "dpo/accuracy": (z > 0).to(dt).mean()}
    return per_pair.mean(), metrics


def online_dpo_preference(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """For rows interleaved as pairs ``[a0, b0, a1, b1, …]``: bool ``(B,)`` that marks each pair's winner
    (larger ``Σ r·m``; a tie goes to the first of the pair)."""
    b = token_level_rewards.shape[0]
    if b % 2:
        raise ValueError(f"online_dpo_preference: needs an even number of rows (pairs), got {b}")
    m = as_bool_mask(response_mask, token_level_rewards)
    s = torch.where(m, token_level_rewards.to(torch.float64), 0.0).sum(-1).reshape(-1, 2)
    first_wins = s[:, 0] >= s[:, 1]
    return torch.stack([first_wins, ~first_wins], dim=1).reshape(-1)


def sppo_advantage(scores: torch.Tensor, beta: float = 1.0, index=None) -> torch.Tensor:
    """SPPO advantage as verl's recipe: ``A_i = R_i − SoftMean_β(R)``, ``SoftMean_β(x) = (logsumexp(βx) − log n)/β``
    over the whole batch (β = 0: the arithmetic mean). With ``index`` the soft mean is taken per group
    (per prompt, closer to the paper's per-prompt win rate). Returns float ``(B,)``."""
    r = torch.as_tensor(scores).to(torch.float64).reshape(-1)
    if r.numel() == 0:
        raise ValueError("sppo_advantage: empty scores")

    def soft_mean(x: torch.Tensor) -> torch.Tensor:
        if beta == 0:
            return x.mean()
        return (torch.logsumexp(beta * x, dim=0) - math.log(x.numel())) / beta

    if index is None:
        out = r - soft_mean(r)
    else:
        out = torch.empty_like(r)
        for rows in group_rows(index, r.numel(), "sppo_advantage"):
            out[rows] = r[rows] - soft_mean(r[rows])
    return out.to(compute_dtype(torch.as_tensor(scores)))


def sppo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, eta: float = 1.0, dp_size: int = 1, global_batch_size=None
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """SPPO square loss (Wu et al. 2024, arXiv 2405.00675), verl recipe form:
    ``ℓ_i = (Σ_t (logp − old)·m − η·A_i)²``, averaged over rows with at least one valid token
    (or ``Σ_i ℓ_i / global_batch_size · dp_size``). ``advantages`` is ``(B,)`` or ``(B,T)``; a ``(B,T)``
    tensor gives ``A_i`` = its masked row mean (the scalar when broadcast). The reference supports only
    ``token-mean`` and crashes otherwise; the loss is per sequence, so no mode is taken."""
    if log_prob.shape != old_log_prob.shape or log_prob.dim() != 2:
        raise ValueError("sppo_loss: log_prob and old_log_prob must be equal (batch, response_length) tensors")
    m = as_bool_mask(response_mask, log_prob)
    dt = compute_dtype(log_prob, old_log_prob)
    mf = m.to(dt)
    seq_ratio = ((log_prob.to(dt) - old_log_prob.detach().to(dt)) * mf).sum(-1)
    adv = advantages.detach().to(dt)
    if adv.shape == log_prob.shape:
        adv = (adv * mf).sum(-1) / mf.sum(-1).clamp(min=1)
    elif adv.shape != (log_prob.shape[0],):
        raise ValueError(f"sppo_loss: advantages must be (B,) or (B,T), got {tuple(adv.shape)}")
    per_seq = (seq_ratio - eta * adv).square()
    valid = m.any(-1)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("sppo_loss: dp_size > 1 needs global_batch_size")
        if not bool(valid.any()):
            raise ValueError("sppo_loss: response_mask is all zero (all-masked batch)")
        den = float(valid.sum())
    else:
        den = float(global_batch_size)
        if den <= 0:
            raise ValueError(f"sppo_loss: global_batch_size must be > 0, got {global_batch_size}")
    loss = torch.where(valid, per_seq, 0.0).sum() / den * dp_size
    return loss, {"sppo/seq_log_ratio": (seq_ratio[valid].mean() if bool(valid.any()) else seq_ratio.sum() * 0).detach()}


def positive_lm_loss(log_prob: torch.Tensor, response_mask: torch.Tensor, positive: torch.Tensor,
                     loss_agg_mode: str = "token-mean", **global_counts) -> torch.Tensor:
    """VAPO's positive-example LM loss (Yue et al. 2025, arXiv 2504.05118): NLL of the correct samples,
    ``agg_loss(−logp, m·[positive_i], mode)``; the caller scales it (VAPO: μ = 0.1) and adds it.
    A batch with no positive sample gives 0 (still attached to the graph) rather than an error,
    since that is normal early in training; with global counts the usual ``agg_loss`` rules apply."""
    pos = torch.as_tensor(positive, device=log_prob.device).reshape(-1).to(torch.bool)
    if pos.shape != (log_prob.shape[0],):
        raise ValueError(f"positive_lm_loss: positive must have shape ({log_prob.shape[0]},), got {tuple(pos.shape)}")
    m = as_bool_mask(response_mask, log_prob) & pos[:, None]
    if not global_counts and not bool(m.any()):
        return (log_prob.to(compute_dtype(log_prob)) * 0).sum()
    return agg_loss(-log_prob, m, loss_agg_mode, **global_counts)
