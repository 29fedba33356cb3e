"""The phases of a step between generation and update: the old policy's log-probs, KL in the reward, then the
algorithm's advantages; and the per-row value DAPO dynamic sampling filters on.

The advantages are the resolved algorithm record's (``portrl.algo.spec.algorithm_spec``): the estimator
``algorithm.adv_estimator`` for the policy-gradient objective, the objective's own for sppo and dpo
(``portrl/algo/objectives.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

import torch

from portrl.algo import algorithm_spec, apply_kl_penalty
from portrl.workers.actor import ActorRolloutWorker, old_log_probs_needed
from portrl.workers.batch import Batch

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig
    from portrl.workers.group import WorkerGroup


def old_policy_phase(cfg: PortRLConfig, actor: WorkerGroup[ActorRolloutWorker], batch: Batch,
                     timer: Any) -> Dict[str, float]:
    """``old_log_probs`` of ``batch``: the rollout engine's in verl's bypass mode
    (``algorithm.rollout_correction.bypass_mode``), else the actor's forward where the loss needs it
    (portrl.workers.actor.old_log_probs_needed); ``actor/entropy_old`` when that forward ran."""
    if cfg.algorithm.rollout_correction.bypass_mode:  # verl's bypass mode: the rollout policy is the old one
        if "rollout_log_probs" not in batch:
            raise ValueError("algorithm.rollout_correction.bypass_mode needs the rollout engine's log-probs, "
                             "and this engine returned none")
        batch["old_log_probs"] = batch.tensors["rollout_log_probs"]
        return {}
    if not old_log_probs_needed(cfg, len(batch)):
        return {}
    with timer("old_log_prob"):
        old = actor.concat(ActorRolloutWorker.compute_log_probs, batch)
        ent = old.pop("entropys")
        batch.union(old)
        mask = batch.tensors["response_mask"]
        return {"actor/entropy_old": float((ent * mask).sum() / mask.sum().clamp(min=1))}


def apply_reward_kl(cfg: PortRLConfig, batch: Batch, kl_ctrl: Any) -> Dict[str, float]:
    """``token_level_rewards`` = scores, minus ``beta * KL(old || ref)`` when ``use_kl_in_reward``."""
    if not cfg.algorithm.use_kl_in_reward:
        batch["token_level_rewards"] = batch.tensors["token_level_scores"]
        return {}
    rewards, m = apply_kl_penalty(batch.tensors["token_level_scores"], batch.tensors["old_log_probs"],
                                  batch.tensors["ref_log_probs"], batch.tensors["response_mask"], kl_ctrl,
                                  str(cfg.algorithm.kl_penalty))
    batch["token_level_rewards"] = rewards
    return dict(m)


def compute_batch_advantages(cfg: PortRLConfig, batch: Batch) -> Dict[str, float]:
    """Fill ``advantages``/``returns`` (or the objective's tensors, e.g. DPO's pairs) in ``batch``; returns
    metrics. The prompt uid is the group index; ``rollout.n`` the group size."""
    spec = algorithm_spec(cfg.algorithm)
    tensors = {**batch.tensors, **numeric_reward_extras(batch)}
    out, metrics = spec.advantages(cfg.algorithm, tensors, batch.meta["uid"], int(cfg.rollout.n))
    for key, value in out.items():
        batch[key] = value
    return metrics


def numeric_reward_extras(batch: Batch) -> Dict[str, torch.Tensor]:
    """The reward function's extra values that are a number on every row (``reward_extra/<key>`` of the batch's
    meta) as float64 tensors under the same names: GDPO's reward components (``algorithm.gdpo_reward_keys``)."""
    out: Dict[str, torch.Tensor] = {}
    for key, values in batch.meta.items():
        if key.startswith("reward_extra/"):
            try:
                out[key] = torch.tensor([float(v) for v in values], dtype=torch.float64)
            except (TypeError, ValueError):
                continue  # text or missing values (e.g. the parsed answer) are not reward components
    return out


def seq_metric(cfg: PortRLConfig, batch: Batch) -> torch.Tensor:
    """The per-row value DAPO dynamic sampling filters on (``algorithm.filter_groups.metric``)."""
    name = str(cfg.algorithm.filter_groups.metric)
    if name == "acc":
        return batch.tensors["acc"].float()
    if name == "seq_reward":
        return batch.tensors["token_level_scores"].sum(-1)
    if name == "seq_final_reward":
        return batch.tensors.get("token_level_rewards", batch.tensors["token_level_scores"]).sum(-1)
    raise ValueError(f"algorithm.filter_groups.metric {name!r} is unknown; valid: acc, seq_reward, seq_final_reward")
