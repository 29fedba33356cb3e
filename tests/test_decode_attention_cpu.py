"""The decode step's attention: the op's pure-torch implementation (portrl.ops.attention.decode_attention) against
a float64 softmax written out, and the CPU's fused kernel (backends/cpu/decode_attention.cpp) against it, for every
instruction-set variant this CPU runs and every shape a decoder gives it (grouped-query attention, head dims that
are not a multiple of the vector width, one key, cache views, hidden keys)."""

import pytest
import torch

from portrl import ops
from portrl.backends.cpu import isa
from portrl.backends.cpu.decode_attention import decode_attention_fused

RUNNABLE = [v for v in isa.NEEDS if not isa.missing(v, isa.cpu_flags())]
variants = pytest.mark.parametrize("variant", RUNNABLE or [pytest.param(None, marks=pytest.mark.skip(
    reason="this CPU runs no variant of the native kernels (needs AVX2 + FMA)"))])


def _inputs(B, H, KV, D, L, spare=5, seed=0, keys_transposed=False):
    """A decode step's inputs, as the decoder passes them: views of a longer cache (``keys_transposed``: the keys
    stored (D, L) per row and KV head, as the decoder's CPU cache) and a strided view of the fused q/k projection."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, B, KV, L + spare, D, generator=g)
    k, v = cache[0, :, :, :L], cache[1, :, :, :L]
    if keys_transposed:
        k = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    q = torch.randn(B, 1, H + KV, D, generator=g)[:, :, :H].transpose(1, 2)
    hidden = torch.rand(B, L, generator=g) < 0.3
    hidden[:, -1] = False  # the new token sees itself
    return q, k, v, hidden


def _written_out(q, k, v, hidden, scale):
    """softmax(scale q k^T) v per query head, its KV head repeated, in float64."""
    B, H, _, D = q.shape
    rep = H // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    scores = (q.double() @ k64.transpose(-1, -2)) * scale  # (B, H, 1, L)
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v64


SHAPES = [(3, 4, 2, 16, 9), (2, 14, 2, 64, 37), (4, 8, 8, 32, 5), (1, 6, 1, 80, 20), (2, 4, 2, 12, 1), (5, 2, 2, 8, 70)]


@pytest.mark.parametrize("shape", SHAPES)
def test_native_decode_attention_is_softmax_attention_per_kv_group(shape):
    q, k, v, hidden = _inputs(*shape)
    scale = shape[3] ** -0.5
    out = ops.decode_attention(q, k, v, hidden, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), _written_out(q, k, v, hidden, scale), rtol=1e-5, atol=1e-6)


@variants
@pytest.mark.parametrize("keys_transposed", [False, True], ids=["keys-as-rows", "keys-transposed"])
@pytest.mark.parametrize("shape", SHAPES + [(2, 4, 2, 16, 64), (1, 2, 1, 64, 83)])  # whole 4-vector key blocks, tails
def test_fused_decode_attention_equals_the_native_op(shape, keys_transposed, variant):
    q, k, v, hidden = _inputs(*shape, seed=1, keys_transposed=keys_transposed)
    scale = shape[3] ** -0.5
    out = decode_attention_fused(q, k, v, hidden, scale, variant=variant)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ops.decode_attention(q, k, v, hidden, scale), rtol=1e-5, atol=2e-6)
    B, H, _, D = q.shape  # laid out (B, 1, H, D): the decoder's reshape to (B, 1, H * D) is a view
    assert out.transpose(1, 2).reshape(B, 1, H * D).data_ptr() == out.data_ptr()


@variants
@pytest.mark.parametrize("keys_transposed", [False, True], ids=["keys-as-rows", "keys-transposed"])
def test_a_row_with_every_key_hidden_is_nan_as_in_torch(keys_transposed, variant):
    q, k, v, hidden = _inputs(3, 4, 2, 16, 6, keys_transposed=keys_transposed)
    hidden[1] = True
    out = decode_attention_fused(q, k, v, hidden, 0.25, variant=variant)
    native = ops.decode_attention(q, k, v, hidden, 0.25)
    assert out[1].isnan().all() and native[1].isnan().all()
    torch.testing.assert_close(out[[0, 2]], native[[0, 2]])


@variants
def test_other_dtypes_and_gradients_take_the_native_op(variant, monkeypatch):
    from portrl.backends.cpu import decode_attention as module

    calls = []
    monkeypatch.setattr(module, "native_decode_attention", lambda *a: calls.append(a[0].dtype) or a[0])
    q, k, v, hidden = _inputs(2, 4, 2, 16, 5)
    decode_attention_fused(q.bfloat16(), k.bfloat16(), v.bfloat16(), hidden, 0.25, variant=variant)
    decode_attention_fused(q.clone().requires_grad_(), k, v, hidden, 0.25, variant=variant)
    assert calls == [torch.bfloat16, torch.float32]


def test_bad_shapes_are_named():
    q, k, v, hidden = _inputs(2, 6, 4, 16, 5)  # 6 query heads on 4 KV heads
    with pytest.raises(ValueError, match="H a multiple of KV"):
        ops.decode_attention(q, k, v, hidden, 0.25)


def test_the_cpu_backend_selects_the_fused_kernel_where_it_runs():
    selected, _ = ops.select("decode_attention", backend="cpu")
    assert selected == ("fused" if RUNNABLE and isa.chosen().variant else "native")
