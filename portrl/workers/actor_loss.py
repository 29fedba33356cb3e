"""The actor's loss on one micro-batch: the objective's loss, entropy bonus, KL loss, VAPO positive LM loss.

``L = L_obj - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(logp, ref)) + positive_lm_coef * L_lm``.
``L_obj`` is the loss of the algorithm's objective (``portrl.algo.spec.algorithm_spec(cfg.algorithm).loss``:
the policy loss, SPPO or online DPO, ``portrl/algo/objectives.py``). Every term is aggregated by
``agg_loss`` with the mini-batch's global counts (``info``), so summing micro-batch losses gives the
mini-batch loss exactly. The metrics named in ``ADDITIVE_METRICS`` are such partial sums: add them over
micro-batches, average them over data-parallel ranks.

Rollout correction's rejection sampling (``algorithm.rollout_correction.rollout_rs`` / ``rollout_token_veto_threshold``,
``portrl.algo.rollout_correction``) decides which tokens the loss covers: :func:`apply_rejection` multiplies the
batch's ``response_mask`` by the rejection mask before the update, so the global counts leave rejected tokens out
too. A mini-batch whose every token was rejected has a zero loss (its optimizer step then only applies the
optimizer's momentum). In the ``seq-mean-*`` aggregation modes a wholly rejected row still counts in the number of
sequences the loss is divided by (the global count of rows).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from portrl.algo import agg_loss, algorithm_spec, kl_penalty, positive_lm_loss
from portrl.algo.rollout_correction import correction_stats, rejection_mask
from portrl.workers.batch import Batch

ADDITIVE_METRICS = frozenset({"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/positive_lm_loss"})
#: the batch's response mask before rejection sampling (:func:`apply_rejection`), read by the rollout-gap metrics
UNREJECTED_MASK = "response_mask_unrejected"


def rejection_on(cfg: Any) -> bool:
    """Whether rollout correction rejects tokens (``rollout_rs`` or ``rollout_token_veto_threshold`` set)."""
    rc = cfg.algorithm.rollout_correction
    return rc.get("rollout_rs") is not None or rc.get("rollout_token_veto_threshold") is not None


def apply_rejection(cfg: Any, batch: Batch) -> Batch:
    """``batch`` (not copied) when nothing is rejected; else a shallow copy whose ``response_mask`` is multiplied by
    the rejection mask of ``old_log_probs`` against ``rollout_log_probs`` (:func:`portrl.algo.rollout_correction.
    rejection_mask`), the mask before it kept as ``UNREJECTED_MASK``. A batch without those log-probs is a
    ValueError (rejection needs the proximal and the behaviour policy)."""
    if not rejection_on(cfg):
        return batch
    for key in ("rollout_log_probs", "old_log_probs"):
        if key not in batch:
            raise ValueError(f"algorithm.rollout_correction rejection (rollout_rs / rollout_token_veto_threshold) "
                             f"needs {key} in the batch, and this one has none")
    rc = cfg.algorithm.rollout_correction
    mask = batch.tensors["response_mask"]
    out = Batch(batch.tensors, batch.meta, batch.info)
    out[UNREJECTED_MASK] = mask
    out["response_mask"] = rejection_mask(batch.tensors["old_log_probs"], batch.tensors["rollout_log_probs"], mask,
                                          rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower,
                                          rc.rollout_token_veto_threshold)
    return out


def correction_stats_of(cfg: Any, micro: Batch, old: torch.Tensor) -> Dict[str, float]:
    """The ``rollout_corr/*`` partial statistics of ``micro`` (:func:`portrl.algo.rollout_correction.
    correction_stats`): proximal ``old`` against its ``rollout_log_probs``, IS weights at ``rollout_is`` (token
    level when it is off), on the mask before rejection."""
    rc = cfg.algorithm.rollout_correction
    mask = micro.tensors["response_mask"]
    return correction_stats(old, micro.tensors["rollout_log_probs"], micro.get(UNREJECTED_MASK, mask), mask,
                            str(rc.rollout_is or "token"), float(rc.rollout_is_threshold),
                            rc.get("rollout_token_veto_threshold"))


def _scalar(v: Any) -> float:
    return float(v.detach().float().mean()) if isinstance(v, torch.Tensor) else float(v)


def _prefixed(metrics: Mapping[str, Any]) -> Dict[str, float]:
    return {(k if "/" in k else f"actor/{k}"): _scalar(v) for k, v in metrics.items()}


def actor_loss(cfg: Any, micro: Batch, logp: torch.Tensor, entropy: Optional[torch.Tensor],
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
