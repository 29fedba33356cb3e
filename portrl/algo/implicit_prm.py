"""PRIME's implicit process reward model: token rewards, their normalisation, the model's loss, its metrics and the
accuracy filter (Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv:2502.01456; names and
math as verl's recipe/prime).

The implicit PRM is a causal LM ``π_φ`` trained only on outcome labels; its reward of response token ``y_t`` is
``r_t = β·log(π_φ(y_t|y<t) / π_ref(y_t|y<t))`` against a frozen reference. Here ``q_t = log π_φ − log π_ref`` on
the response tokens (0 on padding) and ``β`` is verl's ``reward_model.model.beta_train``.

* :func:`implicit_token_rewards`: ``(q, r = β·q)``. Every response token gets its reward, as the paper defines
  it; verl's recipe (``prime_granularity: token``) leaves the last token's out, a difference portrl does not copy.
* :func:`prime_batch_norm`: verl's ``prime_norm: batch_norm``: the rewards divided by the largest absolute
  return-to-go (reverse cumulative sum) in the batch, plus 1e-6.
* :func:`prm_ce_loss`: verl's ``ce`` loss, per row: the binary cross-entropy of ``σ(β·Σ_t q_t)`` against the 0/1
  outcome label (the implicit PRM as an outcome classifier).
* :func:`prm_dpo_loss` with :func:`prm_dpo_others`: verl's ``dpo`` loss (its "detached" DPO): each row's
  ``β·Σq`` against ``β·`` the mean, before the update, of the summed log-ratios of the rows of its group on the
  other side (lower accuracy for a right answer, higher for a wrong one), ``−log σ(±(Q_i − Q_other))``.
* :func:`prm_dpo_accuracy` / :func:`prm_dpo_abs_accuracy`: verl's ``reward_model/dpo_acc`` and ``dpo_acc_abs``.
* :func:`accuracy_band_keep`: verl's ``data.filter_accuracy``: keep a prompt group whose mean accuracy lies in
  ``[lower, upper]``; :func:`untruncated_keep`: verl's ``data.filter_truncate``: drop a group with a response of
  ``max_response_length − 1`` tokens or more.
"""

from __future__ import annotations

from typing import Hashable, Sequence, Tuple

import torch
import torch.nn.functional as F

from portrl.algo.groups import group_rows
from portrl.algo.masked import as_bool_mask


def implicit_token_rewards(rm_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, response_mask: torch.Tensor,
                           beta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q, r)`` ``(B,T)`` float32: ``q = log π_rm − log π_ref`` and ``r = β·q`` on the response tokens, 0 on
    padding. ``rm_log_probs`` may carry a gradient (the PRM's update differentiates ``q``)."""
    if rm_log_probs.shape != ref_log_probs.shape or rm_log_probs.shape != response_mask.shape:
        raise ValueError(f"implicit_token_rewards: shapes differ: rm {tuple(rm_log_probs.shape)}, ref "
                         f"{tuple(ref_log_probs.shape)}, mask {tuple(response_mask.shape)}")
    m = as_bool_mask(response_mask, rm_log_probs)
    diff = rm_log_probs.float() - ref_log_probs.float().to(rm_log_probs.device)
    q = torch.where(m, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))
    return q, q * float(beta)


