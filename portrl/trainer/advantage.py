"""The advantage phase of a step: KL in the reward, then advantages per ``algorithm.objective``.

* policy_gradient: ``compute_advantage(algorithm.adv_estimator, ...)`` with the prompt uid as
  group index, critic values (GAE family), greedy baselines (ReMax), VC-PPO / VAPO lambdas.
* sppo: ``A_i = R_i - SoftMean_eta(R of i's group)`` (``algorithm.sppo_eta``), broadcast over tokens.
* dpo: rows ``2k, 2k+1`` (two samples of one prompt) form a pair; ``dpo_chosen`` marks the one with
  the larger reward, ``dpo_valid`` the pairs whose rewards differ.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from portrl.workers.batch import Batch


def apply_reward_kl(cfg: Any, batch: Batch, kl_ctrl: Any) -> Dict[str, float]:
    """``token_level_rewards`` = scores, minus ``beta * KL(old || ref)`` when ``use_kl_in_reward``."""
    if not cfg.algorithm.use_kl_in_reward:
        batch["token_level_rewards"] = batch.tensors["token_level_scores"]
        return {}
    from portrl.algo import apply_kl_penalty

    rewards, m = apply_kl_penalty(batch.tensors["token_level_scores"], batch.tensors["old_log_probs"],
                                  batch.tensors["ref_log_probs"], batch.tensors["response_mask"], kl_ctrl,
                                  str(cfg.algorithm.kl_penalty))
    batch["token_level_rewards"] = rewards
    return dict(m)


def compute_batch_advantages(cfg: Any, batch: Batch) -> Dict[str, float]:
    """Fill ``advantages``/``returns`` (or the DPO pair tensors) in ``batch``; returns metrics."""
    a = cfg.algorithm
    t = batch.tensors
    mask = t["response_mask"]
    rewards = t["token_level_rewards"]
    objective = str(a.objective)
    if objective == "sppo":
        from portrl.algo import sppo_advantage

        adv = sppo_advantage(rewards.sum(-1), beta=float(a.sppo_eta), index=batch.meta["uid"]).float()
        batch["advantages"] = adv[:, None] * mask
        batch["returns"] = batch.tensors["advantages"]
        return {}
    if objective == "dpo":
        from portrl.algo import online_dpo_preference

        if len(batch) % 2 or int(cfg.rollout.n) % 2:
            raise ValueError(f"online DPO pairs two samples of a prompt: rollout.n must be even, got {cfg.rollout.n}")
        batch["dpo_chosen"] = online_dpo_preference(rewards, mask)
        s = (rewards * mask).sum(-1).reshape(-1, 2)
        batch["dpo_valid"] = (s[:, 0] != s[:, 1]).repeat_interleave(2)
        return {"actor/dpo_valid_pairs": float(batch.tensors["dpo_valid"].float().mean())}
    if objective != "policy_gradient":
        raise ValueError(f"algorithm.objective {objective!r} is unknown; valid: policy_gradient, sppo, dpo")
    from portrl.algo import compute_advantage

    adv, ret = compute_advantage(
        str(a.adv_estimator), token_level_rewards=rewards, response_mask=mask, index=batch.meta["uid"],
        values=t.get("values"), reward_baselines=t.get("reward_baselines"), old_log_probs=t.get("old_log_probs"),
        gamma=float(a.gamma), lam=float(a.lam), norm_adv_by_std_in_grpo=bool(a.norm_adv_by_std_in_grpo),
        lam_actor=a.lam_actor, lam_critic=a.lam_critic, vapo_alpha=a.vapo_alpha)
    batch["advantages"] = adv.float()
    batch["returns"] = ret.float()
    return {}


def needs_values(cfg: Any) -> bool:
    """The critic runs when ``critic.enable`` says so, or (auto) for the GAE family of estimators."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return str(cfg.algorithm.objective) == "policy_gradient" and str(cfg.algorithm.adv_estimator) in (
        "gae", "vcppo_gae", "vapo_gae")


def needs_reference(cfg: Any) -> bool:
    """The reference runs when ``ref.enable`` says so, or (auto) when a KL term or DPO needs it."""
    if cfg.ref.enable is not None:
        return bool(cfg.ref.enable)
    a = cfg.algorithm
    return bool(cfg.actor.use_kl_loss or a.use_kl_in_reward or (str(a.objective) == "dpo" and not a.dpo_reference_free))


def seq_metric(cfg: Any, batch: Batch) -> torch.Tensor:
    """The per-row value DAPO dynamic sampling filters on (``algorithm.filter_groups.metric``)."""
    name = str(cfg.algorithm.filter_groups.metric)
    if name == "acc":
        return batch.tensors["acc"].float()
    if name == "seq_reward":
        return batch.tensors["token_level_scores"].sum(-1)
    if name == "seq_final_reward":
        return batch.tensors.get("token_level_rewards", batch.tensors["token_level_scores"]).sum(-1)
    raise ValueError(f"algorithm.filter_groups.metric {name!r} is unknown; valid: acc, seq_reward, seq_final_reward")
