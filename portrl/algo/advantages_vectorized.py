"""Vectorized GRPO and RLOO (verl ``grpo_vectorized``, ``rloo_vectorized``): the group statistics as scatter sums
over dense group numbers instead of a Python loop over groups.

Each gives the numbers of its loop estimator in ``advantages_outcome`` (same decisions for singleton and
zero-spread groups, the statistics in float64 as there: equal to float64 rounding, so float32 results differ by
at most one unit in the last place), only faster on large batches. Two deliberate differences from
verl's vectorized versions, both where verl's vectorized and loop versions disagree with each other:

* verl's ``grpo_vectorized`` floors the group variance at ``epsilon`` (``std ≥ √ε``), its ``grpo`` does not; here
  neither does, so a group whose spread is below ``√ε`` gets the loop's (large) advantages;
* verl's ``rloo_vectorized`` gives a singleton group advantage 0, its ``rloo`` keeps the raw score; here both
  keep the raw score.
"""

from __future__ import annotations

import torch

from portrl.algo.groups import broadcast, check_rewards, group_ids, scores
from portrl.algo.spec import estimator


def _group_counts_and_means(s: torch.Tensor, index, who: str):
    """``(gid, num_groups, count, mean)`` of the scores ``s`` per group of ``index`` (one group id per row)."""
    gid, num_groups = group_ids(index, s.shape[0], who)
    gid = gid.to(s.device)
    count = _group_sums(torch.ones_like(s), gid, num_groups)
    return gid, num_groups, count, _group_sums(s, gid, num_groups) / count


def _group_sums(values: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, gid, values)


@estimator("grpo_vectorized", needs_groups=True)
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                              norm_adv_by_std_in_grpo=True):
    """GRPO as ``grpo``: ``a_i = (s_i − mean_g)/(std_g + ε)`` (unbiased std), or ``s_i − mean_g`` without std
    normalisation; singleton group: ``mean 0, std 1``; zero-spread group: ``a = 0`` exactly."""
    m = check_rewards(token_level_rewards, response_mask, "grpo_vectorized")
    s = scores(token_level_rewards)
    gid, num_groups, count, mean = _group_counts_and_means(s, index, "grpo_vectorized")
    dev = s - mean[gid]
    std = (_group_sums(dev * dev, gid, num_groups) / (count - 1).clamp(min=1)).sqrt()
    high = torch.full_like(mean, -torch.inf).scatter_reduce(0, gid, s, "amax")
    low = torch.full_like(mean, torch.inf).scatter_reduce(0, gid, s, "amin")
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    centred = s - mean[gid]
    den = std + epsilon
    # grpo's (and verl's) singleton std is a float32 1, so its 1 + ε is rounded in float32: the same here
    den = torch.where(single, (torch.ones((), dtype=torch.float32) + epsilon).to(den.dtype), den)
    a = centred / den[gid] if norm_adv_by_std_in_grpo else centred
    a = torch.where((high == low)[gid] & ~single[gid], torch.zeros_like(a), a)
    out = broadcast(a, m, token_level_rewards)
    return out, out


@estimator("rloo_vectorized", needs_groups=True)
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index):
    """RLOO as ``rloo``: ``a_i = n/(n−1)·(s_i − mean_g)``; a singleton group keeps its raw score."""
    m = check_rewards(token_level_rewards, response_mask, "rloo_vectorized")
    s = scores(token_level_rewards)
    gid, _, count, mean = _group_counts_and_means(s, index, "rloo_vectorized")
    n = count[gid]
    a = torch.where(n > 1, (s - mean[gid]) * (n / (n - 1).clamp(min=1)), s)
    out = broadcast(a, m, token_level_rewards)
    return out, out
