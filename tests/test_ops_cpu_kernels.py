"""CPU kernels against the native ops: attention (per-sequence SDPA, block-diagonal eager; values and gradients)
and the MKL-packed decode linear."""

import pytest
import torch

from portrl import ops
from portrl.backends.cpu.kernels import (
    CALL_COST,
    attention_varlen_eager,
    attention_varlen_sdpa,
    block_diagonal_mask,
    linear_prepacked_mkl,
    mkl_packing_available,
)


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


# ----------------------------------------------------------------------------- linear_prepacked
needs_mkl = pytest.mark.skipif(mkl_packing_available() is not True, reason="torch build without MKL packing")


@needs_mkl
@pytest.mark.parametrize("bias", [True, False])
def test_linear_prepacked_mkl_equals_linear_for_any_row_count(bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    fn = linear_prepacked_mkl(w, b, rows=8)
    for shape in [(8, 64), (8, 1, 64), (5, 64), (2, 7, 64)]:  # the packed row count, then the fallback
        x = torch.randn(*shape, generator=g)
        out = fn(x)
        assert out.shape == (*shape[:-1], 96)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
    x = torch.randn(8, 64, generator=g)
    assert torch.equal(fn(x), torch.nn.functional.linear(x, w, b))  # same sgemm kernel: bit-identical


def test_linear_prepacked_other_dtypes_and_missing_rows_use_plain_linear():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(16, 8, generator=g), torch.randn(4, 8, generator=g)
    for fn, inp, weight in ((linear_prepacked_mkl(w.double(), None, rows=4), x.double(), w.double()),
                            (linear_prepacked_mkl(w, None, rows=None), x, w),
                            (ops.linear_prepacked(w, None, rows=4), x, w)):
        assert torch.equal(fn(inp), torch.nn.functional.linear(inp, weight))
    with pytest.raises(ValueError, match="2-D"):
        ops.linear_prepacked(torch.randn(3), None, rows=1)


@pytest.mark.parametrize("lengths", [[7, 0, 12, 4], [200, 9, 0, 5]], ids=["padded-call", "per-sequence-calls"])
def test_cpu_sdpa_causal_paths_match_native(lengths):
    """Similar lengths take one right-padded call, a wide spread one call per sequence; both exact."""
    q, k, v, cu, go = _case(lengths, 4, 2)
    padded = len(lengths) * max(lengths) ** 2 < sum(n * n + CALL_COST for n in lengths)
    assert padded == (lengths[0] == 7)
    for got, want in zip(_run(attention_varlen_sdpa, q, k, v, cu, go, True), _run(ops.attention_varlen, q, k, v, cu, go, True)):
        assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("lengths", [[7, 3, 12, 4], [200, 9, 1, 5]], ids=["padded-call", "per-sequence-calls"])
def test_cpu_sdpa_selects_a_plans_rows_itself(lengths):
    """gather / keep (a shared-prompt plan): the same values and gradients as gathering before and selecting after."""
    g = torch.Generator().manual_seed(3)
    packed = sum(lengths) - 5  # fewer packed tokens than virtual positions: some rows are gathered twice
    q, k, v = (torch.randn(packed, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    gather = torch.randint(0, packed, (sum(lengths),), generator=g)
    keep = torch.randperm(sum(lengths), generator=g)[:packed]
    cu = ops.cu_seqlens_from_lengths(lengths)
    go = torch.randn(packed, 4, 16, generator=g)
    assert attention_varlen_sdpa.GATHERS

    def run(selects_itself):
        if selects_itself:
            out = attention_varlen_sdpa(q, k, v, cu, max(lengths), None, True, gather=gather, keep=keep)
        else:
            qg, kg, vg = (t.index_select(0, gather) for t in (q, k, v))
            out = attention_varlen_sdpa(qg, kg, vg, cu, max(lengths), None, True).index_select(0, keep)
        return (out, *torch.autograd.grad(out, (q, k, v), go))

    for got, want in zip(run(True), run(False)):
        assert (got - want).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=f"end at total_tokens={sum(lengths) - 1};"):
        attention_varlen_sdpa(q, k, v, cu, max(lengths), None, True, gather=gather[1:], keep=keep)
