"""Variable-length (packed) causal attention: the native reference and shared input checks.

Packed layout (the flash-attention "varlen" layout): the tokens of B sequences are concatenated,
``q`` is ``(total, Hq, D)``, ``k`` and ``v`` are ``(total, Hkv, D)`` with ``Hq % Hkv == 0``
(grouped-query attention: query head ``h`` reads key/value head ``h // (Hq // Hkv)``), and
``cu_seqlens`` (int, ``B + 1``) holds the cumulative lengths starting at 0, so sequence ``i`` is
``[cu_seqlens[i], cu_seqlens[i+1])``. For each sequence and head::

    out = softmax(scale * q k^T + M) v,   M[i, j] = -inf where j > i (causal), else 0

with ``scale = softmax_scale or 1/sqrt(D)``. No token attends across a sequence boundary.
"""

from __future__ import annotations

import math

import torch


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        softmax_scale: float | None = None, rows: int | None = None) -> tuple[float, int]:
    """Validate packed attention inputs; return ``(scale, n_rep)`` where ``n_rep = Hq // Hkv``. ``rows``: the
    sequences' total tokens where they are gathered from q, k, v (default: all of q's rows)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (total_tokens, heads, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must both be (total, Hkv, D) matching q (total, Hq, D); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor of B+1 cumulative lengths, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    total = q.shape[0] if rows is None else rows
    if first != 0 or last != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at total_tokens={total}; got {first}..{last}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return scale, q.shape[1] // k.shape[1]


def cu_seqlens_from_lengths(lengths, device=None) -> torch.Tensor:
    """int32 ``[0, l0, l0+l1, ...]`` from per-sequence lengths (list or tensor)."""
    lengths = torch.as_tensor(lengths, device=device)
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32, max_seqlen)`` of a packed row whose positions restart at each sequence.

    A new sequence starts wherever the position does not increase by exactly 1 (as in
    ``[0,1,2,0,1,0,1,2,3]``). ``position_ids`` is ``(total,)`` or ``(1, total)``.
    """
    pos = position_ids.reshape(-1)
    if pos.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=pos.device), 0
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = torch.nonzero(starts).reshape(-1)
    cu = torch.cat([idx, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _causal_mask(n: int, device) -> torch.Tensor:
    """True where attention is allowed (key index <= query index)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int | None = None, softmax_scale: float | None = None,
                     causal: bool = True) -> torch.Tensor:
    """Native reference: explicit softmax attention, one sequence at a time, computed in at least float32.

    Returns ``(total, Hq, D)`` in q's dtype. ``max_seqlen`` is accepted for signature parity with
    the vendor kernels and not needed here.
    """
    scale, n_rep = check_varlen_inputs(q, k, v, cu_seqlens, softmax_scale)
    compute = torch.promote_types(q.dtype, torch.float32)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outs = []
    # split, not slicing: the backward of a slice zero-fills a full-size gradient per sequence
    for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        n = qi.shape[0]
        if n == 0:
            continue
        qi = qi.to(compute).transpose(0, 1)  # (Hq, L, D)
        ki = ki.to(compute).transpose(0, 1).repeat_interleave(n_rep, dim=0)
        vi = vi.to(compute).transpose(0, 1).repeat_interleave(n_rep, dim=0)
        scores = torch.matmul(qi, ki.transpose(1, 2)) * scale
        if causal:
            scores = scores.masked_fill(~_causal_mask(n, q.device), float("-inf"))
        outs.append(torch.matmul(torch.softmax(scores, dim=-1), vi).transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=0).to(q.dtype)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden_keys: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one new token per row against its KV cache (a decode step):
    ``out[b, h] = softmax(scale * q[b, h] k[b, g]^T, -inf where hidden_keys[b]) v[b, g]``, ``g = h // (H / KV)``.

    ``q`` (B, H, 1, D); ``k``, ``v`` (B, KV, L, D) (views of a cache are fine); ``hidden_keys`` (B, L) bool marks
    the keys a row may not see. Returns (B, H, 1, D). The query heads of each KV head go as one batch (grouped-query
    attention without repeating k / v): four small ops instead of SDPA's per-call set-up, which dominates at one
    query. It computes in at least float32 (a copy of k and v for bfloat16 / float16). A row with every key hidden gives NaN (softmax of -inf only)."""
    B, H, one, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    if one != 1 or H % KV or v.shape != k.shape or tuple(hidden_keys.shape) != (B, L):
        raise ValueError(f"decode_attention needs q (B, H, 1, D), k and v (B, KV, L, D) with H a multiple of KV and "
                         f"hidden_keys (B, L); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"hidden_keys {tuple(hidden_keys.shape)}")
    compute = torch.promote_types(q.dtype, torch.float32)  # bfloat16 scores would be off by ~1 % each
    qg = q.reshape(B, KV, H // KV, D).to(compute)
    scores = torch.matmul(qg, k.to(compute).transpose(-1, -2)).mul_(scale)  # (B, KV, rep, L)
    scores.masked_fill_(hidden_keys.view(B, 1, 1, L), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.to(compute)).view(B, H, 1, D).to(q.dtype)
