"""Outcome advantage estimators: one scalar per sequence from grouped scores (see ``groups``).

All return ``(advantages, returns)`` of shape ``(B,T)`` with returns = advantages, and zero at
masked positions. No gradient flows through them. Group-size-1 and zero-spread decisions are
stated per estimator; an all-masked batch is a ValueError.
"""

from __future__ import annotations

import torch

from portrl.algo.groups import all_equal, broadcast, check_rewards, group_rows, scores
from portrl.algo.masked import masked_whiten
from portrl.algo.spec import estimator


@estimator("grpo", needs_groups=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True):
    """GRPO (Shao et al. 2024, arXiv 2402.03300): ``a_i = (s_i − mean_g)/(std_g + ε)``, or
    ``s_i − mean_g`` without std normalisation (Dr. GRPO, arXiv 2503.20783). std is unbiased (n−1).

    Group of size 1: as verl, ``mean = 0, std = 1`` so ``a = s/(1+ε)`` (``s`` without normalisation):
    a lone sample keeps its raw score. Zero-spread group: ``a = 0`` exactly.
    """
    m = check_rewards(token_level_rewards, response_mask, "grpo")
    s = scores(token_level_rewards)
    a = torch.zeros_like(s)
    for rows in group_rows(index, s.shape[0], "grpo"):
        g = s[rows]
        if len(rows) == 1:
            mean, std = torch.zeros(()), torch.ones(())
        elif all_equal(g):
            continue  # a = 0 exactly
        else:
            mean, std = g.mean(), g.std()
        a[rows] = (g - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else g - mean
    out = broadcast(a, m, token_level_rewards)
    return out, out


@estimator("grpo_passk", needs_groups=True)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                         norm_adv_by_std_in_grpo=True):
    """Pass@k GRPO (Chen et al. 2025, arXiv 2508.10751 "Pass@k training"): only the best sample of a group
    gets ``a = s_max − s_2nd`` (divided by ``std_g + ε`` when normalising); all others get 0.

    Every group needs at least 2 samples (ValueError). Ties: the first row (in batch order) holding
    the max wins (verl's ``topk`` order is unspecified). Unlike verl, the normalisation flag is the
    keyword argument (verl reads it from ``config`` and ignores the argument).
    """
    m = check_rewards(token_level_rewards, response_mask, "grpo_passk")
    s = scores(token_level_rewards)
    a = torch.zeros_like(s)
    for rows in group_rows(index, s.shape[0], "grpo_passk"):
        if len(rows) < 2:
            raise ValueError(f"grpo_passk: every group needs >= 2 samples, row {int(rows[0])} is alone in its group")
        g = s[rows]
        best = int(torch.argmax(g))  # first max
        second = torch.cat([g[:best], g[best + 1:]]).max()
        adv = g[best] - second
        if norm_adv_by_std_in_grpo:
            adv = adv / (g.std() + epsilon)
        a[rows[best]] = adv
    out = broadcast(a, m, token_level_rewards)
    return out, out


def _group_centered(s: torch.Tensor, index, who: str) -> torch.Tensor:
    """``s_i − mean_g`` with mean 0 for singleton groups."""
    c = s.clone()
    for rows in group_rows(index, s.shape[0], who):
        if len(rows) > 1:
            c[rows] = s[rows] - s[rows].mean()
    return c


@estimator("reinforce_plus_plus_baseline", needs_groups=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index):
    """REINFORCE++ with group baseline (Hu 2025, arXiv 2501.03262): ``a_i = s_i − mean_g`` (singleton: mean 0),
    broadcast over the mask, then whitened over all valid tokens of the batch (``masked_whiten``)."""
    m = check_rewards(token_level_rewards, response_mask, "reinforce_plus_plus_baseline")
    c = _group_centered(scores(token_level_rewards), index, "reinforce_plus_plus_baseline")
    out = masked_whiten(broadcast(c, m, token_level_rewards), m)
    return out, out


@estimator("rloo", needs_groups=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index):
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): ``a_i = s_i − mean_{j≠i} s_j = n/(n−1)·(s_i − mean_g)``.

    Group of size 1: no leave-one-out baseline exists; as verl's ``rloo`` the raw score is kept
    (baseline 0), consistent with opo/gpg/reinforce_plus_plus_baseline singletons.
    """
    m = check_rewards(token_level_rewards, response_mask, "rloo")
    s = scores(token_level_rewards)
    a = s.clone()
    for rows in group_rows(index, s.shape[0], "rloo"):
        n = len(rows)
        if n > 1:
            a[rows] = (s[rows] - s[rows].mean()) * (n / (n - 1))
    out = broadcast(a, m, token_level_rewards)
    return out, out


@estimator("opo", needs_groups=True)
@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards, response_mask, index):
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): length-weighted baseline
    ``b_g = Σ_j L_j s_j / Σ_j L_j`` (``L_j`` = valid tokens), ``a_i = s_i − b_g``.
    Singleton groups, and groups whose rows are all masked, use ``b = 0``."""
    m = check_rewards(token_level_rewards, response_mask, "opo")
    s = scores(token_level_rewards)
    lengths = m.sum(dim=-1).to(torch.float64)
    a = s.clone()
    for rows in group_rows(index, s.shape[0], "opo"):
        total = lengths[rows].sum()
        if len(rows) > 1 and bool(total > 0):
            a[rows] = s[rows] - (lengths[rows] * s[rows]).sum() / total
    out = broadcast(a, m, token_level_rewards)
    return out, out


@estimator("gpg", needs_groups=True)
@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards, response_mask, index, f_norm=1.0):
    """GPG (Chu et al. 2025, arXiv 2504.02546): ``a_i = α (s_i − mean_g)/f_norm`` with
    ``α = B / max(#{i: s_i ≠ 0}, 1)`` over the whole batch. Singleton groups: mean 0."""
    m = check_rewards(token_level_rewards, response_mask, "gpg")
    if f_norm == 0:
        raise ValueError("gpg: f_norm must be non-zero")
    s = scores(token_level_rewards)
    alpha = s.shape[0] / max(int((s != 0).sum()), 1)
    a = alpha * _group_centered(s, index, "gpg") / f_norm
    out = broadcast(a, m, token_level_rewards)
    return out, out
