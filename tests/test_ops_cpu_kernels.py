"""CPU attention kernels (per-sequence SDPA, block-diagonal eager) against the native op, values and gradients."""

import pytest
import torch

from portrl import ops
from portrl.backends.cpu.kernels import attention_varlen_eager, attention_varlen_sdpa, block_diagonal_mask


def _case(lengths, hq, hkv, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    return q, k, v, ops.cu_seqlens_from_lengths(lengths), torch.randn(total, hq, d, generator=g)


def _run(fn, q, k, v, cu, grad_out, causal):
    out = fn(q, k, v, cu, int((cu[1:] - cu[:-1]).max()), None, causal)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


@pytest.mark.parametrize("fn", [attention_varlen_sdpa, attention_varlen_eager], ids=["sdpa", "eager"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_attention_matches_native(fn, hq, hkv, causal):
    q, k, v, cu, go = _case([7, 1, 12, 4], hq, hkv)
    for got, want in zip(_run(fn, q, k, v, cu, go, causal), _run(ops.attention_varlen, q, k, v, cu, go, causal)):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5


def test_block_diagonal_mask():
    m = block_diagonal_mask(torch.tensor([0, 2, 3]))
    assert m.tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def test_cpu_backend_registers_its_kernels():
    assert ops.select("attention_varlen", backend="cpu") == ("sdpa", attention_varlen_sdpa)
    assert ops.select("attention_varlen", impl="eager", backend="cpu")[1] is attention_varlen_eager


@pytest.mark.parametrize("lengths", [[40, 1, 2, 3], [0, 5, 0, 3]])
def test_cpu_attention_uneven_and_empty_sequences(lengths):
    q, k, v, cu, go = _case(lengths, 4, 2)
    for causal in (True, False):
        want = _run(ops.attention_varlen, q, k, v, cu, go, causal)
        for fn in (attention_varlen_sdpa, attention_varlen_eager):
            for got, ref in zip(_run(fn, q, k, v, cu, go, causal), want):
                assert (got - ref).abs().max().item() <= 1e-5
