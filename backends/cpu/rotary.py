"""The CPU's fused rotary embedding (op ``rotary``, implementation ``fused``): ``x * cos + rotate_half(x) * sin`` and
its gradient in one pass each (backends/cpu/rotary.cpp, the AVX-512 or AVX2 build backends/cpu/isa.py chooses), for
float32 CPU tensors of shape (rows, heads, dim) with cos / sin of one row per row of x, shared by its heads (as the
update's replay gives them: portrl/models/forward_tape.py); any other shape, dtype or device takes the native op.

torch runs the formula as five ops forward (two products, a negation, a concatenation, a sum) and about eight
backward (the concatenation's and slices' gradients zero-fill full-size tensors). On a small model each of them is a
parallel region of its own, and on a VM each waits for a thread that slept between two ops (docs/performance.md).
The gradient of cos and sin is not computed: they must not need one (the native op serves when they do).
"""

from __future__ import annotations

import torch

from portrl.backends.cpu import isa, native_build
from portrl.backends.cpu.swiglu import unit_stride_rows
from portrl.ops.layers import apply_rotary as native_rotary

LIBRARY = "rotary"


class _FusedRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos2d, sin2d, variant):
        ctx.ops = getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant))
        ctx.save_for_backward(cos2d, sin2d)
        return ctx.ops.forward(x, cos2d, sin2d)

    @staticmethod
    def backward(ctx, grad_out):
        cos2d, sin2d = ctx.saved_tensors
        grad = grad_out if grad_out.stride(2) == 1 else grad_out.contiguous()
        return ctx.ops.backward(grad, cos2d, sin2d), None, None, None


def _rows(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor | None:
    """``t`` as (rows, dim) with unit stride along dim (unit_stride_rows) when it is one row per row of x (shapes
    (rows, 1, dim) or (rows, dim)), else None."""
    if t.shape not in ((rows, 1, dim), (rows, dim)):
        return None
    return unit_stride_rows(t)


def rotary_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """The ``rotary`` op's contract (portrl.ops.layers.apply_rotary), fused for float32 CPU x (rows, heads, dim) and
    cos / sin (rows, 1, dim) or (rows, dim). ``variant`` (``avx512`` / ``avx2``): that build, which this CPU must run
    (tests); None: backends/cpu/isa.py's."""
    if (x.dim() != 3 or x.shape[-1] % 2 or x.numel() == 0 or any(t.dtype != torch.float32 for t in (x, cos, sin))
            or any(t.device.type != "cpu" for t in (x, cos, sin)) or cos.requires_grad or sin.requires_grad):
        return native_rotary(x, cos, sin)
    rows, _, dim = x.shape
    c, s = _rows(cos, rows, dim), _rows(sin, rows, dim)
    variant = variant or isa.chosen().variant
    if c is None or s is None or variant is None or not native_build.try_load(LIBRARY, variant):
        return native_rotary(x, cos, sin)
    if x.stride(2) != 1:
        x = x.contiguous()
    if not (torch.is_grad_enabled() and x.requires_grad):
        return getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant)).forward(x, c, s)
    return _FusedRotary.apply(x, c, s, variant)
