"""The actor's loss on one micro-batch: the objective's loss, entropy bonus, KL loss, VAPO positive LM loss.

``L = L_obj - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(logp, ref)) + positive_lm_coef * L_lm``.
``L_obj`` is the loss of the algorithm's objective (``portrl.algo.spec.algorithm_spec(cfg.algorithm).loss``:
the policy loss, SPPO or online DPO, ``portrl/algo/objectives.py``). Every term is aggregated by
``agg_loss`` with the mini-batch's global counts (``info``), so summing micro-batch losses gives the
mini-batch loss exactly. The metrics named in ``ADDITIVE_METRICS`` are such partial sums: add them over
micro-batches, average them over data-parallel ranks.

Rollout correction's rejection sampling has masked the rejected tokens out of ``response_mask`` before the update
(``portrl/workers/actor_correction.py``); a mini-batch whose every token was rejected has a zero loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

import torch

from portrl.algo import agg_loss, algorithm_spec, kl_penalty, positive_lm_loss
from portrl.workers.actor_correction import rejection_on
from portrl.workers.batch import Batch

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

ADDITIVE_METRICS = frozenset({"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/positive_lm_loss"})


def _scalar(v: Any) -> float:
    return float(v.detach().float().mean()) if isinstance(v, torch.Tensor) else float(v)


def _prefixed(metrics: Mapping[str, Any]) -> Dict[str, float]:
    return {(k if "/" in k else f"actor/{k}"): _scalar(v) for k, v in metrics.items()}


def actor_loss(cfg: PortRLConfig, micro: Batch, logp: torch.Tensor, entropy: Optional[torch.Tensor],
               info: Mapping[str, Any], use_old: bool) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Loss and ``actor/*`` metrics of one micro-batch (tensors on the training device)."""
    a = cfg.actor
    mode = str(a.loss_agg_mode)
    mask = micro.tensors["response_mask"]
    counts = {k: info[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")}
    if not info["batch_num_tokens"] and rejection_on(cfg):  # every token of the mini-batch rejected: nothing to learn
        return (logp * 0).sum(), {}
    old = micro.tensors["old_log_probs"] if use_old else logp.detach()
    loss, m = algorithm_spec(cfg.algorithm).loss(a, cfg.algorithm, micro.tensors, logp, old, info)
    metrics = _prefixed(m)
    metrics["actor/pg_loss"] = _scalar(loss)
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
        positive = micro.tensors["acc"] > 0.5 if "acc" in micro else micro.tensors["token_level_scores"].sum(-1) > 0
        lm = positive_lm_loss(logp, mask, positive, loss_agg_mode=mode, **counts)
        loss = loss + float(a.positive_lm_coef) * lm
        metrics["actor/positive_lm_loss"] = _scalar(lm)
    return loss, metrics
