"""Triton kernels for log-prob + entropy; loaded through ``portrl.backends.triton.load_kernels`` (see logprobs.py)."""

import triton
import triton.language as tl


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def fwd_kernel(z_ptr, z_stride, labels_ptr, logp_ptr, ent_ptr, lse_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * z_stride
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.full([1], 0.0, tl.float32)
    t = tl.full([1], 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        z = tl.load(z_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.reduce(z, 0, maximum))
        alpha = tl.exp(m - m_new)
        e = tl.where(valid, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.reduce(e, 0, add)
        t = t * alpha + tl.reduce(e * tl.where(valid, z, 0.0), 0, add)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row + tl.arange(0, 1))
    z_label = tl.load(z_row + label).to(tl.float32)
    out = row + tl.arange(0, 1)
    tl.store(logp_ptr + out, z_label - lse)
    tl.store(ent_ptr + out, lse - t / s)
    tl.store(lse_ptr + out, lse)


@triton.jit
def bwd_kernel(z_ptr, z_stride, labels_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * z_stride
    lse = tl.load(lse_ptr + row)
    ent = tl.load(ent_ptr + row)
    g = tl.load(glogp_ptr + row)
    e = tl.load(gent_ptr + row)
    label = tl.load(labels_ptr + row)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        z = tl.load(z_row + offs, mask=valid, other=0.0).to(tl.float32)
        log_p = z - lse
        p = tl.exp(log_p)
        grad = p * (-e * (log_p + ent) - g)
        grad = tl.where(offs == label, grad + g, grad)
        tl.store(z_row + offs, grad, mask=valid)
