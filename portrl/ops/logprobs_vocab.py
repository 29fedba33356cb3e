"""``logprobs_entropy`` in vocabulary blocks: the implementation ``vocab_blocks`` (pure torch, any device).

The native op (portrl/ops/logprobs.py) cuts the *rows*: each chunk of ~110 rows multiplies the whole (V, H)
head, a skinny matmul (on a CPU well under a square one's FLOP rate: docs/performance.md) that streams the head
once per chunk, and its weight gradient adds into all of (V, H) once per chunk. This one cuts the
*vocabulary*: every block of ``Vb`` head rows meets all ``R`` rows of a row block at once (``R x H`` by
``H x Vb``, both large), and each block of the weight gradient is written once per row block.

Per row block and vocabulary block ``c`` (``z_c = h W_c^T / T + b_c / T``, ``T`` the temperature), online over c:
``m' = max(m, max z_c)``, ``s' = s e^{m-m'} + sum e^{z_c-m'}``, ``t' = t e^{m-m'} + sum e^{z_c-m'} z_c``;
then ``lse = m + log s``, ``entropy = lse - t / s``, ``logp = z_label - lse``. Backward recomputes each ``z_c``:
``p = e^{z_c - lse}``, ``dz = g_logp (onehot - p) - g_entropy p (z_c - lse + entropy)``, divided by ``T``;
``dh += dz W_c``, ``dW_c += dz^T h``, ``db_c += sum dz``. Same values and gradients as the native op
(tested against float64 in tests/test_ops_logprobs_vocab.py).
"""

from __future__ import annotations

import torch

from portrl.ops.logprobs import CHUNK_ELEMENTS, check_logprobs_inputs

#: fewest vocabulary entries per block (the row block shrinks to keep ``rows x block`` within CHUNK_ELEMENTS)
MIN_VOCAB_BLOCK = 2048


