"""Bookkeeping shared by the hf engine's two sampling loops (the generic one and ``fast_decode``).

:func:`left_pad` lays the prompts out for the prefill. :class:`DecodeRows` keeps, for ``rows``
sequences sampled ``max_new`` tokens at most, the sampled tokens and log-probs, which rows have
stopped (EOS or a stop id) and the map from the live batch to output rows; it says when the loop is
done and when finished rows make up ``compact_fraction`` of the batch and should be dropped from it.
An ``interrupt`` event (``threading.Event``) that is set ends the loop after the step being recorded: the rows
still generating end there with finish reason ``abort`` (partial rollout, portrl/workers/partial_rollout.py).
"""

from __future__ import annotations

import math
import threading
from typing import List, Optional, Sequence, Tuple

import torch

from portrl.rollout.sampling import NonFiniteLogitsError
from portrl.rollout.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

#: the hf engine's default: finished rows leave the batch and its KV cache once they are this share of it (the
#: cache is then copied: portrl/plan/memory.py counts the copy)
COMPACT_FRACTION = 0.125


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids (B, P) long, mask (B, P) bool, lengths (B,))``: prompts left-padded to the longest."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    plen = int(lengths.max())
    ids = torch.full((len(prompts), plen), pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, plen - len(p):] = torch.tensor(p, dtype=torch.long)
    mask = torch.arange(plen, device=device)[None, :] >= (plen - lengths)[:, None]
    return ids.to(device), mask, lengths


class DecodeRows:
    """Per-row state of one batched sampling loop; see the module docstring."""

    def __init__(self, rows: int, max_new: int, pad_token_id: int, stop: torch.Tensor, compact_fraction: float,
                 device, interrupt: Optional[threading.Event] = None) -> None:
        self.max_new, self.stop, self.compact_fraction = max_new, stop, compact_fraction
        self.interrupt = interrupt
        self.aborted = False
        self.tokens = torch.full((rows, max_new), pad_token_id, dtype=torch.long, device=device)
        self.logps = torch.zeros(rows, max_new, dtype=torch.float32, device=device)
        self.resp_len = torch.full((rows,), max_new, dtype=torch.long, device=device)
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        self.active = torch.arange(rows, device=device)  # batch row -> output row
        self.alive = torch.ones(rows, dtype=torch.bool, device=device)  # batch rows still generating
        self.n_alive = rows

    def record(self, t: int, tok: torch.Tensor, lp: torch.Tensor) -> bool:
        """Store step ``t``'s samples of the batch rows still generating; True when the loop is done. A non-finite
        ``lp`` (its row's logits were not finite, :mod:`portrl.rollout.sampling`) raises NonFiniteLogitsError:
        ``sum(lp)`` is queued before the one host sync this method makes anyway (the rows that hit a stop id)."""
        if self.n_alive < len(self.active):
            self.tokens[self.active[self.alive], t] = tok[self.alive]
            self.logps[self.active[self.alive], t] = lp[self.alive]
            hit = torch.isin(tok, self.stop) & self.alive
        else:
            self.tokens[self.active, t] = tok
            self.logps[self.active, t] = lp
            hit = torch.isin(tok, self.stop)
        lp_sum = lp.sum()  # queued before the sync below, so reading it after costs no second wait
        n_hit = int(hit.sum())
        if not math.isfinite(float(lp_sum)):
            raise NonFiniteLogitsError(t, int((~torch.isfinite(lp)).sum()))
        if n_hit:
            done = self.active[hit]
            self.resp_len[done] = t + 1
            self.stopped[done] = True
            self.alive &= ~hit
            self.n_alive -= n_hit
        if self.n_alive and t < self.max_new - 1 and self.interrupt is not None and self.interrupt.is_set():
            self.resp_len[self.active[self.alive]] = t + 1  # the rows still generating end here, aborted
            self.aborted = True
            return True
        return self.n_alive == 0 or t == self.max_new - 1

    def compact(self) -> Optional[torch.Tensor]:
        """The batch rows to keep when finished rows should now be dropped (the caller drops them from its
        cache and per-row tensors too), else None."""
        size = len(self.active)
        if self.n_alive == size or size - self.n_alive < max(1, self.compact_fraction * size):
            return None
        keep = self.alive.nonzero().squeeze(-1)
        self.active = self.active[keep]
        self.alive = torch.ones(self.n_alive, dtype=torch.bool, device=keep.device)
        return keep

    def outputs(self) -> Tuple[List[List[int]], List[List[float]], List[str]]:
        """``(response_ids, logprobs, finish_reasons)`` per output row, each cut at its length."""
        resp_len, stopped = self.resp_len.tolist(), self.stopped.tolist()
        tokens, logps = self.tokens.tolist(), self.logps.tolist()
        rows = range(len(resp_len))
        return ([tokens[r][: resp_len[r]] for r in rows], [logps[r][: resp_len[r]] for r in rows],
                [FINISH_STOP if s else FINISH_ABORT if self.aborted and resp_len[r] < self.max_new else FINISH_LENGTH
                 for r, s in zip(rows, stopped)])
