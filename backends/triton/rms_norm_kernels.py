"""Triton kernels for RMSNorm; loaded through ``portrl.backends.triton.load_kernels`` (see rms_norm.py)."""

import triton
import triton.language as tl


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    valid = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=valid, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(xf * xf, 0, add) / H + eps)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=valid)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_ptr, N, H, ROWS_PER: tl.constexpr,
               BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    valid = cols < H
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    dw = tl.full([BLOCK_H], 0.0, tl.float32)
    for i in range(0, ROWS_PER):
        row = pid.to(tl.int64) * ROWS_PER + i
        ok = valid & ((row + tl.full([BLOCK_H], 0, tl.int64)) < N)
        x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0)
        dy = tl.load(dy_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, N - 1))  # rows past N load 0 for x, dy: no effect
        xh = x.to(tl.float32) * rstd
        wdy = w * dy
        dx = rstd * (wdy - xh * (tl.reduce(xh * wdy, 0, add) / H))
        tl.store(dx_ptr + row * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        dw += dy * xh.to(x.dtype).to(tl.float32)
    tl.store(dw_ptr + pid * H + cols, dw, mask=valid)
