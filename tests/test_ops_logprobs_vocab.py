"""The ``vocab_blocks`` implementation of ``logprobs_entropy`` (portrl/ops/logprobs_vocab.py): the same values and
gradients as the full-logits computation in float64 for every way of cutting rows and vocabulary (online
log-sum-exp across blocks, labels in any block, temperature, bias, an unused entropy), float32 against the native
op, and the CPU backend selects it."""

from __future__ import annotations

import pytest
import torch

import portrl.ops.logprobs_vocab as vocab_op
from portrl import ops
from portrl.ops.logprobs import logprobs_entropy, logprobs_entropy_full
from portrl.ops.logprobs_vocab import block_sizes, logprobs_entropy_vocab_blocks


def _run(fn, h, w, b, labels, temperature, g_logp, g_entropy, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    logp, ent = fn(h, w, labels, temperature, b, **kw)
    loss = (logp * g_logp).sum() + ((ent * g_entropy).sum() if g_entropy is not None else 0)
    loss.backward()
    return [logp, ent, h.grad, w.grad] + ([b.grad] if b is not None else [])


@pytest.mark.parametrize("rows,vocab,chunk_elements,row_block,temperature,bias,entropy_used", [
    (7, 50, 64, None, 1.0, False, True),    # one row block, 6 vocabulary blocks (the last one short)
    (7, 50, 64, 3, 0.7, True, True),        # 3 row blocks (the last one short) x 3 vocabulary blocks
    (9, 37, 64, 2, 1.3, True, False),       # entropy unused: its gradient arrives as None
    (5, 64, 64, None, 1.0, False, False),   # 5 rows x blocks of 12 entries
    (1, 10, 3, None, 1.0, True, True),      # a single row, blocks of 3
])
def test_equals_full_logits_in_float64(monkeypatch, rows, vocab, chunk_elements, row_block, temperature, bias,
                                       entropy_used):
    monkeypatch.setattr(vocab_op, "CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(vocab_op, "MIN_VOCAB_BLOCK", 3)
    r, vb = block_sizes(rows, vocab, row_block)
    assert vb < vocab  # several vocabulary blocks: the online log-sum-exp is exercised
    g = torch.Generator().manual_seed(rows * vocab)
    h = torch.randn(rows, 4, dtype=torch.float64, generator=g)
    w = torch.randn(vocab, 4, dtype=torch.float64, generator=g) * 2  # peaked: the running max moves across blocks
    b = torch.randn(vocab, dtype=torch.float64, generator=g) if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=g)
    g_logp = torch.randn(rows, dtype=torch.float64, generator=g)
    g_entropy = torch.randn(rows, dtype=torch.float64, generator=g) if entropy_used else None
    want = _run(logprobs_entropy_full, h, w, b, labels, temperature, g_logp, g_entropy)
    got = _run(logprobs_entropy_vocab_blocks, h, w, b, labels, temperature, g_logp, g_entropy, chunk_size=row_block)
    for name, x, y in zip(("logp", "entropy", "d hidden", "d weight", "d bias"), got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=name)


def test_float32_equals_the_native_op_at_a_real_vocabulary():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 32, generator=g)
    w = torch.randn(151665, 32, generator=g) * 0.1  # Qwen2.5's vocabulary: many blocks of the default size
    labels = torch.randint(0, 151665, (40,), generator=g)
    gl, ge = torch.randn(40, generator=g), torch.randn(40, generator=g)
    got = _run(logprobs_entropy_vocab_blocks, h, w, None, labels, 0.9, gl, ge)
    want = _run(logprobs_entropy, h, w, None, labels, 0.9, gl, ge)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_no_rows_and_block_sizes():
    w = torch.randn(11, 4, requires_grad=True)
    logp, ent = logprobs_entropy_vocab_blocks(torch.randn(0, 4, requires_grad=True), w, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert block_sizes(2048, 151936) == (2048, 8192)  # 64 MiB of float32 logits per block
    assert block_sizes(100_000, 151936) == (8192, 2048)  # long batches: the row block shrinks, not the matmul width
    with pytest.raises(ValueError, match="labels must lie in"):
        logprobs_entropy_vocab_blocks(torch.randn(2, 4), torch.randn(11, 4), torch.tensor([0, 11]))


def test_cpu_backend_selects_vocab_blocks():
    assert ops.select("logprobs_entropy", backend="cpu")[0] == "vocab_blocks"
