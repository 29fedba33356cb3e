"""The actor's loss on one micro-batch: policy objective, entropy bonus, KL loss, VAPO positive LM loss.

``L = L_obj - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(logp, ref)) + positive_lm_coef * L_lm``.
Every term is aggregated by ``agg_loss`` with the mini-batch's global counts (``info``), so summing
micro-batch losses gives the mini-batch loss exactly. The metrics named in ``ADDITIVE_METRICS`` are
such partial sums: add them over micro-batches, average them over data-parallel ranks.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from portrl.workers.batch import Batch

OBJECTIVES = ("policy_gradient", "sppo", "dpo")
ADDITIVE_METRICS = frozenset({"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/positive_lm_loss"})


def policy_loss_config(cfg: Any, info: Mapping[str, Any]) -> Dict[str, Any]:
    """The mapping policy losses read (clip ratios, SAPO temperatures, clip-cov / kl-cov knobs, global counts)."""
    a = cfg.actor
    pl = a.policy_loss
    clip = float(a.clip_ratio)
    return {
        "clip_ratio": clip,
        "clip_ratio_low": float(a.clip_ratio_low) if a.clip_ratio_low is not None else clip,
        "clip_ratio_high": float(a.clip_ratio_high) if a.clip_ratio_high is not None else clip,
        "clip_ratio_c": float(a.clip_ratio_c),
        "tau_pos": float(a.tau_pos), "tau_neg": float(a.tau_neg),
        "clip_cov_ratio": float(pl.clip_cov_ratio), "clip_cov_lb": float(pl.clip_cov_lb),
        "clip_cov_ub": float(pl.clip_cov_ub), "kl_cov_ratio": float(pl.kl_cov_ratio),
        "ppo_kl_coef": float(pl.ppo_kl_coef), "dro_beta": pl.dro_beta,
        "global_batch_info": dict(info),
    }


def _scalar(v: Any) -> float:
    return float(v.detach().float().mean()) if isinstance(v, torch.Tensor) else float(v)


def _prefixed(metrics: Mapping[str, Any]) -> Dict[str, float]:
    return {(k if "/" in k else f"actor/{k}"): _scalar(v) for k, v in metrics.items()}


def actor_loss(cfg: Any, micro: Batch, logp: torch.Tensor, entropy: Optional[torch.Tensor],
               info: Mapping[str, Any], use_old: bool) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Loss and ``actor/*`` metrics of one micro-batch (tensors on the training device)."""
    from portrl.algo import agg_loss, get_policy_loss, kl_penalty, masked_mean
    from portrl.algo.rollout_correction import rollout_is_weights

    a = cfg.actor
    mode = str(a.loss_agg_mode)
    mask = micro.tensors["response_mask"]
    counts = {k: info[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")}
    pref_counts = dict(counts, num_pairs=info.get("num_pairs", 0))
    old = micro.tensors["old_log_probs"] if use_old else logp.detach()
    objective = str(cfg.algorithm.objective)
    metrics: Dict[str, float] = {}
    if objective == "policy_gradient":
        fn = get_policy_loss(str(a.policy_loss.loss_mode))
        weights = micro.tensors.get("rollout_is_weights")
        rc = cfg.algorithm.rollout_correction
        if weights is None and rc.rollout_is:
            if "rollout_log_probs" not in micro:
                raise ValueError("algorithm.rollout_correction.rollout_is needs the rollout engine's log-probs, and "
                                 "this batch has none")
            weights = rollout_is_weights(old, micro.tensors["rollout_log_probs"], mask, str(rc.rollout_is),
                                         float(rc.rollout_is_threshold))
            metrics["rollout_corr/is_weight_mean"] = _scalar(masked_mean(weights, mask))
        loss, m = fn(old, logp, micro.tensors["advantages"], mask, mode, policy_loss_config(cfg, info),
                     rollout_is_weights=weights)
        metrics.update(_prefixed(m))
        metrics["actor/pg_loss"] = _scalar(loss)
    elif objective in ("sppo", "dpo"):
        loss, m = _preference_loss(cfg, objective, micro, logp, old, pref_counts)
        metrics.update(_prefixed(m))
        metrics["actor/pg_loss"] = _scalar(loss)
    else:
        raise ValueError(f"algorithm.objective {objective!r} is unknown; valid: {list(OBJECTIVES)}")
    if entropy is not None:
        ent = agg_loss(entropy, mask, mode, **counts)
        metrics["actor/entropy"] = _scalar(ent)
        if float(a.entropy_coeff) != 0.0:
            loss = loss - float(a.entropy_coeff) * ent
    if a.use_kl_loss:
        if "ref_log_probs" not in micro:
            raise ValueError("actor.use_kl_loss is on but the batch has no ref_log_probs")
        kl = kl_penalty(logp, micro.tensors["ref_log_probs"], str(a.kl_loss_type))
        kl_loss = agg_loss(kl, mask, mode, **counts)
        loss = loss + float(a.kl_loss_coef) * kl_loss
        metrics["actor/kl_loss"] = _scalar(kl_loss)
        metrics["actor/kl_coef"] = float(a.kl_loss_coef)
    if float(a.positive_lm_coef) != 0.0:
        from portrl.algo import positive_lm_loss

        positive = micro.tensors["acc"] > 0.5 if "acc" in micro else micro.tensors["token_level_scores"].sum(-1) > 0
        lm = positive_lm_loss(logp, mask, positive, loss_agg_mode=mode, **counts)
        loss = loss + float(a.positive_lm_coef) * lm
        metrics["actor/positive_lm_loss"] = _scalar(lm)
    return loss, metrics


def _preference_loss(cfg, objective, micro, logp, old, counts):
    """SPPO square loss on sequence log-ratios, or online DPO on the micro-batch's (chosen, rejected) pairs.

    DPO rows come in pairs ``[a0, b0, a1, b1, ...]`` (two samples of one prompt); ``dpo_chosen`` marks
    each pair's winner and ``dpo_valid`` the pairs whose rewards differ (ties carry no preference).
    The mean over this micro-batch's valid pairs is rescaled to ``Σ / global_pairs · dp`` so micro-batches
    and ranks add up to the mean over all valid pairs of the mini-batch (``counts["num_pairs"]``).
    """
    from portrl.algo import dpo_loss, sppo_loss

    mask = micro.tensors["response_mask"]
    if objective == "sppo":
        return sppo_loss(old, logp, micro.tensors["advantages"], mask, eta=float(cfg.actor.sppo_eta),
                         dp_size=int(counts["dp_size"]), global_batch_size=counts["global_batch_size"])
    a = cfg.algorithm
    seq = (logp * mask).sum(-1).reshape(-1, 2)
    chosen = micro.tensors["dpo_chosen"].reshape(-1, 2).bool()
    valid = micro.tensors["dpo_valid"].reshape(-1, 2)[:, 0].bool()
    if not bool(valid.any()):
        return (logp * 0).sum(), {}
    pc = torch.where(chosen[:, 0], seq[:, 0], seq[:, 1])[valid]
    pr = torch.where(chosen[:, 0], seq[:, 1], seq[:, 0])[valid]
    rc = rr = None
    if not a.dpo_reference_free:
        if "ref_log_probs" not in micro:
            raise ValueError("online DPO needs ref_log_probs (or algorithm.dpo_reference_free=true)")
        ref = (micro.tensors["ref_log_probs"] * mask).sum(-1).reshape(-1, 2)
        rc = torch.where(chosen[:, 0], ref[:, 0], ref[:, 1])[valid]
        rr = torch.where(chosen[:, 0], ref[:, 1], ref[:, 0])[valid]
    loss, m = dpo_loss(pc, pr, rc, rr, beta=float(a.dpo_beta), label_smoothing=float(a.dpo_label_smoothing),
                       loss_type=str(a.dpo_loss_type), reference_free=bool(a.dpo_reference_free))
    scale = float(valid.sum()) / max(1.0, float(counts["num_pairs"])) * int(counts["dp_size"])
    return loss * scale, m
