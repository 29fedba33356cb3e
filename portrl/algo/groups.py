"""Shared helpers of the outcome advantage estimators: groups, scores, broadcasting.

Conventions (verl): the score of row i is ``s_i = Σ_t r_it`` over every position (the reward manager
writes the score at the last valid token); the rows of a group share an ``index`` value (the prompt
uid) and need not be contiguous; an outcome advantage ``a_i`` is broadcast as ``A_it = a_i·m_it`` so
padding gets exactly 0. Statistics are computed in float64 and the results returned in float32
(float64 for float64 rewards).
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Sequence

import torch

from portrl.algo.masked import as_bool_mask, compute_dtype


def check_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, who: str):
    """Validate ``(B,T)`` rewards and mask; an all-masked batch is a ValueError. Returns the bool mask."""
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise ValueError(f"{who}: token_level_rewards must be a (batch, response_length) tensor")
    m = as_bool_mask(response_mask, token_level_rewards)
    if not bool(m.any()):
        raise ValueError(f"{who}: response_mask is all zero (all-masked batch); no advantage can be computed")
    return m


def group_rows(index, batch_size: int, who: str) -> List[torch.Tensor]:
    """Row indices of each group, in order of first appearance. ``index`` is one hashable per row."""
    if index is None:
        raise ValueError(f"{who}: needs index (one group id, e.g. the prompt uid, per row)")
    ids: Sequence[Hashable] = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(ids) != batch_size:
        raise ValueError(f"{who}: index has {len(ids)} entries but the batch has {batch_size} rows")
    groups: Dict[Hashable, List[int]] = {}
    for row, gid in enumerate(ids):
        groups.setdefault(gid, []).append(row)
    return [torch.tensor(rows, dtype=torch.long) for rows in groups.values()]


def group_ids(index, batch_size: int, who: str) -> tuple[torch.Tensor, int]:
    """``(gid, G)``: one dense group number per row (``0..G-1`` in order of first appearance, the order of
    :func:`group_rows`) and the number of groups, for the vectorized estimators' scatter sums."""
    rows = group_rows(index, batch_size, who)
    gid = torch.empty(batch_size, dtype=torch.long)
    for g, r in enumerate(rows):
        gid[r] = g
    return gid, len(rows)


def scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """``s_i = Σ_t r_it`` in float64."""
    return token_level_rewards.to(torch.float64).sum(dim=-1)


def broadcast(per_seq: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``A_it = a_i · m_it`` in the output dtype (float32, or float64 for float64 rewards)."""
    out = per_seq.to(device=mask.device)[:, None] * mask.to(per_seq.dtype)
    return out.to(compute_dtype(like))


def all_equal(x: torch.Tensor) -> bool:
    return bool((x.max() == x.min()).item())
