"""Ulysses sequence parallelism: each rank of a sequence-parallel (SP) group runs the decoder on its own slice of
the packed tokens and sees the whole sequence only inside attention.

A packed row of ``N`` tokens (padding removed, portrl.models.logprobs.pack_rows) is cut into ``sp`` equal,
contiguous slices (:func:`shard_tokens`; the row is first padded to a multiple of ``sp`` with a sequence of its
own, so the padding attends only to itself). Every layer's embeddings, norms, MLP and projections run on the
rank's ``N / sp`` tokens. Inside attention (portrl.models.attention, given the group's keyword) one
all-to-all turns query, key and value from ``(1, H, N/sp, D)`` (all heads, the rank's tokens) into
``(1, H/sp, N, D)`` (the rank's heads, every token), the varlen attention runs with the whole row's sequence
bounds, and the inverse all-to-all brings the output back to the rank's tokens (:func:`sequence_to_heads`,
:func:`heads_to_sequence`; each is the other's backward). Rotary embeddings are applied before the exchange from
each token's own position id, so slicing changes nothing there.

Grouped-query attention: key/value heads ``Hkv`` are cut like the query heads when ``sp`` divides ``Hkv``; when
``Hkv < sp`` (``sp`` a multiple of ``Hkv``), each key/value head is first repeated ``sp / Hkv`` times
(:func:`expand_kv_heads`), so query head ``j`` still meets key/value head ``j // (H / Hkv)`` (the gradient of
the repeat sums the copies).

After the last layer :func:`gather_tokens` all-gathers the slices into the whole row, on every rank, and every
rank computes the same loss from it. Its backward is a reduce-scatter (sum): rank ``r`` receives
``sum_s dL_s/dh_r = sp * dL/dh_r``; the ``sp`` factor is what the FSDP2 gradient average over the
data x sequence ranks divides out again (portrl.workers.mesh), so the update equals one rank's.

Only the exchange and the slicing are here; the decoder's forward carries the group to its attention calls in the
keyword :data:`SEQUENCE_GROUP_KWARG` (portrl.models.logprobs), which gradient checkpointing keeps for the backward's
recomputation. What only hardware confirms: the all-to-all's speed over NCCL / RCCL / HCCL (the math is
the collective's, the same on every backend; tests run it over gloo on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: the attribute of a decoder module that holds its SP process group (set by portrl.workers.mesh; read by
#: portrl.models.logprobs.response_hidden_states, which then runs the decoder sequence-parallel)
SEQUENCE_GROUP_ATTR = "portrl_sequence_group"

#: the keyword of the decoder's forward that carries the SP process group to every attention call. A keyword, not
#: a context: gradient checkpointing recomputes each layer during backward, after the forward has returned, with
#: the keywords it kept (transformers passes a forward's extra keywords down to the attention function)
SEQUENCE_GROUP_KWARG = "portrl_sequence_group"


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``out[r] = x[me]`` of rank ``r``: dim 0 of ``x`` (``sp`` blocks) is exchanged over ``group``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a permuted tensor's strides
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    b, h, s, d = x.shape
    sp = dist.get_world_size(group)
    blocks = _all_to_all(x.reshape(b, sp, h // sp, s, d).transpose(0, 1), group)  # (sp, b, h/sp, s, d)
    return blocks.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    b, h, s, d = x.shape
    sp = dist.get_world_size(group)
    blocks = x.reshape(b, h, sp, s // sp, d).permute(2, 0, 1, 3, 4)  # (sp, b, h, s/sp, d)
    return _all_to_all(blocks, group).permute(1, 0, 2, 3, 4).reshape(b, sp * h, s // sp, d)


def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``(B, H, S/sp, D)`` (all heads of this rank's tokens) -> ``(B, H/sp, S, D)`` (this rank's heads of every
    token, in rank order of the slices); differentiable (backward: :func:`heads_to_sequence`)."""
    sp = dist.get_world_size(group)
    if x.shape[1] % sp:
        raise ValueError(f"sequence parallel size {sp} must divide the {x.shape[1]} heads of this rank")
    return _SeqToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`: ``(B, H/sp, S, D)`` -> ``(B, H, S/sp, D)``."""
    return _HeadsToSeq.apply(x, group)


def expand_kv_heads(kv: torch.Tensor, sp: int) -> torch.Tensor:
    """Key or value ``(B, Hkv, S, D)`` with ``Hkv`` a multiple of ``sp`` as it is; else each head repeated
    ``sp / Hkv`` times (``sp`` must then be a multiple of ``Hkv``) so the heads split evenly over the ranks."""
    hkv = kv.shape[1]
    if hkv % sp == 0:
        return kv
    if sp % hkv:
        raise ValueError(f"sequence parallel size {sp} and the {hkv} key/value heads of this rank: one must divide "
                         "the other")
    return kv.repeat_interleave(sp // hkv, dim=1)


# torch 2.13 names them *_single (the *_tensor names warn there); older torch has only the *_tensor names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        sp = dist.get_world_size(group)
        out = x.new_empty((sp * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        sp = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // sp, *grad.shape[1:]))
        _reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_tokens(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``(N/sp, ...)`` slice, concatenated in rank order: ``(N, ...)`` on every rank. Backward: a
    reduce-scatter sum (see the module docstring for the ``sp`` factor it carries)."""
    return _GatherTokens.apply(x, group)


@dataclass(frozen=True)
class TokenShard:
    """This rank's slice of a packed row: ``input_ids`` and ``position_ids`` ``(N_pad / sp,)``; ``cu_seqlens``
    and ``max_len`` of the whole padded row (the padding, when there is any, is one more sequence); ``n``: the
    row's real tokens (the first ``n`` of the gathered output)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    n: int


def shard_tokens(flat_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                 group: Any) -> TokenShard:
    """This rank's contiguous slice of a packed row of ``N`` tokens, padded to a multiple of the group's size
    with ``pad_len`` tokens (id 0, positions 0..pad_len-1) that form a sequence of their own."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    n = int(flat_ids.shape[0])
    pad = -n % sp
    if pad:
        flat_ids = torch.cat([flat_ids, flat_ids.new_zeros(pad)])
        position_ids = torch.cat([position_ids, torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device)])
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), n + pad)])
        max_len = max(max_len, pad)
    size = (n + pad) // sp
    part = slice(rank * size, (rank + 1) * size)
    return TokenShard(flat_ids[part], position_ids[part], cu_seqlens, max_len, n)
