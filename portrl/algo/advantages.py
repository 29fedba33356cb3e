"""``compute_advantage``: one entry point for every registered advantage estimator.

Registered names: gae, vcppo_gae, vapo_gae (``gae``), grpo, grpo_passk, reinforce_plus_plus_baseline,
rloo, opo, gpg (``advantages_outcome``), grpo_vectorized, rloo_vectorized (``advantages_vectorized``), gdpo
(``advantages_gdpo``), reinforce_plus_plus, remax, optimal_token_baseline (``advantages_return``),
tir_optimal_token_baseline (``advantages_tir``), prime (``advantages_prime``), each with its record of needs (``portrl.algo.spec.EstimatorSpec``), and any an
outside package adds with ``portrl.algo.spec.register_estimator``. Each estimator takes the keyword arguments it needs; ``compute_advantage``
passes each only the arguments its signature names, so e.g. ``gamma`` reaches gae and
reinforce_plus_plus but not grpo (as verl's dispatcher does). An estimator's own options (the dataclass it
declares, ``portrl.algo.options``: ``lam_actor``, ``reward_dpo_coef``, a plugin's) come as further keywords.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

import portrl.algo.advantages_gdpo  # noqa: F401
import portrl.algo.advantages_outcome  # noqa: F401  (registers the outcome estimators)
import portrl.algo.advantages_prime  # noqa: F401
import portrl.algo.advantages_return  # noqa: F401
import portrl.algo.advantages_tir  # noqa: F401
import portrl.algo.advantages_vectorized  # noqa: F401
import portrl.algo.gae  # noqa: F401
from portrl.algo.registry import ADV_ESTIMATORS, registered


def get_adv_estimator(name: str) -> Callable:
    """The function of the registered estimator ``name``; unknown names raise, listing the registered ones."""
    return ADV_ESTIMATORS.get(name).fn


def compute_advantage(
    estimator: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Optional[Sequence] = None,
    values: Optional[torch.Tensor] = None,
    reward_baselines: Optional[torch.Tensor] = None,
    old_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    sum_pi_squared: Optional[torch.Tensor] = None,
    gamma=1.0,
    lam=1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    rollout_is_weights: Optional[torch.Tensor] = None,
    reward_components: Optional[Mapping[str, torch.Tensor | Sequence[float]]] = None,
    reward_weights: Optional[Sequence[float]] = None,
    implicit_rewards: Optional[torch.Tensor] = None,
    **options: Any,
):
    """Advantages and returns ``(B,T)`` by ``estimator`` (float32, float64 for float64 rewards).

    ``index`` holds one hashable group id (the prompt uid) per row. Options an estimator does not use
    are ignored; a required one that is missing (values for gae, index for grouped estimators,
    reward_baselines for remax, old_log_probs/sum_pi_squared for optimal_token_baseline) raises.
    ``reward_components`` (name -> one score per row) and ``reward_weights`` reach gdpo; ``implicit_rewards`` (the
    implicit PRM's token rewards) reaches prime. ``options`` are the estimator's own options by name
    (``lam_actor=0.9``, ``reward_dpo_coef=5.0``, a plugin's): each reaches the function when its signature names
    it; a non-null option that the estimator neither takes nor declares is a ValueError naming those that do.
    """
    spec = ADV_ESTIMATORS.get(estimator)
    offered = dict(
        token_level_rewards=token_level_rewards, response_mask=response_mask, index=index, values=values,
        reward_baselines=reward_baselines, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
        sum_pi_squared=sum_pi_squared, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon, rollout_is_weights=rollout_is_weights, reward_components=reward_components,
        reward_weights=reward_weights, implicit_rewards=implicit_rewards,
    )
    accepted = inspect.signature(spec.fn).parameters
    for opt, value in options.items():
        if value is not None and opt not in accepted and not spec.declares(opt):
            takers = [n for n in registered("adv_estimator") if ADV_ESTIMATORS.get(n).takes(opt)]
            raise ValueError(f"advantage estimator {estimator!r} does not take {opt}; "
                             f"estimators that take it: {', '.join(takers) or '(none)'}")
    offered.update(options)
    return spec.fn(**{k: v for k, v in offered.items() if k in accepted})
