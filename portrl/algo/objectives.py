"""The built-in objectives (config ``algorithm.objective``): their advantages and losses, registered at the end.

* ``policy_gradient``: advantages by ``algorithm.adv_estimator`` (``compute_advantage`` with the prompt uid
  as group index, critic values, greedy baselines, the VC-PPO / VAPO lambdas); loss
  ``actor.policy_loss.loss_mode`` with optional rollout importance weights
  (``algorithm.rollout_correction``), or verl's ``bypass_mode`` loss with ``rollout_correction.bypass_mode``
  (old policy = the rollout engine's log-probs; ``portrl/algo/policy_losses_bypass.py``). An estimator's further
  batch inputs are the ones its record declares (``EstimatorSpec.inputs``).
* ``sppo``: ``A_i = R_i - SoftMean_eta(R of i's group)`` (``algorithm.sppo_eta``; the whole batch is the group
  when ``rollout.n = 1``), broadcast over tokens;
  SPPO's square loss on sequence log-ratios (``actor.sppo_eta``).
* ``dpo``: rows ``2k, 2k+1`` (two samples of one prompt) form a pair; ``dpo_chosen`` marks the one with the
  larger reward, ``dpo_valid`` the pairs whose rewards differ; online DPO loss on the valid pairs (their number
  over the mini-batch is its record's ``counts``).

Signatures are ``portrl.algo.spec.AdvantageFn`` and ``LossFn``: config sections and tensors in, tensors
and metrics out. Loss metrics are raw (tensors or floats; the actor names and reduces them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Sequence, Tuple

import torch

from portrl.algo.advantages import compute_advantage
from portrl.algo.masked import masked_mean
from portrl.algo.options import option, option_values, policy_loss_options
from portrl.algo.policy_loss_registry import get_policy_loss
from portrl.algo.registry import POLICY_LOSSES
from portrl.algo.preference import dpo_loss, online_dpo_preference, sppo_advantage, sppo_loss
from portrl.algo.rollout_correction import rollout_is_weights
from portrl.algo.spec import ObjectiveSpec, estimator_spec, register_objective

Tensors = Mapping[str, torch.Tensor]


@dataclass
class SPPOOptions:
    """``algorithm.sppo_eta``: the soft-mean temperature beta of SPPO's advantage (0 = arithmetic mean)."""

    sppo_eta: float = option(1.0, ge=0.0, doc="soft-mean temperature of the advantage (0: arithmetic mean)")


@dataclass
class SPPOLossOptions:
    """``actor.sppo_eta``: eta of SPPO's square loss (verl recipe/sppo's actor key)."""

    SECTION: ClassVar[str] = "actor"
    sppo_eta: float = option(1.0, doc="eta of the square loss (log-ratio - eta * advantage)^2")


@dataclass
class DPOOptions:
    """Online DPO (pairs of sampled responses): ``algorithm.dpo_beta``, ``dpo_loss_type``, ``dpo_label_smoothing``,
    ``dpo_reference_free`` (no reference policy: the log-ratios are the policy's own)."""

    dpo_beta: float = option(0.1, gt=0.0, doc="beta of the DPO loss")
    dpo_loss_type: str = option("sigmoid", choices=("sigmoid", "ipo"))
    dpo_label_smoothing: float = option(0.0, ge=0.0, le=0.5, doc="conservative DPO: share of flipped labels")
    dpo_reference_free: bool = option(False)


