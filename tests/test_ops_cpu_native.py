"""The CPU's native kernels: the decode linear on the weights as they are (backends/cpu/rows_linear.cpp), the fused
SwiGLU (swiglu.cpp) and RMSNorm (rms_norm.cpp), and their build (native_build.py). The kernel tests run for every
instruction-set variant this CPU runs (an AVX-512 host runs both the AVX-512 and the AVX2 + FMA build; the choice
between them: test_cpu_isa.py)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from portrl import ops
from portrl.backends.cpu import isa, kernels, native_build
from portrl.backends.cpu.kernels import ROWS_MAX, linear_prepacked_rows, native_kernels_available
from portrl.backends.cpu.rms_norm import rms_norm_fused
from portrl.backends.cpu.swiglu import swiglu_fused

needs_rows = pytest.mark.skipif(native_kernels_available() is not True,
                                  reason=f"row-tile linear unavailable: {native_kernels_available()}")
#: the variants this CPU runs, each a test parameter (none: the tests are skipped, with the reason)
RUNNABLE = [v for v in isa.NEEDS if not isa.missing(v, isa.cpu_flags())]
variants = pytest.mark.parametrize("variant", RUNNABLE or [pytest.param(None, marks=pytest.mark.skip(
    reason="this CPU runs no variant of the native kernels (needs AVX2 + FMA)"))])


@variants
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("parts,in_features", [([100], 72), ([16], 37), ([3], 5), ([160], 300), ([7, 2, 2], 48),
                                               ([64, 64], 896), ([5, 4], 13)])
def test_rows_linear_equals_linear_for_every_row_count(bias, parts, in_features, variant):
    """Every row count up to ROWS_MAX (tiles and row blocks cut short, odd widths and a masked last k chunk of
    either variant's 16 or 8 lanes, widths below one chunk, weights given as parts of a fused one), 3-D inputs,
    zero rows, and more rows than the kernel serves (the plain matmul) equal F.linear on the concatenated weight."""
    g = torch.Generator().manual_seed(sum(parts) + in_features)
    ws = [torch.randn(n, in_features, generator=g) for n in parts]
    out_features = sum(parts)
    b = torch.randn(out_features, generator=g) if bias else None
    fn = linear_prepacked_rows(ws if len(ws) > 1 else ws[0], b, rows=ROWS_MAX, variant=variant)
    shapes = [(m, in_features) for m in range(ROWS_MAX + 1)]
    shapes += [(2, 5, in_features), (4, 1, in_features), (ROWS_MAX + 9, in_features)]
    whole = torch.cat(ws).double()
    for shape in shapes:
        x = torch.randn(*shape, generator=g)
        out = fn(x)
        assert out.shape == (*shape[:-1], out_features)
        # float32 sums: |error| grows with in_features (~3e-5 at 300 terms of ~17), as MKL's own does
        want = F.linear(x.double(), whole, b.double() if bias else None).float()
        torch.testing.assert_close(out, want, atol=2e-6 * in_features, rtol=1e-5)


@pytest.mark.skipif("avx512" not in RUNNABLE, reason="the lane tiles are AVX-512 only; this CPU lacks it")
@pytest.mark.parametrize("parts,in_features", [([100], 72), ([7, 2, 2], 48), ([5, 4], 13), ([33], 5), ([20], 300)])
def test_both_tilings_of_the_avx512_build_equal_linear_at_every_row_count(parts, in_features):
    """rows_linear.cpp's lane tiles (input rows across the lanes; 1-4 vectors of rows, a 16 x 16 block transposed
    in registers or a partial one stored through memory, k unrolled by 8 with a remainder) and dot tiles, each forced
    at every row count (``lane_rows_from``), equal F.linear; the default switches at LANE_ROWS_FROM."""
    assert native_build.try_load("rows_linear", "avx512")
    op = kernels.rows_op("avx512")
    g = torch.Generator().manual_seed(sum(parts) * in_features)
    ws = [torch.randn(n, in_features, generator=g) for n in parts]
    b = torch.randn(sum(parts), generator=g)
    for m in range(ROWS_MAX + 1):
        x = torch.randn(m, in_features, generator=g)
        want = F.linear(x.double(), torch.cat(ws).double(), b.double()).float()
        for lane_rows_from in (1, 1 << 30, -1):
            torch.testing.assert_close(op(x, ws, b, lane_rows_from), want, atol=2e-6 * in_features, rtol=1e-5)


@variants
def test_rows_linear_reads_the_weights_at_call_time_and_checks_shapes(variant):
    """No copy: an in-place change of a weight shows in the next call. Mismatched shapes are errors."""
    w = torch.randn(40, 24)
    fn = linear_prepacked_rows(w, None, rows=4, variant=variant)
    x = torch.randn(4, 24)
    before = fn(x)
    w.mul_(2.0)
    torch.testing.assert_close(fn(x), 2 * before)
    rows_linear = kernels.rows_op(variant)
    with pytest.raises(RuntimeError, match="every weight must be"):
        rows_linear(torch.randn(4, 23), [w], None)
    with pytest.raises(RuntimeError, match="bias must have"):
        rows_linear(x, [w, w], torch.randn(40))
    with pytest.raises(ValueError, match="one in_features"):
        linear_prepacked_rows([w, torch.randn(8, 23)], None, rows=4)


@needs_rows
def test_more_decode_rows_or_other_dtypes_take_mkl_or_plain_linear(monkeypatch):
    taken = []
    monkeypatch.setattr(kernels, "linear_prepacked_mkl", lambda w, b, rows: taken.append(rows) or (lambda x: x))
    linear_prepacked_rows(torch.randn(8, 8), None, rows=ROWS_MAX + 1)
    linear_prepacked_rows(torch.randn(8, 8, dtype=torch.float64), None, rows=4)
    linear_prepacked_rows(torch.randn(8, 8), None, rows=None)
    assert taken == [ROWS_MAX + 1, 4, None]


@pytest.mark.parametrize("fn", [kernels.linear_prepacked_mkl, ops.linear_prepacked], ids=["mkl", "native"])
def test_every_linear_prepacked_takes_the_parts_of_a_fused_weight(fn):
    """The contract for every implementation: parts stand for their concatenation along out features."""
    g = torch.Generator().manual_seed(3)
    ws, b, x = [torch.randn(12, 16, generator=g), torch.randn(4, 16, generator=g)], torch.randn(16), torch.randn(5, 16)
    torch.testing.assert_close(fn(ws, b, 5)(x), F.linear(x, torch.cat(ws), b), atol=1e-5, rtol=1e-5)


def test_cpu_backend_prefers_the_row_tile_linear_where_it_can_run():
    impl, _ = ops.select("linear_prepacked", backend="cpu")
    if native_kernels_available() is True:
        assert impl == "rows"
    else:
        assert impl in ("mkl", "native")
    assert ops.select("linear_prepacked", backend="cuda")[0] == "native"


def test_a_failed_build_leaves_nothing_and_the_linear_falls_back_to_mkl(tmp_path, monkeypatch):
    """A compiler that fails: KernelBuildError naming the source, no library (nor temporary file) in the cache,
    and the decode linear warns once and serves MKL's packed linear."""
    monkeypatch.setenv("PORTRL_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always exits 1
    assert native_build.compiler().endswith("false")
    target = native_build.library_path("rows_linear")
    with pytest.raises(native_build.KernelBuildError, match="rows_linear.cpp failed"):
        native_build._build(native_build.compiler(), native_build.SOURCE_DIR / "rows_linear.cpp", target)
    assert target.parent == tmp_path / "kernels" and list(tmp_path.rglob("*")) == [target.parent]

    def failing_load(name, variant=None):
        raise native_build.KernelBuildError("no C++ compiler found (install g++ or set CXX)")

    monkeypatch.setattr(native_build, "load", failing_load)
    monkeypatch.setattr(native_build, "_failed", {})
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    native_build.log.addHandler(handler)  # on the module's logger itself: an earlier test may stop propagation
    try:
        w, x = torch.randn(24, 8), torch.randn(4, 8)
        for _ in range(2):
            fn = linear_prepacked_rows(w, None, rows=4)
            torch.testing.assert_close(fn(x), F.linear(x, w))
    finally:
        native_build.log.removeHandler(handler)
    warnings = [m for m in seen if "rows_linear.cpp" in m and "are off" in m]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]


