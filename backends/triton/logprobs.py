"""Fused Triton kernels for log-prob + entropy (forward) and its logits gradient (backward).

The chunking and the two matmuls (logits = h W^T, and the gradients through them) stay in
``portrl.ops.logprobs``; these kernels replace the per-row softmax math (see that module's
docstring for the formulas). Forward: one program per row streams the row's logits in blocks of
``BLOCK_V`` with an online log-sum-exp and an online ``sum_v p_v z_v``, writing logp, entropy and
lse (one pass over the logits, no softmax tensor). Backward: one program per row overwrites the
logits buffer with ``dL/dz = p (-e (log p + H) - g) + g onehot(y)`` in one pass.
"""

from __future__ import annotations

import torch

from portrl.backends.triton import interpreting, load_kernels
from portrl.ops.logprobs import RowOps, chunked_logprobs_entropy


def _kernels():
    module = load_kernels("logprobs_kernels", interpreting())
    return module.fwd_kernel, module.bwd_kernel


def _block(vocab: int) -> int:
    return min(4096, 1 << max(vocab - 1, 1).bit_length())


def _forward_rows(z: torch.Tensor, labels: torch.Tensor):
    fwd, _ = _kernels()
    z = z.contiguous()
    n, vocab = z.shape
    logp, ent, lse = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    if n:
        fwd[(n,)](z, z.stride(0), labels.contiguous(), logp, ent, lse, vocab, BLOCK_V=_block(vocab))
    return logp.to(z.dtype), ent.to(z.dtype), lse.to(z.dtype)


def _backward_rows(z, labels, lse, entropy, g_logp, g_entropy):
    _, bwd = _kernels()
    z = z.contiguous()
    n, vocab = z.shape
    if g_entropy is None:  # the entropy is a metric only: its gradient terms are zero
        g_entropy = torch.zeros_like(g_logp)
    if n:
        f32 = [t.to(torch.float32).contiguous() for t in (lse, entropy, g_logp, g_entropy)]
        bwd[(n,)](z, z.stride(0), labels.contiguous(), *f32, vocab, BLOCK_V=_block(vocab))
    return z


TRITON_ROWS = RowOps(_forward_rows, _backward_rows)


def logprobs_entropy_triton(hidden, weight, labels, temperature=1.0, bias=None, chunk_size=None):
    """``logprobs_entropy`` with the fused Triton row kernels; same contract as the native op.

    The kernels reduce in float32; float64 inputs are computed at float32 precision in the row math.
    """
    return chunked_logprobs_entropy(hidden, weight, labels, temperature, bias, chunk_size, TRITON_ROWS)
