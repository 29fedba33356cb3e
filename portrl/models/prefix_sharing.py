"""Packed layout that computes each distinct prompt once: the responses sampled from one prompt share it.

GRPO-style batches hold ``n`` responses per prompt, so a plain packed forward runs every prompt
``n`` times. Here the rows of a micro-batch whose prompts are token-for-token equal form a group,
laid out once as::

    [prompt (P tokens), resp_1[:-1], resp_2[:-1], ..., resp_n[:-1]]     positions 0..P-1, then P.. per response

A response's last token is not run at all: its hidden state scores nothing (there is no next
token) and, being last, no query attends to it; it is only a label. Attention stays exactly that
of separate sequences: with ``gather`` and ``cu_seqlens`` below, each response attends to its
group's prompt and to itself, never to a sibling. The attention call runs on *virtual sequences*
gathered from the packed q/k/v::

    seq 1 = prompt + resp_1,   seq j = prompt + resp_j (j > 1)

and keeps, for each packed token, the output of the one virtual position that owns it (the prompt
tokens' outputs come from seq 1; the prompt copies in the other sequences only serve as keys and
values, and their query outputs are dropped). The gather's backward sums the gradients of the
shared prompt tokens over the group, so log-probs and gradients equal those of the unshared
layout up to float summation order. Any varlen attention kernel serves it unchanged; only the
linear layers' work shrinks (the prompts' share of the tokens, times ``(n-1)/n``).

Requires each row's real tokens to be contiguous (left-padded prompt, right-padded response), as
the rollout batches are; :func:`plan_shared_prompts` returns None otherwise (and the caller packs
rows as before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portrl.ops.attention import cu_seqlens_from_lengths

#: the keyword the plan travels under, from the model's forward to portrl's attention function
PLAN_KWARG = "portrl_shared_prompts"


@dataclass
class SharedPromptPlan:
    """How the packed tokens map to the virtual sequences of the attention call.

    ``gather (M,)``: packed-token index of each virtual position; ``cu_seqlens (S+1,)`` int32 and
    ``max_seqlen``: the virtual sequences; ``keep (N,)``: for each packed token, the virtual position
    whose output it takes. ``reads`` counts the attention calls that applied the plan, so the caller can
    check that the keyword reached every layer.
    """

    gather: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    keep: torch.Tensor
    reads: int = 0


@dataclass(frozen=True)
class SharedPromptLayout:
    """``flat_ids (N,)`` and ``position_ids (N,)`` to run; ``src (N,)``: each packed token's index in the
    flattened ``(B, P+T)`` batch; ``score_rows``: for each valid response token, in row-major order, the
    packed token whose final hidden state scores it; ``plan`` for the attention; ``groups``: number of
    distinct prompts."""

    src: torch.Tensor
    flat_ids: torch.Tensor
    position_ids: torch.Tensor
    score_rows: torch.Tensor
    plan: SharedPromptPlan
    groups: int


def _contiguous_rows(mask: torch.Tensor) -> bool:
    """True when each row's real tokens form one run (no holes)."""
    lengths = mask.sum(1)
    first = torch.where(lengths > 0, mask.float().argmax(1), 0)
    last = mask.shape[1] - 1 - mask.flip(1).float().argmax(1)
    return bool(((last - first + 1 == lengths) | (lengths == 0)).all())


def plan_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        response_length: int) -> SharedPromptLayout | None:
    """The shared-prompt layout of a ``(B, P+T)`` batch (verl layout: left-padded prompt, right-padded
    response of ``T = response_length`` columns), or None when some row's real tokens are not contiguous.
    Rows sharing a prompt need not be adjacent; groups are laid out in order of first appearance."""
    mask = attention_mask.bool()
    if not _contiguous_rows(mask):
        return None
    batch, length = input_ids.shape
    split = length - int(response_length)
    ids_cpu, mask_cpu = input_ids.cpu(), mask.cpu()
    prompt_len = mask_cpu[:, :split].sum(1).tolist()
    resp_len = mask_cpu[:, split:].sum(1).tolist()
    rows_of: dict[tuple, list[int]] = {}
    id_rows = ids_cpu.tolist()  # plain lists: slicing a tensor row costs two ops a row
    for b in range(batch):
        key = tuple(id_rows[b][split - prompt_len[b]:split])
        rows_of.setdefault(key, []).append(b)

    # every index list below is a concatenation of ranges (start, length): O(rows) Python, O(tokens) torch
    src, pos, gather, keep = _Ranges(), _Ranges(), _Ranges(), _Ranges()
    score_at: list[tuple] = [((0, 0), (0, 0))] * batch
    seq_lens: list[int] = []
    n = m = 0  # packed tokens so far, virtual positions so far
    for members in rows_of.values():
        first = members[0]
        P = prompt_len[first]
        prompt_start = n
        src.add(first * length + split - P, P)
        pos.add(0, P)
        n += P
        for j, b in enumerate(members):
            R = resp_len[b]
            run = max(R - 1, 0)  # the last response token is only a label
            src.add(b * length + split, run)
            pos.add(P, run)
            if R:
                score_at[b] = ((prompt_start + P - 1, 1), (n, run))
            if j == 0 or run:  # virtual sequence 1 owns the prompt and the first response
                gather.add(prompt_start, P)
                gather.add(n, run)
                keep.add(m if j == 0 else m + P, P + run if j == 0 else run)
                seq_lens.append(P + run)
                m += P + run
            n += run
    score = _Ranges()
    for first_token, own in score_at:
        score.add(*first_token)
        score.add(*own)
    dev = input_ids.device
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    plan = SharedPromptPlan(gather=gather.tensor(dev), cu_seqlens=cu_seqlens_from_lengths(seq).to(dev),
                            max_seqlen=int(seq.max()) if seq_lens else 0, keep=keep.tensor(dev))
    src_index = src.tensor(dev)
    return SharedPromptLayout(src=src_index, flat_ids=input_ids.reshape(-1)[src_index], position_ids=pos.tensor(dev),
                              score_rows=score.tensor(dev), plan=plan, groups=len(rows_of))


class _Ranges:
    """A concatenation of integer ranges ``[start, start + length)``, materialised in one vectorised step."""

    def __init__(self):
        self.starts: list[int] = []
        self.lengths: list[int] = []

    def add(self, start: int, length: int) -> None:
        if length > 0:
            self.starts.append(start)
            self.lengths.append(length)

    def tensor(self, device) -> torch.Tensor:
        starts = torch.tensor(self.starts, dtype=torch.long)
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        offsets = torch.cumsum(lengths, 0) - lengths  # where each range begins in the output
        out = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets - starts, lengths)
        return out.to(device)
