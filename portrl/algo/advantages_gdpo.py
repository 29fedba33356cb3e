"""GDPO (Group reward-Decoupled normalization Policy Optimization, Liu et al. 2026, arXiv 2601.05242; verl
``gdpo``): GRPO for several rewards at once, normalised one reward at a time.

GRPO sums the rewards and normalises the sum within each prompt group, so distinct reward combinations can
collapse to the same advantage. GDPO normalises each reward component ``k`` within each group on its own
(``A_k`` = GRPO of component k), sums them with weights, ``A = Σ_k w_k·A_k``, and whitens the sum over every
valid token of the batch (``masked_whiten``).

The components are per-row scores, e.g. the keys a custom reward function returns in its dict
(``algorithm.gdpo_reward_keys``, weights ``algorithm.gdpo_reward_weights``, default 1 each). Without components
the summed reward is the only one: ``A = whiten(GRPO(s))``. As verl, a component counts only on rows whose
response is not empty (an empty response scores 0 in its group's statistics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from portrl.algo.advantages_outcome import compute_grpo_outcome_advantage
from portrl.algo.groups import check_rewards
from portrl.algo.masked import compute_dtype, masked_whiten
from portrl.algo.options import option
from portrl.algo.spec import estimator


@dataclass
class GDPOOptions:
    """``algorithm.gdpo_reward_keys``: the reward components, numeric keys of the dict a custom reward function
    returns other than score and acc (null: the summed score is the only component); ``gdpo_reward_weights``: their
    weights (null: 1 each). Its batch inputs (:func:`gdpo_inputs`) turn the keys into ``reward_components``."""

    gdpo_reward_keys: Optional[List[str]] = option(None)
    gdpo_reward_weights: Optional[List[float]] = option(None)


def _component_rewards(values, mask: torch.Tensor, name: str) -> torch.Tensor:
    """(B,) scores as (B,T) rewards with the score on the last valid token (0 for an empty response)."""
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1).to(mask.device)
    if v.shape[0] != mask.shape[0]:
        raise ValueError(f"gdpo: reward component {name!r} has {v.shape[0]} values for {mask.shape[0]} rows")
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"gdpo: reward component {name!r} has a value that is not a finite number")
    lengths = mask.sum(-1)
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows = torch.nonzero(lengths > 0).flatten()
    last = mask.shape[1] - 1 - torch.flip(mask, dims=[-1]).to(torch.int8).argmax(-1)
    out[rows, last[rows]] = v[rows]
    return out


#: prefix of the per-row reward extras (keys of a reward function's dict) among the advantage phase's tensors
REWARD_EXTRA = "reward_extra/"


def reward_components(options: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
                      ) -> Optional[Dict[str, torch.Tensor]]:
    """The per-row reward components named by the option ``gdpo_reward_keys`` (tensors ``reward_extra/<key>``),
    in that order; None when no keys are set. A key the reward function did not return is a ValueError."""
    keys = options.get("gdpo_reward_keys")
    if not keys:
        return None
    have = sorted(k[len(REWARD_EXTRA):] for k in tensors if k.startswith(REWARD_EXTRA))
    missing = [str(k) for k in keys if REWARD_EXTRA + str(k) not in tensors]
    if missing:
        raise ValueError(f"algorithm.gdpo_reward_keys {missing} are not numeric values of the reward function's "
                         f"result; it returned: {', '.join(have) or '(no extra values: return a dict with them)'}")
    return {str(k): tensors[REWARD_EXTRA + str(k)] for k in keys}


def gdpo_inputs(options: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """GDPO's batch inputs (``EstimatorSpec.inputs``): the reward components its keys name, and their weights."""
    return {"reward_components": reward_components(options, tensors),
            "reward_weights": options.get("gdpo_reward_weights")}


@estimator("gdpo", options=GDPOOptions, inputs=gdpo_inputs, needs_groups=True)
@torch.no_grad()
def compute_gdpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True,
                                   reward_components: Optional[Mapping[str, torch.Tensor | Sequence[float]]] = None,
                                   reward_weights: Optional[Sequence[float]] = None):
    """``A = masked_whiten(Σ_k w_k · GRPO(component_k), m)·m`` (see the module docstring). ``reward_components``:
    name -> one score per row, in the order of ``reward_weights``; None: the summed reward only. Each GRPO keeps
    its own conventions (singleton group: raw score; zero-spread group: 0). Returns ``(A, A)``."""
    m = check_rewards(token_level_rewards, response_mask, "gdpo")
    if reward_components:
        parts = [_component_rewards(v, m, k) for k, v in reward_components.items()]
    else:
        parts = [token_level_rewards.to(torch.float64)]
    weights = [1.0] * len(parts) if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != len(parts):
        raise ValueError(f"gdpo: {len(weights)} reward weights for {len(parts)} reward components")
    total = torch.zeros(token_level_rewards.shape, dtype=torch.float64, device=m.device)
    for w, rewards in zip(weights, parts):
        adv, _ = compute_grpo_outcome_advantage(rewards, m, index, epsilon=epsilon,
                                                norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        total = total + w * adv
    out = (masked_whiten(total, m) * m).to(compute_dtype(token_level_rewards))
    return out, out
