"""One Llama-family decoder layer of a one-token decode step (op ``decode_layer``), cache and residual updated in
place: the layer portrl/rollout/fast_decode.py runs, as one op so that a backend can run it in one call.

For rows ``m`` of ``x`` (M, hidden), one new token each at cache slot ``start``::

    h = rms(x, ln1, eps1);  qkv = h [Wq; Wk; Wv]^T + b_qkv;  q, k, v = split(qkv)
    k_store[m, g, :, start] = rope(k_g);  v_cache[m, g, start] = v_g          (each KV head g)
    o = attn(rope(q), k_store[..., : start + 1], v_cache[:, :, : start + 1], hidden) Wo^T + b_o;  x += o
    gu = rms(x, ln2, eps2) [Wg; Wu]^T;  down = (silu(g) * u) Wd^T;  x += down

``rms(x, w, eps) = x / sqrt(mean(x^2) + eps) * w``; ``rope(t) = t * cos + [t2, t1] * sin`` with ``cos``, ``sin``
(M, head_dim) the rows' positions' and ``sin`` signed (``-sin`` on the first half, as fast_decode stores it);
attention is :func:`portrl.ops.attention.decode_attention` (query head h reads KV head ``h // (heads // kv_heads)``,
``hidden`` (M, start + 1) True where a row may not look). Keys are stored transposed, ``k_store`` (M, kv_heads,
head_dim, slots), values ``v_cache`` (M, kv_heads, slots, head_dim). ``qkv_w`` and ``gate_up_w`` are the parts of
the fused projections (not concatenated); biases may be None. Returns ``(qkv, o, gu, down)``, the four matmul
outputs a forward recording saves (portrl/models/forward_tape.py), written into ``out`` when it is given (four
contiguous tensors of their shapes: a recording's slots, saving a copy).

A backend's implementation may carry ``max_rows``: the most rows it serves fast (the CPU's: its decode linear's
range); portrl/rollout/fast_decode.py steps a batch with more rows op by op. It may carry ``bind`` too
(:func:`bind_layer`'s contract): one layer's weights checked once for a decode loop's steps; and ``bind_head``
(:func:`bind_head`'s): the step's last norm and head on the threads that run its layers.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from portrl.ops.attention import decode_attention as attend
from portrl.ops.layers import rms_norm, swiglu


def decode_layer(x: torch.Tensor, ln1: torch.Tensor, qkv_w: Sequence[torch.Tensor], qkv_b: Optional[torch.Tensor],
                 o_w: torch.Tensor, o_b: Optional[torch.Tensor], ln2: torch.Tensor, gate_up_w: Sequence[torch.Tensor],
                 down_w: torch.Tensor, k_store: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, hidden: torch.Tensor, start: int, eps1: float, eps2: float, scale: float,
                 heads: int, kv_heads: int, out: Optional[Sequence[torch.Tensor]] = None) -> tuple:
    """The module docstring's layer, in torch ops (any device and dtype)."""
    M, D = x.shape[0], k_store.shape[2]
    qkv = _linear(rms_norm(x, ln1, eps1), qkv_w, qkv_b)
    qk = qkv[:, : (heads + kv_heads) * D].view(M, heads + kv_heads, D)
    qk = torch.addcmul(qk * cos[:, None], torch.cat((qk[..., D // 2:], qk[..., : D // 2]), dim=-1), sin[:, None])
    k_store[:, :, :, start] = qk[:, heads:]
    v_cache[:, :, start] = qkv[:, (heads + kv_heads) * D:].view(M, kv_heads, D)
    L = start + 1
    att = attend(qk[:, :heads, None], k_store[..., :L].transpose(-1, -2), v_cache[:, :, :L], hidden, scale)
    o = F.linear(att.reshape(M, heads * D), o_w, o_b)
    x += o
    gu = _linear(rms_norm(x, ln2, eps2), gate_up_w, None)
    down = F.linear(swiglu(*gu.chunk(2, dim=-1)), down_w)
    x += down
    if out is None:
        return qkv, o, gu, down
    for dest, value in zip(out, (qkv, o, gu, down)):
        dest.copy_(value)
    return tuple(out)


def _linear(x: torch.Tensor, parts: Sequence[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [W_1; W_2; ...]^T + bias``, the parts' outputs concatenated (a few rows: far less to copy than weights)."""
    y = torch.cat([F.linear(x, w) for w in parts], dim=-1)
    return y.add_(bias) if bias is not None else y


def bind_layer(op: Callable, weights: Sequence, scale: float, heads: int, kv_heads: int) -> Callable:
    """``op`` (a ``decode_layer`` implementation) with one layer's ``weights`` (``ln1, qkv_w, qkv_b, o_w, o_b, ln2,
    gate_up_w, down_w, eps1, eps2``), as ``step(x, k_store, v_cache, cos, sin, hidden, start, out=None)``: ``op(x,
    ln1, ..., down_w, k_store, ..., start, eps1, eps2, scale, heads, kv_heads, out=out)``. An implementation's own
    ``bind`` (taking the weights, scale, heads and kv_heads flat; returning the same step) makes it: it may check the
    weights once instead of at every step (a decode loop calls a layer once a token)."""
    ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w, eps1, eps2 = weights
    own = getattr(op, "bind", None)
    if own is not None:
        return own(ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w, eps1, eps2, scale, heads, kv_heads)

    def step(x, k_store, v_cache, cos, sin, hidden, start, out=None):
        return op(x, ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w, k_store, v_cache, cos, sin, hidden, start,
                  eps1, eps2, scale, heads, kv_heads, out=out)

    return step


def bind_head(op: Callable, norm_w: torch.Tensor, eps: float, head_w: torch.Tensor,
              head_b: Optional[torch.Tensor]) -> Optional[Callable]:
    """A decode step's last norm and head, ``logits = rms(x, norm_w, eps) head_w^T + head_b``, as ``head(x)``, from
    ``op``'s (a ``decode_layer`` implementation's) own ``bind_head`` (taking these arguments): a backend whose layers
    run on threads of its own runs the head there too (the CPU's: backends/cpu/decode_layer.py). None where ``op``
    has none: the caller runs its own norm and head."""
    own = getattr(op, "bind_head", None)
    return own(norm_w, eps, head_w, head_b) if own is not None else None