# ------------------------------------------------------------------------------------ advantages
def estimator_advantages(algorithm: Any, tensors: Tensors, index: Sequence,
                         group_size: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """``advantages`` and ``returns`` (float32) by the estimator ``algorithm.adv_estimator``, given its options and
    the batch inputs its record declares (``EstimatorSpec.inputs``)."""
    a = algorithm
    spec = estimator_spec(str(a.adv_estimator))
    options = option_values(spec.options, {"algorithm": a}, owner=("adv_estimator", spec.name))
    if spec.inputs is not None:
        options.update(spec.inputs(options, tensors))
    adv, ret = compute_advantage(
        str(a.adv_estimator), token_level_rewards=tensors["token_level_rewards"],
        response_mask=tensors["response_mask"], index=index, values=tensors.get("values"),
        reward_baselines=tensors.get("reward_baselines"), old_log_probs=tensors.get("old_log_probs"),
        ref_log_probs=tensors.get("ref_log_probs"), sum_pi_squared=tensors.get("sum_pi_squared"),
        gamma=float(a.gamma), lam=float(a.lam), norm_adv_by_std_in_grpo=bool(a.norm_adv_by_std_in_grpo),
        implicit_rewards=tensors.get("implicit_rewards"), **options)
    return {"advantages": adv.float(), "returns": ret.float()}, {}


def sppo_advantages(algorithm: Any, tensors: Tensors, index: Sequence,
                    group_size: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """SPPO's soft-mean advantage of the summed reward, broadcast over the response tokens: the soft mean is taken
    over each prompt's responses when there are several (``group_size > 1``), else over the whole batch (verl's
    SPPO recipe samples one response per prompt; a group of one would leave every advantage at 0)."""
    groups = index if group_size > 1 else None
    adv = sppo_advantage(tensors["token_level_rewards"].sum(-1), beta=float(algorithm.sppo_eta), index=groups).float()
    adv = adv[:, None] * tensors["response_mask"]
    return {"advantages": adv, "returns": adv}, {}


def dpo_pairs(algorithm: Any, tensors: Tensors, index: Sequence,
              group_size: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """``dpo_chosen`` / ``dpo_valid`` of the row pairs, and ``actor/dpo_valid_pairs`` (share of valid pairs)."""
    rewards, mask = tensors["token_level_rewards"], tensors["response_mask"]
    if rewards.shape[0] % 2 or group_size % 2:
        raise ValueError(f"online DPO pairs two samples of a prompt: rollout.n must be even, got {group_size}")
    s = (rewards * mask).sum(-1).reshape(-1, 2)
    valid = (s[:, 0] != s[:, 1]).repeat_interleave(2)
    return ({"dpo_chosen": online_dpo_preference(rewards, mask), "dpo_valid": valid},
            {"actor/dpo_valid_pairs": float(valid.float().mean())})


def dpo_counts(tensors: Tensors) -> Dict[str, float]:
    """``num_pairs``: the valid pairs among these rows (each pair's two rows are marked)."""
    return {"num_pairs": float(tensors["dpo_valid"].sum()) / 2}


# ---------------------------------------------------------------------------------------- losses
def policy_loss_config(actor: Any, info: Mapping[str, Any], algorithm: Any = None) -> Dict[str, Any]:
    """The mapping policy losses read: the clip ratios, the global counts, and the options the loss
    ``actor.policy_loss.loss_mode`` declares (``portrl.algo.options``: SAPO's temperatures, clip-cov / kl-cov
    knobs, DRO's beta, a plugin's own), read from the sections where they live."""
    clip = float(actor.clip_ratio)
    sections = {"algorithm": algorithm, "actor": actor, "actor.policy_loss": actor.policy_loss}
    name = POLICY_LOSSES.resolve(str(actor.policy_loss.loss_mode))
    return {
        "clip_ratio": clip,
        "clip_ratio_low": float(actor.clip_ratio_low) if actor.clip_ratio_low is not None else clip,
        "clip_ratio_high": float(actor.clip_ratio_high) if actor.clip_ratio_high is not None else clip,
        "clip_ratio_c": float(actor.clip_ratio_c),
        **option_values(policy_loss_options(name), sections, owner=("policy_loss", name)),
        "global_batch_info": dict(info),
    }


def policy_gradient_loss(actor: Any, algorithm: Any, tensors: Tensors, logp: torch.Tensor, old: torch.Tensor,
                         info: Mapping[str, Any]) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """The policy loss ``actor.policy_loss.loss_mode`` on ``advantages``, truncated-IS weighted when
    ``algorithm.rollout_correction.rollout_is`` is set (weights from ``rollout_log_probs``, or the batch's
    ``rollout_is_weights``: batch-normalised ones, portrl/workers/actor_correction.py); in bypass mode
    (``rollout_correction.bypass_mode``) the loss ``bypass_mode`` against ``rollout_log_probs``."""
    mask = tensors["response_mask"]
    weights = tensors.get("rollout_is_weights")
    rc = algorithm.rollout_correction
    metrics: Dict[str, Any] = {}
    config = policy_loss_config(actor, info, algorithm)
    if rc.get("bypass_mode", False):
        if "rollout_log_probs" not in tensors:
            raise ValueError("algorithm.rollout_correction.bypass_mode needs the rollout engine's log-probs, and "
                             "this batch has none")
        config["rollout_correction"] = {"loss_type": str(rc.loss_type), "rollout_is": rc.rollout_is,
                                        "rollout_is_threshold": float(rc.rollout_is_threshold)}
        fn = get_policy_loss("bypass_mode")
        return fn(tensors["rollout_log_probs"], logp, tensors["advantages"], mask, str(actor.loss_agg_mode), config)
    if weights is None and rc.rollout_is:
        if "rollout_log_probs" not in tensors:
            raise ValueError("algorithm.rollout_correction.rollout_is needs the rollout engine's log-probs, and "
                             "this batch has none")
        weights = rollout_is_weights(old, tensors["rollout_log_probs"], mask, str(rc.rollout_is),
                                     float(rc.rollout_is_threshold))
    if weights is not None:
        metrics["rollout_corr/is_weight_mean"] = masked_mean(weights, mask)
    fn = get_policy_loss(str(actor.policy_loss.loss_mode))
    loss, m = fn(old, logp, tensors["advantages"], mask, str(actor.loss_agg_mode), config,
                 rollout_is_weights=weights)
    metrics.update(m)
    return loss, metrics


def sppo_objective_loss(actor: Any, algorithm: Any, tensors: Tensors, logp: torch.Tensor, old: torch.Tensor,
                        info: Mapping[str, Any]) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """SPPO's square loss on sequence log-ratios against ``actor.sppo_eta * advantages``."""
    return sppo_loss(old, logp, tensors["advantages"], tensors["response_mask"], eta=float(actor.sppo_eta),
                     dp_size=int(info["dp_size"]), global_batch_size=info["global_batch_size"])


def dpo_objective_loss(actor: Any, algorithm: Any, tensors: Tensors, logp: torch.Tensor, old: torch.Tensor,
                       info: Mapping[str, Any]) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """Online DPO on the micro-batch's (chosen, rejected) pairs.

    Rows come in pairs ``[a0, b0, a1, b1, ...]``; ``dpo_chosen`` marks each pair's winner and ``dpo_valid``
    the pairs whose rewards differ (ties carry no preference). The mean over this micro-batch's valid pairs
    is rescaled to ``Σ / global_pairs · dp`` so micro-batches and ranks add up to the mean over all valid
    pairs of the mini-batch (``info["num_pairs"]``).
    """
    a = algorithm
    mask = tensors["response_mask"]
    seq = (logp * mask).sum(-1).reshape(-1, 2)
    chosen = tensors["dpo_chosen"].reshape(-1, 2).bool()
    valid = tensors["dpo_valid"].reshape(-1, 2)[:, 0].bool()
    if not bool(valid.any()):
        return (logp * 0).sum(), {}
    pc = torch.where(chosen[:, 0], seq[:, 0], seq[:, 1])[valid]
    pr = torch.where(chosen[:, 0], seq[:, 1], seq[:, 0])[valid]
    rc = rr = None
    if not a.dpo_reference_free:
        if "ref_log_probs" not in tensors:
            raise ValueError("online DPO needs ref_log_probs (or algorithm.dpo_reference_free=true)")
        ref = (tensors["ref_log_probs"] * mask).sum(-1).reshape(-1, 2)
        rc = torch.where(chosen[:, 0], ref[:, 0], ref[:, 1])[valid]
        rr = torch.where(chosen[:, 0], ref[:, 1], ref[:, 0])[valid]
    loss, m = dpo_loss(pc, pr, rc, rr, beta=float(a.dpo_beta), label_smoothing=float(a.dpo_label_smoothing),
                       loss_type=str(a.dpo_loss_type), reference_free=bool(a.dpo_reference_free))
    scale = float(valid.sum()) / max(1.0, float(info.get("num_pairs", 0))) * int(info["dp_size"])
    return loss * scale, m


def _dpo_needs_reference(algorithm: Any) -> bool:
    return not algorithm.get("dpo_reference_free", False)


register_objective(ObjectiveSpec("policy_gradient", estimator_advantages, policy_gradient_loss, uses_estimator=True,
                                 uses_policy_loss=True))
register_objective(ObjectiveSpec("sppo", sppo_advantages, sppo_objective_loss,
                                 options=(SPPOOptions, SPPOLossOptions)))
register_objective(ObjectiveSpec("dpo", dpo_pairs, dpo_objective_loss, needs_reference=_dpo_needs_reference,
                                 needs_pairs=True, options=DPOOptions, counts=dpo_counts))
