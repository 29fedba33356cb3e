"""The CPU's fused SwiGLU (op ``swiglu``, implementation ``fused``): ``silu(gate) * up`` and its gradients in one
pass each (backends/cpu/swiglu.cpp, the AVX-512 or AVX2 build backends/cpu/isa.py chooses), for float32 CPU
tensors; anything else takes the native op.

torch runs it as ``silu`` then ``mul`` forward and ``silu_backward`` plus two products backward, each writing a
tokens x intermediate tensor, a large share of a 0.5B update (docs/performance.md); the fused ops read and write
each tensor once.
"""

from __future__ import annotations

import torch

from portrl.backends.cpu import isa, native_build
from portrl.ops.layers import swiglu as native_swiglu

LIBRARY = "swiglu"


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate2d, up2d, variant):
        ctx.save_for_backward(gate2d, up2d)
        ctx.ops = getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant))
        return ctx.ops.forward(gate2d, up2d)

    @staticmethod
    def backward(ctx, grad_out):
        gate2d, up2d = ctx.saved_tensors
        return (*ctx.ops.backward(grad_out.contiguous(), gate2d, up2d), None)


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (rows, width) with unit stride along the width: a view where one exists, else a copy."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def swiglu_fused(gate: torch.Tensor, up: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (the ``swiglu`` op's contract), fused for float32 CPU tensors of the same shape.
    ``variant`` (``avx512`` / ``avx2``): that build, which this CPU must run (tests); None: backends/cpu/isa.py's."""
    if (gate.shape != up.shape or gate.dtype != torch.float32 or up.dtype != torch.float32
            or gate.device.type != "cpu" or up.device.type != "cpu" or gate.numel() == 0):
        return native_swiglu(gate, up)
    variant = variant or isa.chosen().variant
    if variant is None or not native_build.try_load(LIBRARY, variant):
        return native_swiglu(gate, up)
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        # nothing to differentiate (a decode step): the op itself, without the autograd.Function's ~20 us a call
        ops = getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant))
        return ops.forward(unit_stride_rows(gate), unit_stride_rows(up)).view(gate.shape)
    return _FusedSwiGLU.apply(unit_stride_rows(gate), unit_stride_rows(up), variant).view(gate.shape)