def test_the_library_cache_key_follows_source_torch_and_cpu(monkeypatch, tmp_path):
    monkeypatch.delenv("PORTRL_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path))
    first = native_build.library_path("rows_linear")
    assert first.parent == tmp_path / "kernels" and first.name.startswith("rows_linear-")
    monkeypatch.setenv("PORTRL_KERNEL_CACHE", str(tmp_path / "elsewhere"))
    assert native_build.library_path("rows_linear") == tmp_path / "elsewhere" / first.name
    monkeypatch.setattr(native_build, "_cpu_identity", lambda: "model name: another CPU")
    assert native_build.library_path("rows_linear") != first
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert native_build.library_path("rows_linear") != first
    avx2, avx512 = native_build.library_path("rows_linear", "avx2"), native_build.library_path("rows_linear", "avx512")
    assert avx2.name.startswith("rows_linear-avx2-") and avx512.name.startswith("rows_linear-avx512-")


def test_each_variant_has_its_own_flags_and_the_avx2_one_is_not_native():
    """The AVX2 build runs on any AVX2 + FMA CPU (so an AVX-512 host tests it): no -march=native, no AVX-512."""
    avx2 = native_build.flags("avx2")
    assert {"-mavx2", "-mfma", "-DPORTRL_ISA=avx2", "-DCPU_CAPABILITY_AVX2"} <= set(avx2)
    assert not any("native" in f or "512" in f for f in avx2)
    assert {"-DPORTRL_ISA=avx512", "-DCPU_CAPABILITY_AVX512"} <= set(native_build.flags("avx512"))
    assert native_build.ops_namespace("rows_linear", "avx2") == "portrl_cpu_rows_avx2"


def test_no_compiler_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-portrl")
    assert native_build.compiler() is None
    why = native_kernels_available()
    assert why is not True and isinstance(why, str)
    with pytest.raises(native_build.KernelBuildError, match="no C\\+\\+ compiler"):
        native_build.load("a_source_never_loaded")


@variants
@pytest.mark.parametrize("shape", [(7, 37), (2, 3, 64), (300, 48), (1, 1, 17), (3, 5)])
def test_fused_swiglu_equals_silu_times_up_with_gradients(shape, variant):
    """Values and both gradients against torch's silu(gate) * up, for widths with and without a vector tail."""
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    gate = (torch.randn(*shape, generator=g) * 4).requires_grad_()
    up = torch.randn(*shape, generator=g).requires_grad_()
    grad = torch.randn(*shape, generator=g)
    got = swiglu_fused(gate, up, variant=variant)
    want = F.silu(gate) * up
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(got, (gate, up), grad), torch.autograd.grad(want, (gate, up), grad)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@variants
def test_fused_swiglu_without_gradients_runs_the_op_alone(variant):
    """Inference (a decode step) and tensors that need no gradient: the same values, no autograd node."""
    gate, up = torch.randn(16, 2, 4864 * 2, generator=torch.Generator().manual_seed(3)).chunk(2, dim=-1)
    with torch.inference_mode():
        got = swiglu_fused(gate, up, variant=variant)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    assert got.grad_fn is None and swiglu_fused(gate, up, variant=variant).grad_fn is None


@variants
def test_fused_swiglu_takes_the_halves_of_a_fused_projection_and_other_dtypes_go_native(variant):
    gu = torch.randn(4, 2, 96, requires_grad=True)
    gate, up = gu.chunk(2, dim=-1)  # views with a row stride of 96
    out = swiglu_fused(gate, up, variant=variant)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad(out.sum(), gu)
    (want,) = torch.autograd.grad((F.silu(gate) * up).sum(), gu)
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-6)
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(swiglu_fused(x, x), F.silu(x) * x)
    assert ops.select("swiglu", backend="cpu")[0] == ("fused" if native_kernels_available() is True else "native")