def block_sizes(n_rows: int, vocab: int, row_block: int | None = None) -> tuple[int, int]:
    """``(rows per row block, vocabulary entries per block)``: about CHUNK_ELEMENTS logits per block
    (64 MiB in float32), at least MIN_VOCAB_BLOCK vocabulary entries; ``row_block`` fixes the first."""
    rows = row_block or max(1, min(n_rows, CHUNK_ELEMENTS // MIN_VOCAB_BLOCK))
    return rows, max(1, min(vocab, CHUNK_ELEMENTS // rows))


def _block(buf: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor | None:
    """A contiguous ``(rows, cols)`` view at the start of the flat buffer ``buf`` (None: no buffer)."""
    return None if buf is None else buf[:rows * cols].view(rows, cols)


def _logits(h, weight, bias, lo, hi, inv_temp, compute, buf):
    """``z = (h W[lo:hi]^T + b[lo:hi]) / T`` in ``compute``; written into ``buf`` (flat, reused for every block:
    a fresh 64 MiB block per matmul costs its page faults each time) when the weights are in ``compute``."""
    w = weight[lo:hi]
    out = _block(buf, h.shape[0], w.shape[0]) if weight.dtype == compute else None
    if bias is None:
        z = torch.matmul(h, w.t(), out=out) if out is not None else torch.matmul(h, w.t())
    else:
        z = torch.addmm(bias[lo:hi], h, w.t(), out=out) if out is not None else torch.addmm(bias[lo:hi], h, w.t())
    z = z.to(compute)
    return z.mul_(inv_temp) if inv_temp != 1.0 else z


def _buffers(n_rows: int, vb: int, like: torch.Tensor, compute: torch.dtype) -> tuple:
    """Two flat scratch buffers of one block each (the logits, and the exponentials / probabilities)."""
    size = n_rows * vb
    return tuple(torch.empty(size, dtype=compute, device=like.device) for _ in range(2))


class VocabBlockLogprobsEntropy(torch.autograd.Function):
    """Autograd function of :func:`logprobs_entropy_vocab_blocks` (the formulas: module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_temp, row_block):
        compute = torch.promote_types(hidden.dtype, torch.float32)
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, vb = block_sizes(n, vocab, row_block)
        logp, entropy, lse = (hidden.new_empty(n, dtype=compute) for _ in range(3))
        zbuf, ebuf = _buffers(min(n, rows), vb, hidden, compute)
        for r0 in range(0, n, rows):
            h, lab = hidden[r0:r0 + rows], labels[r0:r0 + rows]
            m = torch.full((h.shape[0],), float("-inf"), dtype=compute, device=hidden.device)
            s, t, picked = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
            for lo in range(0, vocab, vb):
                z = _logits(h, weight, bias, lo, lo + vb, inv_temp, compute, zbuf)
                m_new = torch.maximum(m, z.amax(1))
                scale = torch.exp(m - m_new)  # 0 on the first block (m = -inf)
                e = torch.sub(z, m_new[:, None], out=_block(ebuf, *z.shape)).exp_()
                s = s * scale + e.sum(1)
                t = t * scale + e.mul_(z).sum(1)
                m = m_new
                inside = (lab >= lo) & (lab < lo + z.shape[1])
                picked = torch.where(inside, z.gather(1, (lab - lo).clamp(0, z.shape[1] - 1)[:, None])[:, 0], picked)
            block_lse = m + torch.log(s)
            lse[r0:r0 + rows], entropy[r0:r0 + rows], logp[r0:r0 + rows] = block_lse, block_lse - t / s, picked - block_lse
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.set_materialize_grads(False)  # an output unused by the loss arrives as None, not zeros
        ctx.inv_temp, ctx.row_block, ctx.compute = inv_temp, row_block, compute
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None, None
        inv_temp, compute = ctx.inv_temp, ctx.compute
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, vb = block_sizes(n, vocab, ctx.row_block)
        grad_h = torch.zeros(hidden.shape, dtype=compute, device=hidden.device) if need_h else None
        # the first row block writes each weight-gradient block, later ones add: no zero-fill of (V, H)
        grad_w = (torch.empty if n else torch.zeros)(weight.shape, dtype=compute, device=weight.device) if need_w else None
        grad_b = torch.zeros(vocab, dtype=compute, device=weight.device) if need_b else None
        zbuf, pbuf = _buffers(min(n, rows), vb, hidden, compute)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            h, lab, row_lse = hidden[r0:r1], labels[r0:r1], lse[r0:r1, None]
            gl = g_logp[r0:r1, None].to(compute) if g_logp is not None else None
            ge = g_entropy[r0:r1, None].to(compute) if g_entropy is not None else None
            for lo in range(0, vocab, vb):
                z = _logits(h, weight, bias, lo, lo + vb, inv_temp, compute, zbuf)
                hi = lo + z.shape[1]
                log_p = z.sub_(row_lse)
                p = torch.exp(log_p, out=_block(pbuf, *z.shape))
                if ge is not None:  # - g_entropy p (log p + entropy)
                    dz = log_p.add_(entropy[r0:r1, None]).mul_(p).mul_(-ge)
                    if gl is not None:
                        dz.sub_(p.mul_(gl))
                else:
                    assert gl is not None  # g_logp and g_entropy are not both None (returned above)
                    dz = p.mul_(-gl)
                if gl is not None:
                    inside = ((lab >= lo) & (lab < hi)).nonzero()[:, 0]
                    dz.index_put_((inside, lab[inside] - lo), gl[inside, 0], accumulate=True)
                if inv_temp != 1.0:
                    dz.mul_(inv_temp)
                if grad_b is not None:
                    grad_b[lo:hi] += dz.sum(0)
                dz = dz.to(weight.dtype)
                if grad_h is not None:
                    grad_h[r0:r1].addmm_(dz.to(compute), weight[lo:hi].to(compute))
                if grad_w is not None and r0 == 0:
                    torch.mm(dz.t().to(compute), h.to(compute), out=grad_w[lo:hi])
                elif grad_w is not None:
                    grad_w[lo:hi].addmm_(dz.t().to(compute), h.to(compute))
        return (grad_h.to(hidden.dtype) if grad_h is not None else None,
                grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None)


def logprobs_entropy_vocab_blocks(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                  temperature: float = 1.0, bias: torch.Tensor | None = None,
                                  chunk_size: int | None = None):
    """``(logp (N,), entropy (N,))`` in at least float32, differentiable w.r.t. hidden, weight, bias: the
    ``logprobs_entropy`` contract (portrl/ops/logprobs.py); ``chunk_size`` here is the rows of a row block
    (default: :func:`block_sizes`)."""
    check_logprobs_inputs(hidden, weight, labels, temperature, bias, chunk_size)
    row_block = None if chunk_size is None else int(chunk_size)
    return VocabBlockLogprobsEntropy.apply(hidden, weight, bias, labels, 1.0 / float(temperature), row_block)
