"""Optimal token baseline for multi-turn (tool-integrated) responses (verl ``tir_optimal_token_baseline``).

The same variance-minimising baseline as ``optimal_token_baseline`` (``advantages_return``), but the rows of a
group are aligned by their k-th *valid* token instead of their absolute position: in a multi-turn response the
mask has holes (tool outputs, other turns' prompts), so position t means different things in different rows.

For row i with valid positions ``p_i0 < p_i1 < ... < p_i(L_i−1)``: ``G`` = reverse cumsum of ``r·m``,
``w_t = 1 − 2·exp(old_t) + Σπ²_t`` (times ``ρ_t²`` with IS weights), ``W = cumsum(w·m)``, taken at those positions
(``G_ik = G[i, p_ik]``, ``W_ik = W[i, p_ik]``). Rows with no valid token take no part. For a group of N > 1 rows:
``B_k = Σ_i G_ik W_ik / (Σ_i W_ik + baseline_eps)`` over the rows with ``L_i > k``; N = 1: ``B = 0``.
``handle_zero_tail``: if one row is strictly the longest, its baseline from the second-longest length on is 0.
``A[i, p_ik] = G_ik − B_k``, 0 off the mask. Returns ``(A, G·m)`` (verl leaves ``G`` in the holes of its
returns). On rows without holes this is exactly ``optimal_token_baseline``.
"""

from __future__ import annotations

from typing import Optional

import torch

from portrl.algo.advantages_return import otb_returns_and_weights
from portrl.algo.groups import group_rows
from portrl.algo.spec import estimator


@estimator("tir_optimal_token_baseline", needs_old_log_probs=True, needs_sum_pi_squared=True,
           per_token_rewards=True)
@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                                        sum_pi_squared,
                                                        rollout_is_weights: Optional[torch.Tensor] = None,
                                                        handle_zero_tail: bool = True, baseline_eps: float = 1e-8):
    """See the module docstring."""
    m, mf, returns, big_w = otb_returns_and_weights(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                                    rollout_is_weights, "tir_optimal_token_baseline")
    lengths = m.sum(dim=-1)
    lengths_host = lengths.cpu()  # group_rows' indices live on the CPU: a mask from the device cannot index them
    width = int(lengths.max())
    # row i's k-th valid token at column k
    packed_g = torch.zeros(m.shape[0], width, dtype=returns.dtype, device=returns.device)
    packed_w = torch.zeros_like(packed_g)
    for i in range(m.shape[0]):
        packed_g[i, :int(lengths[i])] = returns[i, m[i]]
        packed_w[i, :int(lengths[i])] = big_w[i, m[i]]
    baseline = torch.zeros_like(packed_g)
    for rows in group_rows(index, m.shape[0], "tir_optimal_token_baseline"):
        rows = rows[lengths_host[rows] > 0]
        if len(rows) < 2:
            continue
        gw = packed_w[rows]
        b = ((packed_g[rows] * gw).sum(0) / (gw.sum(0) + baseline_eps)).expand(len(rows), -1).clone()
        if handle_zero_tail:
            lens, order = torch.sort(lengths_host[rows], descending=True)
            if int(lens[0]) > int(lens[1]):
                b[int(order[0]), int(lens[1]):] = 0
        baseline[rows] = b
    adv = torch.zeros_like(returns)
    for i in range(m.shape[0]):
        adv[i, m[i]] = (packed_g[i] - baseline[i])[:int(lengths[i])]
    return adv, returns * mf
