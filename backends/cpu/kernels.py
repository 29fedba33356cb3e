"""CPU kernels for portrl.ops: varlen attention through torch SDPA and eager (block-diagonal mask), and
decode-loop linears: an AVX-512 or AVX2 + FMA kernel on the weights as they are (backends/cpu/rows_linear.cpp; the
variant is chosen by backends/cpu/isa.py) or MKL-packed weights.

Both are plain torch and run on any device; the cuda and rocm backends reuse ``attention_varlen_sdpa``
as their fallback for dtypes flash-attention does not compute (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portrl.backends.cpu import isa, native_build
from portrl.backends.cpu.decode_attention import decode_attention_fused
from portrl.backends.cpu.decode_layer import decode_layer_fused
from portrl.backends.cpu.rms_norm import rms_norm_fused
from portrl.backends.cpu.rotary import rotary_fused
from portrl.backends.cpu.swiglu import swiglu_fused
from portrl.device.backend import KernelRegistry
from portrl.ops.attention import check_varlen_inputs
from portrl.ops.layers import linear_prepacked, linear_weight_parts

#: implementation names this module registers, best first (for the backend's kernel_preferences)
PREFERENCES = {"attention_varlen": ("sdpa", "eager", "native"), "linear_prepacked": ("rows", "mkl", "native"),
               # vocabulary blocks: large matmuls instead of ~110-row ones (portrl/ops/logprobs_vocab.py;
               # docs/performance.md)
               "logprobs_entropy": ("vocab_blocks", "native"),
               # one pass forward and one backward instead of five (backends/cpu/swiglu.py)
               "swiglu": ("fused", "native"),
               # the same for RMSNorm: one pass each way instead of five and nine (backends/cpu/rms_norm.py)
               "rms_norm": ("fused", "native"),
               # the same for the rotary embedding: one pass each way instead of five and ~eight
               # (backends/cpu/rotary.py)
               "rotary": ("fused", "native"),
               # one pass over each row's cache for all heads of a KV head (backends/cpu/decode_attention.py)
               "decode_attention": ("fused", "native"),
               # a decode step's whole layer in one call and one parallel region (backends/cpu/decode_layer.py)
               "decode_layer": ("fused", "native")}


#: cost of one SDPA call beyond its math, in units of one query-key pair: about attention over 64 tokens
#: (fitted to fwd+bwd timings: docs/performance.md)
CALL_COST = 64 * 64


def attention_varlen_sdpa(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True, gather=None,
                          keep=None):
    """Causal or not, GQA via enable_gqa; one ``scaled_dot_product_attention`` call per sequence, or for
    causal attention one call on the sequences right-padded to the longest, whichever costs less.

    Right padding is exact under a causal mask: a real query never sees the padding after it, and the
    padded queries' outputs are dropped (so their gradients are zero). The padded call does
    ``S * Lmax^2`` query-key pairs against ``sum(L_i^2)``, but saves ``S - 1`` calls; it is chosen when
    ``S * Lmax^2 < sum(L_i^2 + CALL_COST)`` (short sequences pad, long ones go one by one:
    docs/performance.md).

    ``gather`` and ``keep`` (``GATHERS``; a shared-prompt plan, portrl/models/prefix_sharing.py): the sequences are
    the rows ``gather`` of ``q``, ``k``, ``v`` and the result is the output's rows ``keep``. The padded call then takes
    its rows straight from ``q``, ``k``, ``v`` (the plan's gather and the padding's composed into one index, and the
    two selections of the output into one): one gather a tensor and one backward scatter instead of two.
    """
    rows = gather.numel() if gather is not None else q.shape[0]
    scale, n_rep = check_varlen_inputs(q, k, v, cu_seqlens, softmax_scale, rows=rows)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    longest = max(lengths, default=0)
    if causal and len(lengths) > 1 and len(lengths) * longest ** 2 < sum(n * n + CALL_COST for n in lengths):
        return _attention_right_padded(q, k, v, cu_seqlens, lengths, longest, scale, n_rep > 1, gather, keep)
    if gather is not None:
        q, k, v = (t.index_select(0, gather) for t in (q, k, v))
    out = _attention_per_sequence(q, k, v, lengths, scale, causal, n_rep > 1)
    return out.index_select(0, keep) if keep is not None else out


#: ``attention_varlen_sdpa`` takes a shared-prompt plan's ``gather`` and ``keep`` (portrl/models/attention.py)
attention_varlen_sdpa.GATHERS = True  # type: ignore[attr-defined]


def _attention_per_sequence(q, k, v, lengths, scale, causal, gqa):
    outs = []
    # split (not slicing): its backward is one cat, where per-slice backward would zero-fill a full-size
    # gradient for every sequence
    for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        if qi.shape[0] == 0:
            continue
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (qi, ki, vi))
        out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=scale, enable_gqa=gqa)
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def _attention_right_padded(q, k, v, cu_seqlens, lengths, longest, scale, gqa, gather=None, keep=None):
    """Causal attention of the packed sequences as one (S, H, Lmax, D) SDPA call on right-padded copies (of the
    rows ``gather`` of q, k, v when given; the output's rows ``keep`` when given)."""
    n_seq = len(lengths)
    pos = torch.arange(longest, device=q.device)
    valid = pos[None] < torch.tensor(lengths, device=q.device)[:, None]  # (S, Lmax)
    rows = torch.where(valid, cu_seqlens[:-1, None].long() + pos[None], 0).reshape(-1)
    out_rows = valid.reshape(-1).nonzero().squeeze(-1)  # row-major: the packed order
    if gather is not None:
        rows = gather.index_select(0, rows)
    if keep is not None:
        out_rows = out_rows.index_select(0, keep)
    # index_select, not indexing: its backward is index_add (indexing's is a slower index_put)
    qp, kp, vp = (t.index_select(0, rows).view(n_seq, longest, t.shape[1], t.shape[2]).transpose(1, 2)
                  for t in (q, k, v))
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(n_seq * longest, q.shape[1], q.shape[2]).index_select(0, out_rows)


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
    decode step (a few rows times the whole weight) that packing is a large part of the call, so it
    packs once per generate call and reuses it for every step, with bit-identical results (same kernel). The packed
    weight serves only inputs of exactly ``rows`` rows; any other count (a prefill, a batch after
    finished rows were dropped) takes ``_mkl_linear``'s own fallback, the plain matmul on ``weight``.
    float32 on the CPU only; other dtypes or devices get the native op (``F.linear``).
    """
    parts = linear_weight_parts(weight)
    if (rows is None or parts[0].dtype != torch.float32 or parts[0].device.type != "cpu"
            or mkl_packing_available() is not True):
        return linear_prepacked(parts, bias, rows)
    whole = (parts[0] if len(parts) == 1 else torch.cat(parts)).detach()
    packed = torch.ops.mkl._mkl_reorder_linear_weight(whole, int(rows))
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, whole, bias, int(rows))


#: most rows the row-tile kernel serves. From about 16 rows on a decode step is compute-bound (2 FLOPs per row and
#: weight), and the kernel runs near the FLOP peak, well above F.linear and MKL's packed sgemm (which also spends
#: time packing each call's weights) at these shapes (docs/performance.md). The plain matmul draws level only
#: from ~128 rows (the rows block of an input 4864 wide outgrows L2); a prefill of more rows takes F.linear
ROWS_MAX = 64


def native_kernels_available() -> bool | str:
    """Whether this package's C++ CPU kernels (rows_linear.cpp, swiglu.cpp, rms_norm.cpp, rotary.cpp,
    decode_attention.cpp, decode_layer.cpp) can run here:
    True on an x86-64 CPU with AVX-512 or AVX2 + FMA (capped by torch's CPU capability, forced by
    ``PORTRL_CPU_ISA``: backends/cpu/isa.py) and a C++ compiler, else the reason. Raises :class:`~portrl.errors.UserError` for a bad ``PORTRL_CPU_ISA``."""
    choice = isa.chosen()
    return True if choice.variant else choice.reason


def rows_op(variant: str):
    """``torch.ops.portrl_cpu_rows_<variant>.rows_linear`` (its library loaded by the caller)."""
    return getattr(torch.ops, native_build.ops_namespace("rows_linear", variant)).rows_linear


def linear_prepacked_rows(weight, bias=None, rows=None, variant=None):
    """``x -> x @ cat(weight)^T + bias`` reading each weight where it is, once per call (backends/cpu/rows_linear.cpp).

    A decode step multiplies a few rows by every weight, so it is bound by reading the weights (up to ~16 rows,
    then by FLOPs). The kernel computes straight from the row-major weights, so nothing is copied: no packed layout,
    and fused projections (``weight`` a sequence: q/k/v, gate/up) are not concatenated. Below 12 rows (and on AVX2)
    tiles of 3 output columns times 8 rows (4 on AVX2), each output a dot product across the lanes; from 12 rows on
    AVX-512, the rows across the lanes and 16 output columns a tile (rows_linear.cpp says why; against
    F.linear: docs/performance.md, ``python benchmarks/rows_kernel_isa.py --model-pass``). For ``rows`` (the
    decode's row count) up to ``ROWS_MAX``; fewer rows (finished sequences dropped) take the kernel too, more (a
    prefill) ``F.linear`` per part, outputs concatenated. More decode rows, other dtypes and devices take the MKL
    implementation (and its rules). Results equal ``F.linear`` up to float32 summation order. ``variant``
    (``avx512`` / ``avx2``): that build of the kernel, which this CPU must run (tests and benchmarks); None: the one
    backends/cpu/isa.py chooses.

    The library is built on first use (~10 s, cached across processes: backends/cpu/native_build.py); if it
    cannot be built, one warning and MKL's packed linear serves instead.
    """
    parts = linear_weight_parts(weight)
    variant = variant or isa.chosen().variant
    if (rows is None or rows > ROWS_MAX or any(p.dtype != torch.float32 or p.device.type != "cpu" for p in parts)
            or variant is None or not native_build.try_load("rows_linear", variant)):
        return linear_prepacked_mkl(parts, bias, rows)
    op = rows_op(variant)
    parts = [p.detach().contiguous() for p in parts]
    b = bias.detach().contiguous() if bias is not None else None
    n = sum(p.shape[0] for p in parts)

    def apply(x):
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > ROWS_MAX or x.dtype != torch.float32:
            if len(parts) == 1:
                return F.linear(x, parts[0], b)
            # a prefill: concatenating its outputs moves far less than concatenating the weights
            y = torch.cat([F.linear(x, p) for p in parts], dim=-1)
            return y.add_(b) if b is not None else y
        return op(flat, parts, b).view(*x.shape[:-1], n)

    return apply


def register(registry: KernelRegistry) -> None:
    """Register the CPU implementations into the ops registry (``portrl.ops.registry``). A bad ``PORTRL_CPU_ISA`` is
    a :class:`~portrl.errors.UserError` here, once, not an availability probe that quietly fails."""
    isa.setting()
    registry.register("attention_varlen", "sdpa", attention_varlen_sdpa)
    registry.register("attention_varlen", "eager", attention_varlen_eager)
    registry.register("linear_prepacked", "mkl", linear_prepacked_mkl, available=mkl_packing_available)
    registry.register("linear_prepacked", "rows", linear_prepacked_rows, available=native_kernels_available)
    registry.register("swiglu", "fused", swiglu_fused, available=native_kernels_available)
    registry.register("rms_norm", "fused", rms_norm_fused, available=native_kernels_available)
    registry.register("rotary", "fused", rotary_fused, available=native_kernels_available)
    registry.register("decode_attention", "fused", decode_attention_fused, available=native_kernels_available)
    registry.register("decode_layer", "fused", decode_layer_fused, available=native_kernels_available)
