"""Triton RMSNorm, forward and backward, matching ``portrl.ops.rms_norm``.

Forward per row: ``r = 1/sqrt(mean(x^2) + eps)``, ``y = w * cast(x r)`` (cast to x's dtype, as
Qwen2RMSNorm). Backward per row with ``xh = x r``: ``dx = r (w dy - xh mean(xh w dy))``;
``dw = sum_rows dy xh``, accumulated per program over ``ROWS`` rows then summed.
"""

from __future__ import annotations

import torch

from portrl.backends.triton import interpreting, load_kernels

ROWS = 16


def _kernels():
    module = load_kernels("rms_norm_kernels", interpreting())
    return module.fwd_kernel, module.bwd_kernel


def _block(h: int) -> int:
    return 1 << max(h - 1, 1).bit_length()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        fwd, _ = _kernels()
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n, h = x2.shape
        y = torch.empty(n, h, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        if n:
            fwd[(n,)](x2, weight.contiguous(), y, rstd, h, float(eps), BLOCK_H=_block(h))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.reshape(*shape[:-1], h)

    @staticmethod
    def backward(ctx, dy):
        _, bwd = _kernels()
        x2, weight, rstd = ctx.saved_tensors
        n, h = x2.shape
        programs = max(1, -(-n // ROWS))
        dx = torch.empty_like(x2)
        dw_part = torch.empty(programs, h, dtype=torch.float32, device=x2.device)
        dy2 = dy.reshape(-1, h).contiguous()
        if n:
            bwd[(programs,)](x2, weight.contiguous(), dy2, rstd, dx, dw_part, n, h, ROWS_PER=ROWS, BLOCK_H=_block(h))
        else:
            dw_part.zero_()
        return dx.reshape(ctx.shape), dw_part.sum(0).to(weight.dtype), None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rms_norm`` through the Triton kernels; same contract as the native op."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must have shape ({x.shape[-1]},) (x's last dim); got {tuple(weight.shape)}")
    return _RMSNorm.apply(x, weight, eps)
