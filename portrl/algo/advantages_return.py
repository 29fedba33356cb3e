"""Return-based estimators: REINFORCE++, ReMax, Optimal Token Baseline.

They return ``(advantages, returns)`` (B,T), zero at masked positions; no gradient flows.
"""

from __future__ import annotations

from typing import Optional

import torch

from portrl.algo.groups import check_rewards, group_rows
from portrl.algo.masked import compute_dtype, masked_whiten
from portrl.algo.spec import estimator


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``y_t = Σ_{t' ≥ t} x_t'`` along the last dim."""
    return torch.flip(torch.cumsum(torch.flip(x, dims=[-1]), dim=-1), dims=[-1])


@estimator("reinforce_plus_plus", per_token_rewards=True)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma=1.0):
    """REINFORCE++ (Hu 2025, arXiv 2501.03262). Discounted returns, backwards over t:
    ``new = r_t + γ·run``; ``G_t = new·m_t``; ``run ← new`` only where ``m_t = 1`` (verl [new]: rewards
    are carried through interior masked spans, G = 0 there). ``A = masked_whiten(G, m)`` over the batch.
    Returns ``(A, G)``. A batch with a single valid token cannot be whitened (ValueError)."""
    m = check_rewards(token_level_rewards, response_mask, "reinforce_plus_plus")
    dt = compute_dtype(token_level_rewards)
    r = token_level_rewards.to(dt)
    run = torch.zeros(r.shape[0], dtype=dt, device=r.device)
    cols = []
    for t in reversed(range(r.shape[1])):
        new = r[:, t] + gamma * run
        cols.append(torch.where(m[:, t], new, torch.zeros_like(new)))
        run = torch.where(m[:, t], new, run)
    returns = torch.stack(cols[::-1], dim=1)
    return masked_whiten(returns, m), returns


@estimator("remax", needs_greedy_baseline=True, per_token_rewards=True)
@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards, response_mask, reward_baselines):
    """ReMax (Li et al. 2023, arXiv 2310.10505): ``G_t = Σ_{t'≥t} r_t' m_t'``, ``A = (G − b_i)·m`` where
    ``b_i`` is the reward of the greedy rollout of row i's prompt. No whitening. Returns ``(A, G·m)``.
    (verl leaves ``G`` at interior masked positions in ``A``; here both are masked.)"""
    m = check_rewards(token_level_rewards, response_mask, "remax")
    if reward_baselines is None:
        raise ValueError("remax: needs reward_baselines (B,), the reward of each prompt's greedy response")
    b = torch.as_tensor(reward_baselines)
    if b.shape != (token_level_rewards.shape[0],):
        raise ValueError(f"remax: reward_baselines must have shape ({token_level_rewards.shape[0]},), got {tuple(b.shape)}")
    dt = compute_dtype(token_level_rewards)
    mf = m.to(dt)
    returns = reverse_cumsum(token_level_rewards.to(dt) * mf) * mf
    adv = (returns - b.to(device=returns.device, dtype=dt)[:, None]) * mf
    return adv, returns


def otb_returns_and_weights(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                            rollout_is_weights: Optional[torch.Tensor], who: str):
    """What both optimal-token-baseline estimators start from: ``(m, mf, G, W)``, the bool and float masks,
    ``G`` = reverse cumsum of ``r·m`` and ``W = cumsum(w·m)`` with ``w_t = 1 − 2·exp(old_t) + Σπ²_t`` (times
    ``ρ_t²`` with IS weights), in the inputs' compute dtype."""
    m = check_rewards(token_level_rewards, response_mask, who)
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(f"{who}: needs old_log_probs and sum_pi_squared (B,T)")
    dt = compute_dtype(token_level_rewards, old_log_probs, sum_pi_squared)
    mf = m.to(dt)
    returns = reverse_cumsum(token_level_rewards.to(dt) * mf)
    w = 1 - 2 * torch.exp(old_log_probs.to(dt)) + sum_pi_squared.to(dt)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(dt).square()
    return m, mf, returns, torch.cumsum(w * mf, dim=-1)


@estimator("optimal_token_baseline", needs_old_log_probs=True, needs_sum_pi_squared=True, per_token_rewards=True)
@torch.no_grad()
def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                             sum_pi_squared, rollout_is_weights: Optional[torch.Tensor] = None,
                                             handle_zero_tail: bool = True, baseline_eps: float = 1e-8):
    """Optimal token baseline (verl OTB; variance-minimising per-token baseline, cf. Weaver & Tao 2001).

    ``G`` = reverse cumsum of ``r·m``. Weights ``w_t = 1 − 2·exp(old_t) + Σπ²_t`` (times ``ρ_t²`` with IS
    weights), ``W = cumsum(w·m)``. For a group of N > 1 rows:
    ``B_t = Σ_i G_it W_it m_it / (Σ_i W_it m_it + baseline_eps)``; N = 1: ``B = 0``.
    ``handle_zero_tail``: if one row is strictly the longest, its baseline from the second-longest
    length on is 0 (no other row informs it). ``A = (G − B)·m``. Returns ``(A, G·m)``.
    """
    m, mf, returns, big_w = otb_returns_and_weights(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                                    rollout_is_weights, "optimal_token_baseline")
    baseline = torch.zeros_like(returns)
    lengths = m.sum(dim=-1)
    for rows in group_rows(index, returns.shape[0], "optimal_token_baseline"):
        if len(rows) < 2:
            continue
        gw = big_w[rows] * mf[rows]
        b = (returns[rows] * gw).sum(0) / (gw.sum(0) + baseline_eps)
        b = b.expand(len(rows), -1).clone()
        if handle_zero_tail:
            lens, order = torch.sort(lengths[rows], descending=True)
            if int(lens[0]) > int(lens[1]):
                b[int(order[0]), int(lens[1]):] = 0
        baseline[rows] = b
    return (returns - baseline) * mf, returns * mf
