"""The CPU's fused rotary embedding (backends/cpu/rotary.cpp, op ``rotary`` implementation ``fused``) against the
native op (portrl.ops.apply_rotary: ``x * cos + rotate_half(x) * sin``), for every instruction-set variant this CPU
runs (the replay that runs it: tests/test_models_forward_tape.py)."""

import pytest
import torch

from portrl import ops
from portrl.backends.cpu import isa
from portrl.backends.cpu.kernels import native_kernels_available
from portrl.backends.cpu.rotary import rotary_fused

RUNNABLE = [v for v in isa.NEEDS if not isa.missing(v, isa.cpu_flags())]
variants = pytest.mark.parametrize("variant", RUNNABLE or [pytest.param(None, marks=pytest.mark.skip(
    reason="this CPU runs no variant of the native kernels (needs AVX2 + FMA)"))])


@variants
@pytest.mark.parametrize("rows,heads,dim", [(7, 3, 10), (33, 4, 32), (5, 14, 64), (2, 1, 2), (40, 2, 48)])
def test_fused_rotary_equals_the_native_op_with_its_gradient(rows, heads, dim, variant):
    """Values and x's gradient, half widths with and without a vector tail (5, 16, 32, 1, 24 floats), x a view of a
    wider projection (rows of heads * dim + 8 floats, as q and k are columns of the fused q/k/v output)."""
    g = torch.Generator().manual_seed(rows * heads + dim)
    wide = torch.randn(rows, heads * dim + 8, generator=g, requires_grad=True)
    x = wide[:, :heads * dim].reshape(rows, heads, dim)
    cos, sin = torch.randn(rows, 1, dim, generator=g), torch.randn(rows, 1, dim, generator=g)
    grad = torch.randn(rows, heads, dim, generator=g)
    got = rotary_fused(x, cos, sin, variant=variant)
    want = ops.apply_rotary(x, cos, sin)
    assert got.grad_fn is not None and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    (a,) = torch.autograd.grad(got, wide, grad)
    (b,) = torch.autograd.grad(want, wide, grad)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.equal(a[:, heads * dim:], torch.zeros(rows, 8))


@variants
def test_fused_rotary_takes_2d_cos_runs_alone_without_gradients_and_other_inputs_go_native(variant):
    g = torch.Generator().manual_seed(5)
    x, cos, sin = torch.randn(6, 2, 16, generator=g), torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    with torch.inference_mode():
        alone = rotary_fused(x, cos, sin, variant=variant)
    assert alone.grad_fn is None
    torch.testing.assert_close(alone, ops.apply_rotary(x, cos[:, None], sin[:, None]), atol=1e-6, rtol=1e-6)
    # a gradient summed over every element reaches the op as an expanded tensor (stride 0)
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(rotary_fused(xg, cos, sin, variant=variant).sum(), xg)
    (want,) = torch.autograd.grad(ops.apply_rotary(xg, cos[:, None], sin[:, None]).sum(), xg)
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-6)
    # float64, 4-D x, cos that differs per head, or cos needing a gradient: the native op's exact values
    x64 = x.double()
    assert torch.equal(rotary_fused(x64, cos.double()[:, None], sin.double()[:, None]),
                       ops.apply_rotary(x64, cos.double()[:, None], sin.double()[:, None]))
    x4, c4 = x[None], cos[None, :, None]
    assert torch.equal(rotary_fused(x4, c4, c4), ops.apply_rotary(x4, c4, c4))
    per_head = torch.randn(6, 2, 16, generator=g)
    assert torch.equal(rotary_fused(x, per_head, per_head), ops.apply_rotary(x, per_head, per_head))
    c_grad = cos[:, None].clone().requires_grad_()
    assert torch.equal(rotary_fused(x, c_grad, sin[:, None]), ops.apply_rotary(x, c_grad, sin[:, None]))
    assert ops.select("rotary", backend="cpu")[0] == ("fused" if native_kernels_available() is True else "native")
