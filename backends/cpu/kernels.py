"""CPU kernels for portrl.ops: varlen attention through torch SDPA and eager (block-diagonal mask), and
decode-loop linears on MKL-packed weights.

Both are plain torch and run on any device; the cuda and rocm backends reuse ``attention_varlen_sdpa``
as their fallback for dtypes flash-attention does not compute (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portrl.ops.attention import check_varlen_inputs

#: implementation names this module registers, best first (for the backend's kernel_preferences)
PREFERENCES = {"attention_varlen": ("sdpa", "eager", "native"), "linear_prepacked": ("mkl", "native")}


def attention_varlen_sdpa(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True):
    """One ``scaled_dot_product_attention`` call per sequence (is_causal, GQA via enable_gqa).

    Measured on CPU (fwd+bwd, 4:1 length spread, 8 to 256 sequences) this beats scattering the
    sequences into one padded batch and a single call by about 2x: padding doubles the attention work
    and the per-call overhead is small.
    """
    scale, n_rep = check_varlen_inputs(q, k, v, cu_seqlens, softmax_scale)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outs = []
    # split (not slicing): its backward is one cat, where per-slice backward would zero-fill a full-size
    # gradient for every sequence
    for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        if qi.shape[0] == 0:
            continue
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (qi, ki, vi))
        out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=scale, enable_gqa=n_rep > 1)
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def block_diagonal_mask(cu_seqlens: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """(total, total) bool, True where query i may attend key j: same sequence (and j <= i when causal)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    mask = seq_id[:, None] == seq_id[None, :]
    return mask.tril() if causal else mask


def attention_varlen_eager(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True):
    """All sequences in one masked matmul over the packed tokens (block-diagonal mask).

    Memory is O(heads * total^2): for many short sequences, not for long packs.
    """
    scale, n_rep = check_varlen_inputs(q, k, v, cu_seqlens, softmax_scale)
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    qh = q.transpose(0, 1)
    kh = k.transpose(0, 1).repeat_interleave(n_rep, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(n_rep, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
    scores = scores.masked_fill(~block_diagonal_mask(cu_seqlens, causal), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


def mkl_packing_available() -> bool | str:
    """True when this torch build has MKL and its packed-sgemm linear ops (x86 builds), else the reason."""
    if not torch.backends.mkl.is_available():
        return "this torch build has no MKL (e.g. an aarch64 build)"
    if not hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight") or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return "this torch build lacks torch.ops.mkl._mkl_reorder_linear_weight / _mkl_linear"
    return True


def linear_prepacked_mkl(weight, bias=None, rows=None):
    """``x -> x @ weight^T + bias`` on a weight packed once for MKL's sgemm (``cblas_sgemm_pack``).

    An ordinary float32 matmul packs the weight into the kernel's blocked layout on every call; for a
    decode step (a few rows times the whole weight) that packing is a large part of the call. Packing
    once per generate call and reusing it for every step: 8.3 -> 5.4 ms per step of the medium
    benchmark model's matmuls at 32 rows (2 threads), bit-identical results (same kernel). The packed
    weight serves only inputs of exactly ``rows`` rows; any other count (a prefill, a batch after
    finished rows were dropped) takes ``_mkl_linear``'s own fallback, the plain matmul on ``weight``.
    float32 on the CPU only; other dtypes or devices get ``F.linear``.
    """
    if (rows is None or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or mkl_packing_available() is not True):
        return lambda x: F.linear(x, weight, bias)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), int(rows))
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, bias, int(rows))


def register(registry) -> None:
    """Register the CPU implementations into the ops registry (``portrl.ops.registry``)."""
    registry.register("attention_varlen", "sdpa", attention_varlen_sdpa)
    registry.register("attention_varlen", "eager", attention_varlen_eager)
    registry.register("linear_prepacked", "mkl", linear_prepacked_mkl, available=mkl_packing_available)
