"""``logprobs_entropy`` over a vocabulary-parallel LM head: each rank of a tensor-parallel group holds a contiguous
block of the head's rows, and the full ``(N, V)`` logits are never formed nor gathered.

Rank ``r`` holds ``W_r = W[v_r : v_r + V_r]`` (and ``b_r``), the full head being the ranks' blocks in rank order;
hidden states ``h (N, H)``, labels ``y (N,)`` (global ids) and the upstream gradients are the same on every rank.
With ``z_r = (h W_r^T + b_r) / T`` (``T`` the temperature), computed ``chunk_size`` rows at a time::

    m_r = max_v z_r,   s_r = sum_v e^{z_r - m_r},   t_r = sum_v e^{z_r - m_r} z_r,   l_r = z_r[y - v_r] (0 off-shard)
    m   = all-reduce MAX of m_r
    [s, t, z_y] = all-reduce SUM of [s_r e^{m_r - m}, t_r e^{m_r - m}, l_r]
    lse = m + log s,   entropy = lse - t / s,   logp = z_y - lse

(the online statistics of portrl/ops/logprobs_vocab.py, with the ranks as the vocabulary blocks; one MAX and one
SUM of a few N-vectors per call). The SUM also counts the shards holding each label: a label in none (out of the
vocabulary) or in two (overlapping shards) raises ValueError on every rank alike.

Backward recomputes each chunk of ``z_r``; with ``p = e^{z_r - lse}`` and upstream gradients ``g`` (logp) and
``e`` (entropy)::

    dz_r = (g (onehot(y - v_r) - p) - e p (z_r - lse + entropy)) / T
    dW_r = dz_r^T h,   db_r = sum_n dz_r   (local: each rank's own block)
    dh   = all-reduce SUM of dz_r W_r        (every rank holds the whole dh, as its replicated h needs)

An output unused by the loss arrives as None and its terms are skipped; every rank must use the same outputs
(the collectives must match). Values and gradients are those of ``logprobs_entropy`` on the full head
(tests/test_ops_logprobs_tp.py). Logits are computed in the inputs' dtype and reduced in at least float32, as
the native op does; ``dh`` is summed over the group in that precision, then cast to the inputs' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from portrl.ops.logprobs import _chunk_logits, check_logprobs_inputs, logprobs_entropy


def _shard_stats(hidden, weight, bias, labels, lo, inv_temp, chunk, compute):
    """``(m_r, s_r, t_r, l_r, in_r)`` of this rank's shard (module docstring), each ``(N,)`` in ``compute``;
    ``in_r`` is 1 where the label lies in the shard."""
    n, vocab = hidden.shape[0], weight.shape[0]
    stats = torch.zeros(5, n, dtype=compute, device=hidden.device)
    for s0 in range(0, n, chunk):
        s1 = min(n, s0 + chunk)
        z = _chunk_logits(hidden[s0:s1], weight, bias, inv_temp, compute)
        m = z.amax(1)
        e = torch.sub(z, m[:, None]).exp_()
        local = labels[s0:s1] - lo
        inside = (local >= 0) & (local < vocab)
        picked = z.gather(1, local.clamp(0, vocab - 1)[:, None])[:, 0]
        picked = torch.where(inside, picked, 0.0)
        stats[:, s0:s1] = torch.stack([m, e.sum(1), e.mul_(z).sum(1), picked, inside.to(compute)])
    return stats


def _dlogits(z, labels, lo, lse, entropy, g_logp, g_entropy):
    """``dz`` of one chunk (before the division by T), computed in place of ``z``."""
    log_p = z.sub_(lse[:, None])
    p = log_p.exp()
    if g_entropy is not None:  # - g_entropy p (log p + entropy)
        dz = log_p.add_(entropy[:, None]).mul_(p).mul_(-g_entropy[:, None])
        if g_logp is not None:
            dz.sub_(p.mul_(g_logp[:, None]))
    else:
        dz = p.mul_(-g_logp[:, None])
    if g_logp is not None:
        local = labels - lo
        rows = ((local >= 0) & (local < z.shape[1])).nonzero()[:, 0]
        dz.index_put_((rows, local[rows]), g_logp[rows], accumulate=True)
    return dz


class VocabParallelLogprobsEntropy(torch.autograd.Function):
    """Autograd function of :func:`vocab_parallel_logprobs_entropy` (the formulas: module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, vocab_start, group, inv_temp, chunk):
        compute = torch.promote_types(hidden.dtype, torch.float32)
        stats = _shard_stats(hidden, weight, bias, labels, vocab_start, inv_temp, chunk, compute)
        m = stats[0].clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        sums = stats[1:]
        sums[:2] *= torch.exp(stats[0] - m)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        s, t, picked, count = sums
        bad = (count != 1).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"labels must be global vocabulary ids held by exactly one rank's shard "
                             f"[vocab_start, vocab_start + {weight.shape[0]}) (here vocab_start={vocab_start}); "
                             f"row {i}'s label {int(labels[i])} is in {int(count[i])} shards")
        lse = m + torch.log(s)
        entropy = lse - t / s
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.set_materialize_grads(False)  # an output unused by the loss arrives as None, not zeros
        ctx.vocab_start, ctx.group, ctx.inv_temp, ctx.chunk, ctx.compute = vocab_start, group, inv_temp, chunk, compute
        return picked - lse, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None, None, None, None
        inv_temp, chunk, compute, lo = ctx.inv_temp, ctx.chunk, ctx.compute, ctx.vocab_start
        g_logp = g_logp.to(compute) if g_logp is not None else None
        g_entropy = g_entropy.to(compute) if g_entropy is not None else None
        n = hidden.shape[0]
        grad_h = torch.zeros(hidden.shape, dtype=compute, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=compute, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=compute, device=weight.device) if need_b else None
        for s0 in range(0, n, chunk):
            s1 = min(n, s0 + chunk)
            h = hidden[s0:s1]
            z = _chunk_logits(h, weight, bias, inv_temp, compute)
            dz = _dlogits(z, labels[s0:s1], lo, lse[s0:s1], entropy[s0:s1],
                          g_logp[s0:s1] if g_logp is not None else None,
                          g_entropy[s0:s1] if g_entropy is not None else None)
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            if grad_b is not None:
                grad_b += dz.sum(0)
            dz = dz.to(weight.dtype)  # the matmuls in the head's dtype, as the native op does them
            if grad_h is not None:
                grad_h[s0:s1] = dz @ weight
            if grad_w is not None:
                grad_w.addmm_(dz.t().to(compute), h.to(compute))
        if grad_h is not None:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.group)
        return (grad_h.to(hidden.dtype) if grad_h is not None else None,
                grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None, None, None)


