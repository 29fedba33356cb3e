"""PRIME's advantage (Cui et al. 2025, arXiv:2502.01456; verl recipe/prime ``compute_rloo_advantage_return``).

Registered as ``prime``: verl's recipe calls it ``rloo`` (``algorithm.adv_estimator: rloo``), a name portrl already
gives to the plain outcome RLOO of ``portrl/algo/advantages_outcome.py``, which this one is not: it combines two
reward sources and returns per-token advantages.

For each reward source, a leave-one-out baseline within the prompt group (rows sharing ``index``, n of them):
with ``μ_j`` the mean of row j's rewards over its positions of that source and ``S = Σ_j μ_j``, every reward
``x_it`` of row i becomes ``x_it·n/(n−1) − S/(n−1)`` (verl's ``masked_rloo``; for one reward per row this is
``x_i − mean_{j≠i} x_j``). The sources:

* the implicit process rewards ``implicit_rewards`` (PRIME's token rewards from the implicit PRM,
  ``portrl/trainer/prime_phase.py``), over every response token, weighted by ``reward_dpo_coef``;
* the outcome reward, each row's summed ``token_level_rewards`` at its last response token, weighted by
  ``reward_gt_coef``. verl uses the verifier's 0/1 accuracy there; for a 0/1 rule reward the two are equal.

The weighted sum gives per-token rewards; ``returns`` are their reverse cumulative sums over the response (γ = 1)
and ``advantages`` the returns whitened over every response token of the batch (``masked_whiten``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence, Tuple

import torch

from portrl.algo.groups import check_rewards, group_rows
from portrl.algo.masked import masked_whiten
from portrl.algo.options import option
from portrl.algo.spec import estimator


@dataclass
class PrimeOptions:
    """``algorithm.reward_dpo_coef`` / ``reward_gt_coef``: weights of the implicit process rewards and of the
    outcome reward in the combined advantage (verl recipe/prime's names and values)."""

    reward_dpo_coef: float = option(5.0, ge=0.0, doc="weight of the implicit PRM's token rewards")
    reward_gt_coef: float = option(5.0, ge=0.0, doc="weight of the outcome (ground-truth) reward")


def leave_one_out(rewards: torch.Tensor, mask: torch.Tensor, index: Sequence[Hashable], who: str) -> torch.Tensor:
    """verl's ``masked_rloo`` on ``(B,T)`` rewards at the positions of ``mask`` (0 elsewhere), by prompt group; a
    group of one row has no baseline and is a ValueError. float64."""
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    x = torch.where(mask, rewards.double().to(mask.device), zero)
    counts = mask.sum(-1)
    row_mean = x.sum(-1) / counts.clamp(min=1)
    out = torch.zeros_like(x)
    for rows in group_rows(index, x.shape[0], who):
        n = len(rows)
        if n < 2:
            raise ValueError(f"{who}: a prompt group has one response; the leave-one-out baseline needs "
                             f"rollout.n >= 2")
        total = row_mean[rows].sum()
        out[rows] = x[rows] * (n / (n - 1)) - total / (n - 1)
    return torch.where(mask, out, zero)


@estimator("prime", options=PrimeOptions, needs_groups=True, needs_implicit_rewards=True)
def compute_prime_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                            index: Sequence[Hashable], implicit_rewards: Optional[torch.Tensor] = None,
                            reward_dpo_coef: float = 5.0,
                            reward_gt_coef: float = 5.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``(B,T)`` of PRIME (see the module docstring); float32 (float64 for float64
    rewards). ``implicit_rewards`` ``(B,T)`` is required."""
    who = "prime advantage"
    m = check_rewards(token_level_rewards, response_mask, who)
    if implicit_rewards is None:
        raise ValueError(f"{who}: needs implicit_rewards, the implicit PRM's token rewards (the trainer computes "
                         f"them when the algorithm's record says needs_implicit_rewards)")
    if implicit_rewards.shape != token_level_rewards.shape:
        raise ValueError(f"{who}: implicit_rewards has shape {tuple(implicit_rewards.shape)}, the rewards "
                         f"{tuple(token_level_rewards.shape)}")
    combined = torch.zeros(m.shape, dtype=torch.float64, device=m.device)
    if float(reward_dpo_coef) != 0.0:
        combined += leave_one_out(implicit_rewards, m, index, who) * float(reward_dpo_coef)
    if float(reward_gt_coef) != 0.0:
        positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
        last = torch.where(m, positions, torch.full_like(positions, -1)).max(-1).values
        at_last = (positions == last[:, None]) & m
        outcome = torch.where(at_last, token_level_rewards.double().sum(-1, keepdim=True),
                              torch.zeros((), dtype=torch.float64, device=m.device))
        combined += leave_one_out(outcome, at_last, index, who) * float(reward_gt_coef)
    returns = (combined * m).flip(-1).cumsum(-1).flip(-1)
    dtype = torch.float64 if token_level_rewards.dtype == torch.float64 else torch.float32
    advantages = masked_whiten(returns, m)
    return advantages.to(dtype), returns.to(dtype)
