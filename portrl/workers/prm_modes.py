"""PRIME's implicit-PRM update modes as records: ``reward_model.model.update`` and ``reward_model.model.loss_type``.

The trainer's phase (``portrl/trainer/prime_phase.py``: when the step's rows are scored and the PRM updated) and the
PRM worker (``portrl/workers/implicit_prm.py``: the loss of one micro-batch and its metric) both read them from
:func:`prm_mode`, the one place a configured name becomes behaviour. A new mode is a new record here.

* :data:`PRM_UPDATES` (``reward_model.model.update``): ``before`` (verl's default: update on the step's rows,
  then score them with the updated PRM), ``after`` (score with the current PRM, then update it), ``none`` (score
  only);
* :data:`PRM_LOSSES` (``reward_model.model.loss_type``): ``ce``, the binary cross-entropy of ``σ(β·Σ_t q_t)``
  against each row's 0/1 ``acc``; ``dpo``, against the other side of the prompt group as scored before the update
  (verl's ``reverse`` order: the rows are scored once more before an update, ``prm_dpo_others``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

import torch

from portrl.algo.implicit_prm import prm_ce_loss, prm_dpo_loss

#: ``row_loss(q, acc, micro_tensors, mask, beta) -> (B,)``: one micro-batch's per-row PRM loss
RowLoss = Callable[[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor], torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class PRMUpdate:
    """When the PRM trains in a step: ``score_first`` (score with the PRM as it starts the step), ``trains``
    (one update on the step's rows), ``score_last`` (score with the PRM after its update)."""

    name: str
    score_first: bool
    trains: bool
    score_last: bool


@dataclass(frozen=True)
class PRMLoss:
    """The PRM's loss: ``metric`` (its ``reward_model/*`` name: the mean over each mini-batch's rows before its
    step), ``row_loss`` (see :data:`RowLoss`), ``needs_prior_scores`` (the rows are scored before the update and
    the batch gets ``prm_dpo_others``, the mean score of the other side of each row's group)."""

    name: str
    metric: str
    row_loss: RowLoss
    needs_prior_scores: bool = False


def _ce(q: torch.Tensor, acc: torch.Tensor, tensors: Dict[str, torch.Tensor], mask: torch.Tensor,
        beta: float) -> torch.Tensor:
    return prm_ce_loss(q, acc, mask, beta)


def _dpo(q: torch.Tensor, acc: torch.Tensor, tensors: Dict[str, torch.Tensor], mask: torch.Tensor,
         beta: float) -> torch.Tensor:
    return prm_dpo_loss(q, acc, tensors["prm_dpo_others"], mask, beta)


PRM_UPDATES: Dict[str, PRMUpdate] = {u.name: u for u in (
    PRMUpdate("before", score_first=False, trains=True, score_last=True),
    PRMUpdate("after", score_first=True, trains=True, score_last=False),
    PRMUpdate("none", score_first=True, trains=False, score_last=False),
)}

PRM_LOSSES: Dict[str, PRMLoss] = {loss.name: loss for loss in (
    PRMLoss("ce", "reward_model/ce_loss", _ce),
    PRMLoss("dpo", "reward_model/dpo_loss", _dpo, needs_prior_scores=True),
)}


@dataclass(frozen=True)
class PRMMode:
    """One run's update record and loss record (:func:`prm_mode`)."""

    update: PRMUpdate
    loss: PRMLoss

    @property
    def scores_before_update(self) -> bool:
        """Whether the rows are scored before the update: the update's own order, or a loss that compares each row
        with its group as scored then (only when the PRM trains)."""
        return self.update.score_first or (self.update.trains and self.loss.needs_prior_scores)


def prm_mode(rm_model: Any) -> PRMMode:
    """The records of ``reward_model.model`` (``update``, ``loss_type``); an unknown name is a ValueError naming
    the valid ones (the config checks refuse it before a run starts)."""
    update, loss = str(rm_model["update"]), str(rm_model["loss_type"])  # "update" is also a mapping method
    if update not in PRM_UPDATES:
        raise ValueError(f"reward_model.model.update={update!r} is unknown; valid: {list(PRM_UPDATES)}")
    if loss not in PRM_LOSSES:
        raise ValueError(f"reward_model.model.loss_type={loss!r} is unknown; valid: {list(PRM_LOSSES)}")
    return PRMMode(PRM_UPDATES[update], PRM_LOSSES[loss])