def prime_batch_norm(token_rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``r / (max_{i,t} |Σ_{s≥t} r_is| + eps)`` over the whole batch (verl's ``prime_norm: batch_norm``)."""
    to_go = token_rewards.flip(-1).cumsum(-1).flip(-1)
    return token_rewards / (to_go.abs().max() + eps)


def prm_ce_loss(q: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row ``BCE(σ(β·Σ_t q_t·m_t), acc)`` ``(B,)`` (verl's ``compute_ce_dpo_loss_rm`` before its mean), computed
    from the logit for stability. ``acc`` holds 0/1 outcome labels (values in [0, 1] are taken as soft labels)."""
    logits = (q * response_mask.to(q.dtype)).sum(-1) * float(beta)
    return F.binary_cross_entropy_with_logits(logits, acc.to(logits.dtype).to(logits.device), reduction="none")


def prm_dpo_others(seq_log_ratio: torch.Tensor, acc: torch.Tensor, index: Sequence[Hashable]) -> torch.Tensor:
    """``(B,)``: for each row, the mean summed log-ratio of the rows of its prompt group with a lower accuracy when
    its own accuracy is > 0, else with a higher one; 0 when there is none (verl's ``Q_bc`` / ``acc_bc`` selection)."""
    seq, a = seq_log_ratio.double(), acc.double().cpu()  # a's masks index group_rows' CPU indices
    out = torch.zeros_like(seq)
    for rows in group_rows(index, seq.shape[0], "prm_dpo_others"):
        for i in rows.tolist():
            other = rows[(a[rows] < a[i]) if a[i] > 0 else (a[rows] > a[i])]
            if len(other):
                out[i] = seq[other].mean()
    return out.to(seq_log_ratio.dtype)


def prm_dpo_loss(q: torch.Tensor, acc: torch.Tensor, others: torch.Tensor, response_mask: torch.Tensor,
                 beta: float) -> torch.Tensor:
    """Per-row ``−log σ((β·Σ_t q_t − β·other)·s)`` ``(B,)``, ``s = +1`` for a row with accuracy > 0, else −1
    (verl's ``compute_detach_dpo_loss_rm`` before its mean); ``others`` from :func:`prm_dpo_others`."""
    cur = (q * response_mask.to(q.dtype)).sum(-1) * float(beta)
    sign = (acc.to(cur.device) > 0).to(cur.dtype) * 2 - 1
    return -F.logsigmoid((cur - others.to(cur.device, cur.dtype) * float(beta)) * sign)


def prm_dpo_accuracy(token_rewards: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor,
                     index: Sequence[Hashable]) -> float:
    """verl's ``dpo_acc``: within each prompt group, over the pairs whose accuracies differ, the share (weighted by
    the accuracy gap) where the summed implicit reward orders the pair as the accuracy does; 0.5 for a group
    without such pairs; the mean over groups."""
    seq = (token_rewards * response_mask.to(token_rewards.dtype)).sum(-1).double()
    a = acc.double()
    out = []
    for rows in group_rows(index, seq.shape[0], "prm_dpo_accuracy"):
        iu = torch.triu_indices(len(rows), len(rows), offset=1)
        acc_diff = (a[rows][:, None] - a[rows][None, :])[iu[0], iu[1]]
        score_diff = (seq[rows][:, None] - seq[rows][None, :])[iu[0], iu[1]]
        weight = acc_diff.abs()
        if float(weight.sum()) == 0.0:
            out.append(0.5)
        else:
            out.append(float((((score_diff > 0) == (acc_diff > 0)).double() * weight).sum() / weight.sum()))
    return sum(out) / len(out)


def prm_dpo_abs_accuracy(token_rewards: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor) -> float:
    """verl's ``dpo_acc_abs``: the share of rows whose summed implicit reward has the sign of ``2·acc − 1``."""
    seq = (token_rewards * response_mask.to(token_rewards.dtype)).sum(-1)
    return float((torch.sign(seq) == torch.sign(acc.to(seq.dtype) * 2 - 1)).float().mean())


def accuracy_band_keep(index: Sequence[Hashable], acc, lower: float, upper: float) -> torch.Tensor:
    """verl's accuracy filter: a bool ``(B,)`` mask keeping every row of a prompt group whose mean accuracy is in
    ``[lower, upper]`` (groups share an ``index`` value)."""
    values = torch.as_tensor(acc, dtype=torch.float64).reshape(-1)
    keep = torch.zeros(values.shape[0], dtype=torch.bool)
    for rows in group_rows(index, values.shape[0], "accuracy_band_keep"):
        mean = float(values[rows].mean())
        keep[rows] = lower <= mean <= upper
    return keep


def untruncated_keep(index: Sequence[Hashable], lengths, max_response_length: int) -> torch.Tensor:
    """verl's truncation filter: a bool ``(B,)`` mask dropping every row of a prompt group whose longest response has
    ``max_response_length − 1`` tokens or more (it may have been cut off)."""
    values = torch.as_tensor(lengths).reshape(-1)
    keep = torch.zeros(values.shape[0], dtype=torch.bool)
    for rows in group_rows(index, values.shape[0], "untruncated_keep"):
        keep[rows] = int(values[rows].max()) < max_response_length - 1
    return keep
