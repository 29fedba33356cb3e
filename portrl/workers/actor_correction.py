"""Rollout correction in the actor's update (``algorithm.rollout_correction``; the tensor functions and their
semantics are ``portrl.algo.rollout_correction``'s).

Before the update loop cuts the batch into mini- and micro-batches, on each rank's rows:

* :func:`apply_rejection` (``rollout_rs`` / ``rollout_token_veto_threshold``): ``response_mask`` is multiplied by
  the rejection mask of the proximal policy (``old_log_probs``) against the behaviour policy
  (``rollout_log_probs``), so rejected tokens are out of every loss term and of the global token counts the loss is
  normalised by; the mask before is kept as ``UNREJECTED_MASK`` for the metrics. In the ``seq-mean-*`` aggregation
  modes a wholly rejected row still counts in the number of rows the loss is divided by;
* :func:`normalize_is_weights` (``rollout_is_batch_normalize``, verl's): the truncated IS weights of the whole step
  (every rank's rows) divided by their mean, put in the batch as ``rollout_is_weights`` for the policy loss.

Both need the proximal log-probs before the update: :func:`proximal_before_update` makes the step compute them.
During the update, :func:`correction_stats_of` gives each micro-batch's partial ``rollout_corr/*`` statistics
(combined over micro-batches and ranks by ``portrl.workers.training.rollout_corr_metrics``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple

import torch

from portrl.algo.rollout_correction import correction_stats, rejection_mask, rollout_is_weights
from portrl.workers.batch import Batch
from portrl.workers.training import all_reduce_sum

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

#: the batch's response mask before rejection sampling (:func:`apply_rejection`), read by the rollout-gap metrics
UNREJECTED_MASK = "response_mask_unrejected"


def rejection_on(cfg: PortRLConfig) -> bool:
    """Whether rollout correction rejects tokens (``rollout_rs`` or ``rollout_token_veto_threshold`` set)."""
    rc = cfg.algorithm.rollout_correction
    return rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None


def _normalize_on(cfg: PortRLConfig) -> bool:
    rc = cfg.algorithm.rollout_correction
    return bool(rc.rollout_is) and bool(rc.rollout_is_batch_normalize)


def proximal_before_update(cfg: PortRLConfig) -> bool:
    """Whether the update needs ``old_log_probs`` before it starts (rejection, or batch-normalised IS weights)."""
    return rejection_on(cfg) or _normalize_on(cfg)


def _need_log_probs(batch: Batch, what: str) -> None:
    for key in ("rollout_log_probs", "old_log_probs"):
        if key not in batch:
            raise ValueError(f"algorithm.rollout_correction.{what} needs {key} in the batch, and this one has none")


def apply_rejection(cfg: PortRLConfig, batch: Batch) -> Batch:
    """``batch`` (not copied) when nothing is rejected; else a shallow copy whose ``response_mask`` is multiplied by
    the rejection mask (:func:`portrl.algo.rollout_correction.rejection_mask`), the mask before it kept as
    ``UNREJECTED_MASK``. A batch without ``old_log_probs`` or ``rollout_log_probs`` is a ValueError."""
    if not rejection_on(cfg):
        return batch
    _need_log_probs(batch, "rollout_rs / rollout_token_veto_threshold")
    rc = cfg.algorithm.rollout_correction
    mask = batch.tensors["response_mask"]
    out = Batch(batch.tensors, batch.meta, batch.info)
    out[UNREJECTED_MASK] = mask
    out["response_mask"] = rejection_mask(batch.tensors["old_log_probs"], batch.tensors["rollout_log_probs"], mask,
                                          rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower,
                                          rc.rollout_token_veto_threshold)
    return out


def normalize_is_weights(cfg: PortRLConfig, batch: Batch, world_size: int) -> Tuple[Batch, Dict[str, float]]:
    """verl's ``rollout_is_batch_normalize``: ``(batch, {})`` when off; else a shallow copy holding
    ``rollout_is_weights``, the truncated IS weights at ``rollout_is`` divided by their mean over the response
    tokens (``token``) or over the responses (``sequence``: one weight each) of every rank's rows, on the mask
    before rejection (as verl), and ``{"rollout_corr/rollout_is_batch_norm_factor": mean}`` (1 when the mean is
    <= 1e-8: then nothing is divided). Every rank calls it (a collective)."""
    if not _normalize_on(cfg):
        return batch, {}
    _need_log_probs(batch, "rollout_is_batch_normalize")
    rc = cfg.algorithm.rollout_correction
    mask = batch.get(UNREJECTED_MASK, batch.tensors["response_mask"])
    w = rollout_is_weights(batch.tensors["old_log_probs"], batch.tensors["rollout_log_probs"], mask,
                           str(rc.rollout_is), float(rc.rollout_is_threshold))
    if rc.rollout_is == "token":
        total, count = float(w.sum()), float(mask.sum())
    else:  # a row's weight is on each of its response tokens (and 0 on padding): its maximum
        rows = mask.sum(-1) > 0
        total, count = float(w.max(-1).values[rows].sum()), float(rows.sum())
    total, count = all_reduce_sum([total, count], world_size)
    mean = total / count if count > 0 else 0.0
    factor = mean if mean > 1e-8 else 1.0
    out = Batch(batch.tensors, batch.meta, batch.info)
    out["rollout_is_weights"] = w / factor
    return out, {"rollout_corr/rollout_is_batch_norm_factor": factor}


def correction_stats_of(cfg: PortRLConfig, micro: Batch, old: torch.Tensor) -> Dict[str, float]:
    """The ``rollout_corr/*`` partial statistics of ``micro`` (:func:`portrl.algo.rollout_correction.
    correction_stats`): proximal ``old`` against its ``rollout_log_probs``, IS weights at ``rollout_is`` (token
    level when it is off), on the mask before rejection."""
    rc = cfg.algorithm.rollout_correction
    mask = micro.tensors["response_mask"]
    return correction_stats(old, micro.tensors["rollout_log_probs"], micro.get(UNREJECTED_MASK, mask), mask,
                            str(rc.rollout_is or "token"), float(rc.rollout_is_threshold),
                            rc.rollout_token_veto_threshold)