def vocab_parallel_logprobs_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                    vocab_start: int, group: dist.ProcessGroup | None, temperature: float = 1.0,
                                    bias_shard: torch.Tensor | None = None, chunk_size: int | None = None):
    """``(logp (N,), entropy (N,))`` of ``softmax((h W^T + b) / T)`` at the global ``labels``, in at least float32,
    the same on every rank of ``group``, differentiable w.r.t. hidden, weight_shard and bias_shard: the
    ``logprobs_entropy`` contract (portrl/ops/logprobs.py) for a head whose rows
    ``[vocab_start, vocab_start + V_r)`` this rank holds as ``weight_shard (V_r, H)``. ``hidden (N, H)``, ``labels``
    and ``temperature`` are the same on every rank. ``chunk_size``: rows per chunk (default: about
    CHUNK_ELEMENTS logits of the shard per chunk). ``group`` None or of one rank: the native op on the whole head
    (``vocab_start`` must then be 0)."""
    if group is None or dist.get_world_size(group) == 1:
        if vocab_start != 0:
            raise ValueError(f"vocab_start must be 0 without a tensor-parallel group (one rank holds the whole "
                             f"head); got {vocab_start}")
        return logprobs_entropy(hidden, weight_shard, labels, temperature, bias_shard, chunk_size)
    # shapes, dtypes, temperature and chunk here; the labels' range against the whole vocabulary in the forward
    chunk = check_logprobs_inputs(hidden, weight_shard, torch.zeros_like(labels), temperature, bias_shard, chunk_size)
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0; got {vocab_start}")
    return VocabParallelLogprobsEntropy.apply(hidden, weight_shard, bias_shard, labels, int(vocab_start), group,
                                              1.0 / float(temperature), chunk)
