"""The CPU's fused RMSNorm (op ``rms_norm``, implementation ``fused``): ``weight * (x / sqrt(mean(x^2, -1) + eps))``
and its gradients in one pass each (backends/cpu/rms_norm.cpp, the AVX-512 or AVX2 build backends/cpu/isa.py
chooses), for float32 CPU tensors; anything else takes the native op.

Written as transformers' RMSNorm modules (and the native op) write it, torch runs five ops forward and nine backward
(``pow``'s backward alone computes ``2 x^1 g`` through a general power); the update replays each layer's two norms
and the final one (portrl/models/forward_tape.py), so a small model's update pays for them many times
(docs/performance.md).
"""

from __future__ import annotations

import torch

from portrl.backends.cpu import isa, native_build
from portrl.backends.cpu.swiglu import unit_stride_rows
from portrl.ops.layers import rms_norm as native_rms_norm

LIBRARY = "rms_norm"


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps, variant):
        ctx.ops = getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant))
        y, rstd = ctx.ops.forward(x2d, weight, eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.ops.backward(grad_out.contiguous(), x2d, weight, rstd)
        return dx, dw, None, None


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   variant: str | None = None) -> torch.Tensor:
    """The ``rms_norm`` op's contract (portrl.ops.layers.rms_norm), fused for float32 CPU tensors. ``variant``
    (``avx512`` / ``avx2``): that build, which this CPU must run (tests); None: backends/cpu/isa.py's."""
    if (weight.shape != x.shape[-1:] or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or weight.device.type != "cpu" or x.numel() == 0):
        return native_rms_norm(x, weight, eps)
    variant = variant or isa.chosen().variant
    if variant is None or not native_build.try_load(LIBRARY, variant):
        return native_rms_norm(x, weight, eps)
    flat = unit_stride_rows(x)
    w = weight.contiguous()
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        ops = getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant))
        return ops.forward(flat, w, float(eps))[0].view(x.shape)
    return _FusedRMSNorm.apply(flat, w, float(eps), variant).view(x.shape)
