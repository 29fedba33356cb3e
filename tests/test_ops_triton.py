"""Triton kernels (fused log-prob + entropy, RMSNorm) on the CPU through TRITON_INTERPRET=1, against native.

The kernels are built on first use for the interpreter mode in force at call time, so setting the
variable here works even when another test imported triton earlier in the same process.
"""

import pytest
import torch

from portrl import ops

pytest.importorskip("triton")

from portrl.backends.triton.logprobs import logprobs_entropy_triton  # noqa: E402
from portrl.backends.triton.rms_norm import rms_norm_triton  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _lp_case(n, vocab, hidden=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (0.5 * torch.randn(n, hidden, generator=g)).requires_grad_()
    w = (0.5 * torch.randn(vocab, hidden, generator=g)).requires_grad_()
    b = torch.randn(vocab, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (n,), generator=g)
    return h, w, b, y, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _run(fn, h, w, b, y, gl, ge, temperature, chunk, use_bias=True):
    lp, ent = fn(h, w, y, temperature, b if use_bias else None, chunk)
    inputs = (h, w, b) if use_bias else (h, w)
    return (lp, ent, *torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), inputs))


@pytest.mark.parametrize("n,vocab,chunk,temperature,use_bias", [
    (17, 300, 8, 0.7, True),
    (20, 259, None, 1.0, False),
    (3, 4500, None, 1.3, True),  # two BLOCK_V blocks per row, last one partial
])
def test_triton_logprobs_entropy_matches_native(n, vocab, chunk, temperature, use_bias):
    case = _lp_case(n, vocab)
    got = _run(logprobs_entropy_triton, *case, temperature, chunk, use_bias)
    want = _run(ops.logprobs_entropy, *case, temperature, chunk, use_bias)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("shape", [(3, 5, 40), (37, 64), (1, 7)])
def test_triton_rms_norm_matches_native(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(shape[-1], generator=g, requires_grad=True)
    dy = torch.randn(*shape, generator=g)
    got, want = rms_norm_triton(x, w, 1e-6), ops.rms_norm(x, w, 1e-6)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    for a, b in zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(want, (x, w), dy)):
        assert (a - b).abs().max().item() <= 1e-5


def test_triton_rms_norm_input_error():
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_triton(torch.randn(2, 8), torch.ones(4))
