"""Log-probabilities of chosen tokens and the entropy, from hidden states and the LM head, in chunks.

For hidden states ``h (N, H)``, LM head ``W (V, H)`` (optional bias ``b (V,)``), labels ``y (N,)``
and temperature ``T``, with logits ``z = (h W^T + b) / T``::

    lse_n  = log sum_v exp(z_nv)
    logp_n = z_{n, y_n} - lse_n
    H_n    = lse_n - sum_v softmax(z_n)_v z_nv              (entropy of softmax(z_n))

Rows are processed ``chunk_size`` at a time, so the full ``(N, V)`` logits never exist at once.
The backward recomputes each chunk's logits (only ``lse`` and ``H``, N floats each, are saved) and
uses, with ``p = softmax(z_n)`` and upstream gradients ``g`` (for logp) and ``e`` (for H)::

    dL/dz_n = g_n (onehot(y_n) - p) - e_n p (log p + H_n)

then ``dL/dh = (dL/dz / T) W``, ``dL/dW = (dL/dz / T)^T h``, ``dL/db = sum_n dL/dz_n / T``.
When the entropy does not reach the loss (a metric only), ``e`` is None and its terms are skipped.
Logits are computed in the inputs' dtype and reduced in at least float32.

The per-row math (forward: z -> logp, H, lse; backward: z -> dL/dz) is a pluggable
:class:`RowOps`, so fused kernels reuse the chunking and matmuls here and replace only that part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: default chunk: about this many logits (float32) per chunk buffer (64 MiB)
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class RowOps:
    """forward(z (c,V) float, labels (c,)) -> (logp, entropy, lse), each (c,) float.
    backward(z, labels, lse, entropy, g_logp, g_entropy or None) -> dL/dz (c,V), may overwrite z."""

    forward: Callable
    backward: Callable


def _torch_forward(z: torch.Tensor, labels: torch.Tensor):
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, labels[:, None]).squeeze(1) - lse
    p = torch.exp(z - lse[:, None])
    entropy = lse - p.mul_(z).sum(-1)
    return logp, entropy, lse


def _torch_backward(z, labels, lse, entropy, g_logp, g_entropy):
    log_p = z.sub_(lse[:, None])
    if g_entropy is None:
        grad = log_p.exp_().mul_(-g_logp[:, None])
    else:
        p = log_p.exp()
        grad = log_p.add_(entropy[:, None]).mul_(-g_entropy[:, None]).sub_(g_logp[:, None]).mul_(p)
    return grad.scatter_add_(1, labels[:, None], g_logp[:, None])


TORCH_ROWS = RowOps(_torch_forward, _torch_backward)


def default_chunk_size(n_rows: int, vocab: int) -> int:
    return max(1, min(n_rows, CHUNK_ELEMENTS // max(vocab, 1)))


def check_logprobs_inputs(hidden, weight, labels, temperature, bias, chunk_size) -> int:
    """Validate inputs; return the chunk size to use."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be (N, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != (hidden.shape[0],) or labels.dtype.is_floating_point:
        raise ValueError(f"labels must be an integer tensor of shape ({hidden.shape[0]},); got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},); got {tuple(bias.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= weight.shape[0]):
        raise ValueError(f"labels must lie in [0, {weight.shape[0]}); got range "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    if chunk_size is None:
        return default_chunk_size(hidden.shape[0], weight.shape[0])
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def _chunk_logits(h, weight, bias, inv_temp, compute):
    z = torch.matmul(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
    z = z.to(compute)
    return z.mul_(inv_temp) if inv_temp != 1.0 else z


class ChunkedLogprobsEntropy(torch.autograd.Function):
    """Autograd function: forward and backward chunk by chunk (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_temp, chunk, rows):
        compute = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=compute)
        entropy = hidden.new_empty(n, dtype=compute)
        lse = hidden.new_empty(n, dtype=compute)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s:s + chunk], weight, bias, inv_temp, compute)
            logp[s:s + chunk], entropy[s:s + chunk], lse[s:s + chunk] = rows.forward(z, labels[s:s + chunk])
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.set_materialize_grads(False)  # an output unused by the loss arrives as None, not zeros
        ctx.inv_temp, ctx.chunk, ctx.rows, ctx.compute = inv_temp, chunk, rows, compute
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        inv_temp, chunk, compute = ctx.inv_temp, ctx.chunk, ctx.compute
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None, None, None
        g_logp = g_logp.to(compute) if g_logp is not None else torch.zeros_like(lse)
        g_entropy = g_entropy.to(compute) if g_entropy is not None else None
        grad_h = torch.empty_like(hidden) if need_h else None
        # the first chunk's product is written into grad_w, later ones added: no zero-fill pass over a (V, H) buffer
        grad_w = (torch.empty if hidden.shape[0] else torch.zeros)(weight.shape, dtype=compute,
                                                                  device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=compute, device=weight.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            e = s + chunk
            h = hidden[s:e]
            z = _chunk_logits(h, weight, bias, inv_temp, compute)
            dz = ctx.rows.backward(z, labels[s:e], lse[s:e], entropy[s:e], g_logp[s:e],
                                   g_entropy[s:e] if g_entropy is not None else None)
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            if grad_b is not None:
                grad_b += dz.sum(0)
            dz = dz.to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = dz @ weight
            if grad_w is not None and s == 0:
                torch.mm(dz.t().to(compute), h.to(compute), out=grad_w)
            elif grad_w is not None:
                grad_w.addmm_(dz.t().to(compute), h.to(compute))
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None,
                None, None, None, None)


def chunked_logprobs_entropy(hidden, weight, labels, temperature=1.0, bias=None, chunk_size=None, rows: RowOps = TORCH_ROWS):
    """Chunked logp + entropy with a given per-row implementation (used by native and fused kernels)."""
    chunk = check_logprobs_inputs(hidden, weight, labels, temperature, bias, chunk_size)
    return ChunkedLogprobsEntropy.apply(hidden, weight, bias, labels, 1.0 / float(temperature), chunk, rows)


def logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     bias: torch.Tensor | None = None, chunk_size: int | None = None):
    """Native op: ``(logp (N,), entropy (N,))`` in at least float32, differentiable w.r.t. hidden, weight, bias."""
    return chunked_logprobs_entropy(hidden, weight, labels, temperature, bias, chunk_size, TORCH_ROWS)


def logprobs_entropy_full(hidden, weight, labels, temperature=1.0, bias=None):
    """The naive computation over the full (N, V) logits; reference for tests and benchmarks."""
    compute = torch.promote_types(hidden.dtype, torch.float32)
    logits = torch.nn.functional.linear(hidden, weight, bias).to(compute) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(1, labels[:, None]).squeeze(1)
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, entropy
