"""Algorithm core: advantage estimators, objectives, policy losses, KL, value loss, aggregation, DAPO, DPO/SPPO.

Pure tensor functions, any device and dtype, registered by name (verl's names) in five registries:
``adv_estimator`` and ``objective`` (records of what each algorithm needs: ``portrl/algo/spec.py``),
``policy_loss``, ``loss_agg_mode``, ``kl_penalty`` (see ``registered(kind)``). Importing registers the
built-in entries; nothing else runs at import. Each entry may declare its own options next to its function
(``portrl/algo/options.py``); they become keys of the run config.
"""

from portrl.algo.advantages import compute_advantage, get_adv_estimator
from portrl.algo.aggregation import agg_loss
from portrl.algo.dapo import filter_groups, overlong_penalty
from portrl.algo.gae import compute_decoupled_gae, vapo_length_adaptive_lambda
from portrl.algo.kl import (AdaptiveKLController, FixedKLController, apply_kl_penalty, compute_kl_loss,
                            get_kl_controller, kl_penalty)
from portrl.algo.masked import (clip_by_value, entropy_from_logits, get_response_mask, masked_mean, masked_sum,
                                masked_var, masked_whiten)
import portrl.algo.objectives  # noqa: F401  (registers the built-in objectives)
from portrl.algo.options import option, policy_loss, register_policy_loss_options
from portrl.algo.policy_loss_registry import get_policy_loss
from portrl.algo.pf_ppo import pf_ppo_resample_indices, pf_ppo_weights
from portrl.algo.policy_losses_bypass import compute_policy_loss_reinforce
from portrl.algo.preference import dpo_loss, online_dpo_preference, positive_lm_loss, sppo_advantage, sppo_loss
from portrl.algo.registry import UnknownNameError, registered
from portrl.algo.spec import (AlgorithmSpec, EstimatorSpec, ObjectiveSpec, algorithm_spec, critic_enabled, estimator,
                              estimator_spec, implicit_prm_enabled, objective_spec, reference_enabled,
                              register_estimator, register_objective)
from portrl.algo.trl_aliases import TRL_LOSS_TYPE_TO_AGG_MODE, register_trl_aliases, trl_loss_type_to_agg_mode
from portrl.algo.value import compute_entropy_loss, compute_value_loss, explained_variance

register_trl_aliases()

__all__ = [
    "AlgorithmSpec", "EstimatorSpec", "ObjectiveSpec", "algorithm_spec", "critic_enabled", "estimator",
    "estimator_spec", "implicit_prm_enabled", "objective_spec", "reference_enabled", "register_estimator",
    "register_objective", "option", "policy_loss", "register_policy_loss_options",
    "AdaptiveKLController", "FixedKLController", "TRL_LOSS_TYPE_TO_AGG_MODE", "UnknownNameError", "agg_loss",
    "apply_kl_penalty", "clip_by_value", "compute_advantage", "compute_decoupled_gae", "compute_entropy_loss",
    "compute_kl_loss", "compute_value_loss", "dpo_loss", "entropy_from_logits", "explained_variance",
    "filter_groups",
    "get_adv_estimator", "get_kl_controller", "get_policy_loss", "get_response_mask", "kl_penalty",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten", "pf_ppo_resample_indices", "pf_ppo_weights",
    "compute_policy_loss_reinforce", "online_dpo_preference", "overlong_penalty",
    "positive_lm_loss", "registered", "sppo_advantage", "sppo_loss", "trl_loss_type_to_agg_mode",
    "vapo_length_adaptive_lambda",
]
