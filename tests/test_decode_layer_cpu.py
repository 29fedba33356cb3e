"""A decode step's whole decoder layer in one call: the op's pure-torch implementation (portrl.ops.decode_layer) and
the CPU's one-region kernel (backends/cpu/decode_layer.cpp) against it in float64, for every instruction-set variant
this CPU runs, every row count of both tilings (dot tiles, lane tiles), a layer small enough to stay on one thread
and one that takes the parallel region (with one thread too); and the decoder using it."""

import pytest
import torch

from portrl.backends.cpu import isa, kernels, native_build
from portrl.backends.cpu.decode_layer import ROWS_MAX, decode_layer_fused
from portrl.ops.decode_layer import bind_layer, decode_layer
from portrl.rollout.fast_decode import fast_decoder_for

RUNNABLE = [v for v in isa.NEEDS if not isa.missing(v, isa.cpu_flags())]
variants = pytest.mark.parametrize("variant", RUNNABLE or [pytest.param(None, marks=pytest.mark.skip(
    reason="this CPU runs no variant of the native kernels (needs AVX2 + FMA)"))])

#: (hidden, heads, kv_heads, head_dim, intermediate): under the kernel's INLINE_FLOATS weights (one thread), over
SMALL, LARGE = (64, 4, 2, 16, 96), (256, 8, 2, 32, 768)


def _layer_inputs(rows, hidden, heads, kv, d, inter, start=20, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    angle = torch.rand(rows, d, generator=g) * 6
    sin = angle.sin()
    sin[:, : d // 2] *= -1
    hidden_keys = torch.rand(rows, start + 1, generator=g) < 0.3
    hidden_keys[:, start] = False
    return dict(x=torch.randn(rows, hidden, generator=g), ln1=1 + 0.1 * torch.randn(hidden, generator=g),
                qkv_w=[w(heads * d, hidden), w(kv * d, hidden), w(kv * d, hidden)],
                qkv_b=torch.randn((heads + 2 * kv) * d, generator=g) if bias else None, o_w=w(hidden, heads * d),
                o_b=None, ln2=1 + 0.1 * torch.randn(hidden, generator=g), gate_up_w=[w(inter, hidden), w(inter, hidden)],
                down_w=w(hidden, inter), k_store=torch.randn(rows, kv, d, start + 12, generator=g),
                v_cache=torch.randn(rows, kv, start + 3, d, generator=g), cos=angle.cos(), sin=sin,
                hidden=hidden_keys, start=start, eps1=1e-6, eps2=1e-5, scale=d ** -0.5, heads=heads, kv_heads=kv)


def _run(fn, inputs, dtype=torch.float32):
    """``fn`` on copies of the state it updates: (x, k_store, v_cache, qkv, o, gu, down)."""
    args = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else
                [t.to(dtype) for t in v] if isinstance(v, list) else v) for k, v in inputs.items()}
    args["x"], args["k_store"], args["v_cache"] = (args[k].clone() for k in ("x", "k_store", "v_cache"))
    outs = fn(**args)
    return (args["x"], args["k_store"], args["v_cache"], *outs)


def _fused(variant):
    """The native op itself (no fallback): its outputs allocated here."""
    assert native_build.try_load("decode_layer", variant)
    op = getattr(torch.ops, native_build.ops_namespace("decode_layer", variant)).layer

    def run(**a):
        x, heads, kv, d = a["x"], a["heads"], a["kv_heads"], a["k_store"].shape[2]
        outs = tuple(x.new_empty(x.shape[0], n) for n in ((heads + 2 * kv) * d, x.shape[1],
                                                          2 * a["down_w"].shape[1], x.shape[1]))
        op(*a.values(), *outs)
        return outs
    return run


@variants
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["one-thread", "parallel"])
@pytest.mark.parametrize("rows", [1, 5, 8, 11, 12, 16, 17, 32, 33, 64])
def test_fused_layer_equals_the_op_in_float64(rows, shape, variant):
    inputs = _layer_inputs(rows, *shape, bias=rows % 2 == 1)
    want = _run(decode_layer, inputs, torch.float64)
    for got, ref in zip(_run(_fused(variant), inputs), want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=2e-5)


@variants
def test_fused_layer_on_one_thread_equals_two(variant):
    inputs = _layer_inputs(32, *LARGE)
    two = _run(_fused(variant), inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _run(_fused(variant), inputs)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)  # items are split between threads, never a sum: the same bits


def test_native_layer_reads_only_the_keys_up_to_start():
    inputs = _layer_inputs(3, *SMALL)
    base = _run(decode_layer, inputs)
    inputs["k_store"][..., inputs["start"] + 1:] = float("nan")  # slots after the new token: never read
    inputs["v_cache"][:, :, inputs["start"] + 1:] = float("nan")
    for a, b in zip(_run(decode_layer, inputs)[3:], base[3:]):
        assert torch.equal(a, b)


