"""The CPU's decode-step attention (op ``decode_attention``, implementation ``fused``): one pass over each row's
cached keys and values for all the query heads of a KV head (backends/cpu/decode_attention.cpp, the AVX-512 or
AVX2 build backends/cpu/isa.py chooses), for float32 CPU tensors with nothing to differentiate; anything else
takes the native op (portrl.ops.attention.decode_attention).

torch runs it as a batched matmul, a masked fill, a softmax and a second matmul, four dispatches that at one query
per head are mostly set-up, and reads the cache in two passes through small GEMMs.
"""

from __future__ import annotations

import torch

from portrl.backends.cpu import isa, native_build
from portrl.ops.attention import decode_attention as native_decode_attention

LIBRARY = "decode_attention"


def _unit_last(t: torch.Tensor) -> bool:
    return t.shape[-1] <= 1 or t.stride(-1) == 1


def decode_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden_keys: torch.Tensor,
                           scale: float, variant: str | None = None) -> torch.Tensor:
    """The ``decode_attention`` op's contract (portrl.ops.attention.decode_attention), fused for float32 CPU
    tensors with unit stride along the head dimension (``k``: or along the keys, a cache stored transposed, the
    layout the kernel is fastest on). ``variant`` (``avx512`` / ``avx2``): that build, which this
    CPU must run (tests); None: backends/cpu/isa.py's."""
    tensors = (q, k, v)
    k_layout_ok = _unit_last(k) or (k.dim() == 4 and (k.stride(2) == 1 or k.shape[2] <= 1))  # or transposed
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) or not k_layout_ok
            or not _unit_last(q) or not _unit_last(v)
            or q.dim() != 4 or k.dim() != 4 or hidden_keys.dtype != torch.bool
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return native_decode_attention(q, k, v, hidden_keys, scale)
    variant = variant or isa.chosen().variant
    if variant is None or not native_build.try_load(LIBRARY, variant):
        return native_decode_attention(q, k, v, hidden_keys, scale)
    B, L = q.shape[0], k.shape[2]
    if tuple(hidden_keys.shape) != (B, L):  # the op's own message
        return native_decode_attention(q, k, v, hidden_keys, scale)
    ops = getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant))
    return ops.forward(q, k, v, hidden_keys.contiguous(), float(scale))