@variants
@pytest.mark.parametrize("shape", [(7, 37), (2, 3, 64), (300, 48), (1, 1, 17), (1140, 512)])
def test_fused_rms_norm_equals_the_native_op_with_gradients(shape, variant):
    """Values and both gradients against portrl.ops' rms_norm (transformers' formula), widths with and without a
    vector tail, and the same bits on a second run (the weight's gradient sums each thread's rows in thread order)."""
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).requires_grad_()
    w = torch.randn(shape[-1], generator=g).requires_grad_()
    grad = torch.randn(*shape, generator=g)
    got = rms_norm_fused(x, w, 1e-5, variant=variant)
    want = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got, (x, w), grad)
    for a, b in zip(grads, torch.autograd.grad(want, (x, w), grad)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    again = torch.autograd.grad(rms_norm_fused(x, w, 1e-5, variant=variant), (x, w), grad)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@variants
def test_fused_rms_norm_takes_row_strided_views_runs_alone_without_gradients_and_other_dtypes_go_native(variant):
    wide = torch.randn(5, 2, 96, generator=torch.Generator().manual_seed(4), requires_grad=True)
    x = wide[..., :40]  # rows 96 floats apart
    w = torch.rand(40) + 0.5
    out = rms_norm_fused(x, w, 1e-6, variant=variant)
    torch.testing.assert_close(out, ops.rms_norm(x, w, 1e-6), atol=1e-6, rtol=1e-5)
    (grad,) = torch.autograd.grad(out.square().sum(), wide)
    (want,) = torch.autograd.grad(ops.rms_norm(x, w, 1e-6).square().sum(), wide)
    torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        alone = rms_norm_fused(x, w, 1e-6, variant=variant)
    assert alone.grad_fn is None and torch.equal(alone, out.detach())
    x64, w64 = torch.randn(3, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    assert torch.equal(rms_norm_fused(x64, w64), ops.rms_norm(x64, w64))
    assert ops.select("rms_norm", backend="cpu")[0] == ("fused" if native_kernels_available() is True else "native")