@variants
def test_fused_layer_refuses_keys_not_stored_transposed(variant):
    inputs = _layer_inputs(4, *SMALL)
    inputs["k_store"] = inputs["k_store"].transpose(-1, -2).contiguous().transpose(-1, -2)  # unit stride along D
    with pytest.raises(RuntimeError, match="k_store must be"):
        _run(_fused(variant), inputs)


def test_a_strided_weight_takes_the_op():
    inputs = _layer_inputs(4, *SMALL)
    inputs["o_w"] = inputs["o_w"].t().contiguous().t()  # the same values, column-major
    for a, b in zip(_run(decode_layer_fused, inputs), _run(decode_layer, inputs)):
        assert torch.equal(a, b)


def test_more_rows_than_the_kernel_serves_take_the_op():
    assert ROWS_MAX == kernels.ROWS_MAX
    inputs = _layer_inputs(ROWS_MAX + 1, *SMALL)
    for a, b in zip(_run(decode_layer_fused, inputs), _run(decode_layer, inputs)):
        assert torch.equal(a, b)


WEIGHTS = ("ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gate_up_w", "down_w", "eps1", "eps2")


def _bound(op):
    """``op`` called through :func:`bind_layer` (one layer's weights bound once, then a step), as ``_run`` calls."""
    def run(**a):
        step = bind_layer(op, [a[k] for k in WEIGHTS], a["scale"], a["heads"], a["kv_heads"])
        return step(a["x"], a["k_store"], a["v_cache"], a["cos"], a["sin"], a["hidden"], a["start"])
    return run


@pytest.mark.parametrize("rows", [3, 32])
def test_a_bound_layer_equals_the_op_called_whole(rows):
    inputs = _layer_inputs(rows, *LARGE)
    for op in (decode_layer_fused, decode_layer):  # the CPU's own bind; the op's generic one
        for a, b in zip(_run(_bound(op), inputs), _run(op, inputs)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["rows", "strided weight", "gradients"])
def test_a_bound_layer_takes_the_op_where_the_kernel_does_not_serve(case):
    inputs = _layer_inputs(ROWS_MAX + 1 if case == "rows" else 4, *SMALL)
    if case == "strided weight":
        inputs["o_w"] = inputs["o_w"].t().contiguous().t()
    with torch.set_grad_enabled(case == "gradients"):
        if case == "gradients":
            inputs["ln2"].requires_grad_(True)
        got, want = _run(_bound(decode_layer_fused), inputs), _run(decode_layer, inputs)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if case == "gradients":
        assert got[-1].grad_fn is not None  # the op's autograd graph, which the kernel has none of


def _qwen2(hidden=64, layers=2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=80, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        eos_token_id=1, pad_token_id=0, initializer_range=0.2)).eval()


@pytest.mark.skipif(not RUNNABLE, reason="this CPU runs no variant of the native kernels (needs AVX2 + FMA)")
def test_decoder_steps_through_the_fused_layer_as_op_by_op():
    model = _qwen2()
    dec = fast_decoder_for(model, "cpu")
    calls = []

    def counted(step):
        return lambda *a, **k: calls.append(1) or step(*a, **k)
    ids = torch.randint(2, 80, (6, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(6, 9, dtype=torch.bool)
    logits = {}
    with torch.inference_mode():
        for fuse in (True, False):
            dec.start(6, 9, decode_rows=6, steps=3)
            # the CPU's bound layers (counted), or none: the op-by-op layer
            dec._fused = [counted(step) for step in dec._fused] if fuse else []
            dec.forward(ids, torch.arange(5).expand(6, 5), 0, mask[:, :5])
            steps = [dec.forward(ids[:, t:t + 1], torch.full((6, 1), 5 + t), 5 + t, mask[:, : 6 + t]) for t in range(3)]
            logits[fuse] = (torch.stack(steps), dec.k_cache.clone(), dec.v_cache.clone())
            dec.release()
    assert len(calls) == 3 * 2  # three steps of two layers
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decoder_with_more_rows_than_the_kernel_keeps_its_layer():
    dec = fast_decoder_for(_qwen2(), "cpu")
    with torch.inference_mode():
        dec.start(ROWS_MAX + 1, 8, decode_rows=ROWS_MAX + 1, steps=4)
    assert dec._fused == []


def test_a_run_choosing_the_native_layer_steps_op_by_op():
    from portrl.ops import registry

    registry.choose({"decode_layer": "native"})  # device.kernels.decode_layer=native
    try:
        dec = fast_decoder_for(_qwen2(), "cpu")
        with torch.inference_mode():
            dec.start(4, 8, decode_rows=4, steps=4)
        assert dec._layer_op is None and dec._fused == []
    finally:
        registry.choose({})
