"""DAPO pieces (Yu et al. 2025, arXiv 2503.14476): overlong soft punishment and dynamic sampling."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from portrl.algo.groups import group_rows


def overlong_penalty(response_lengths, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0
                     ) -> torch.Tensor:
    """Overlong soft punishment, added to the score of each response:
    ``r_over = min(−(L − (L_max − L_buf))/L_buf · α, 0)``: 0 up to ``L_max − L_buf``, then linear down to
    ``−α`` at ``L_max``. Lengths beyond ``L_max`` (impossible when generation truncates) are held at ``−α``
    (the reference extrapolates linearly; the paper's rule is −1 there). Returns float32 ``(B,)``.
    ``buffer_len`` must be in (0, L_max]."""
    if buffer_len <= 0 or buffer_len > max_response_length:
        raise ValueError(f"overlong_penalty: buffer_len must be in (0, max_response_length={max_response_length}], "
                         f"got {buffer_len}")
    if penalty_factor < 0:
        raise ValueError(f"overlong_penalty: penalty_factor must be >= 0, got {penalty_factor}")
    lengths = torch.as_tensor(response_lengths).to(torch.float32)
    expected = max_response_length - buffer_len
    pen = -(lengths - expected) / buffer_len * penalty_factor
    return pen.clamp(min=-float(penalty_factor), max=0.0)


def filter_groups(index: Sequence[Hashable], metric) -> torch.Tensor:
    """DAPO dynamic sampling: keep a prompt group iff its metric values are not all equal (population
    std > 0; compared exactly, so float round-off in a std cannot keep an all-equal group) or the group
    has one row. ``metric`` is one number per row (e.g. acc or the sequence reward). Returns a bool
    ``(B,)`` keep mask; the caller accumulates kept groups across generation batches. NaN is an error."""
    values = torch.as_tensor(metric, dtype=torch.float64).reshape(-1)
    if torch.isnan(values).any():
        raise ValueError("filter_groups: metric contains NaN")
    keep = torch.zeros(values.shape[0], dtype=torch.bool)
    for rows in group_rows(index, values.shape[0], "filter_groups"):
        g = values[rows]
        if len(rows) == 1 or bool(g.max() != g.min()):
            keep[rows] = True
    return keep
