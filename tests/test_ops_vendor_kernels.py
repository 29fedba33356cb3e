"""Vendor kernels' argument translation, checked on CPU.

Each vendor function is replaced by a checker with the documented signature (VENDOR_APIS.md) that
asserts what the wrapper passed (layouts, cu_seqlens -> actual_seq_qlen, mask polarity, explicit
scale, dtypes) and then computes the documented semantics with the native op, so the wrapper's
output must equal the native op's. Only the hardware confirms the kernels' own numerics.
"""

import importlib.machinery
import math
import sys
import types

import pytest
import torch

from portrl import ops
from portrl.backends.cuda import kernels as cuda_kernels
from portrl.backends.npu import kernels as npu_kernels
from portrl.backends.rocm import kernels as rocm_kernels

calls = []


def _fake_module(monkeypatch, name, **fns):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, fn in fns.items():
        setattr(mod, key, fn)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def _cu_from(cu_q, cu_k):
    assert cu_q.dtype == torch.int32 and cu_k is cu_q or torch.equal(cu_q, cu_k)
    return cu_q


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FA2 / ROCm flash-attn / aiter signature."""
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dim() == 3 and k.shape[1] <= q.shape[1]
    cu = _cu_from(cu_seqlens_q, cu_seqlens_k)
    assert isinstance(max_seqlen_q, int) and max_seqlen_q == int((cu[1:] - cu[:-1]).max()) == max_seqlen_k
    assert dropout_p == 0.0 and softmax_scale is not None
    calls.append("fa2")
    return ops.attention_varlen(q, k, v, cu, max_seqlen_q, softmax_scale, causal)


def flash_attn3_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """FA3 (flash_attn_interface): no dropout_p; returns (out, lse)."""
    cu = _cu_from(cu_seqlens_q, cu_seqlens_k)
    calls.append("fa3")
    out = ops.attention_varlen(q, k, v, cu, max_seqlen_q, softmax_scale, causal)
    return out, torch.zeros(q.shape[1], q.shape[0])


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False):
    """torch_npu signature; TND semantics: actual_seq_* are cumulative ends without the leading 0."""
    assert input_layout == "TND" and head_num == query.shape[1] and query.shape[1] % key.shape[1] == 0
    assert isinstance(actual_seq_qlen, list) and all(type(x) is int for x in actual_seq_qlen)
    assert actual_seq_qlen == actual_seq_kvlen and actual_seq_qlen[-1] == query.shape[0]
    assert keep_prob == 1.0 and pse is None and padding_mask is None
    if sparse_mode == 3:
        assert atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
        assert atten_mask[0, 1] and not atten_mask[1, 0] and not atten_mask[5, 5]  # True = masked out
        causal = True
    else:
        assert sparse_mode == 0 and atten_mask is None
        causal = False
    cu = torch.tensor([0, *actual_seq_qlen], dtype=torch.int32)
    calls.append("npu_fa")
    out = ops.attention_varlen(query, key, value, cu, None, scale, causal)  # scale is used as given
    return out, torch.empty(0), torch.empty(0), torch.empty(0), 0, 0, 0


def npu_rms_norm(x, gamma, epsilon=1e-6):
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    calls.append("npu_rms_norm")
    return gamma * (x.float() * rstd).to(x.dtype), rstd


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    assert x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4 and rotary_mode == "half"
    calls.append("npu_rotary_mul")
    half = x.shape[-1] // 2
    return x * r1 + torch.cat((-x[..., half:], x[..., :half]), -1) * r2


def npu_swiglu(x, dim=-1):
    a, b = x.chunk(2, dim=dim)
    calls.append("npu_swiglu")
    return torch.nn.functional.silu(a) * b


@pytest.fixture(autouse=True)
def _clear_calls():
    calls.clear()


def _packed(dtype=torch.bfloat16, hq=4, hkv=2, d=16, lengths=(5, 1, 9)):
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v, ops.cu_seqlens_from_lengths(list(lengths)).to(torch.int64)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fn,module,attr,checker,tag", [
    (cuda_kernels.flash_attn_varlen, "flash_attn", "flash_attn_varlen_func", flash_attn_varlen_func, "fa2"),
    (cuda_kernels.flash_attn3_varlen, "flash_attn_interface", "flash_attn_varlen_func", flash_attn3_varlen_func, "fa3"),
    (rocm_kernels.aiter_varlen, "aiter", "flash_attn_varlen_func", flash_attn_varlen_func, "fa2"),
    (npu_kernels.npu_fusion_attention_varlen, "torch_npu", "npu_fusion_attention", npu_fusion_attention, "npu_fa"),
])
def test_vendor_attention_translation(monkeypatch, fn, module, attr, checker, tag, causal):
    _fake_module(monkeypatch, module, **{attr: checker})
    q, k, v, cu = _packed()
    out = fn(q, k, v, cu, None, None, causal)
    assert calls == [tag]
    want = ops.attention_varlen(q, k, v, cu, None, 1 / math.sqrt(q.shape[-1]), causal)
    assert out.shape == q.shape and torch.equal(out, want)


def test_flash_attention_float32_takes_sdpa_path(monkeypatch):
    _fake_module(monkeypatch, "flash_attn", flash_attn_varlen_func=flash_attn_varlen_func)
    q, k, v, cu = _packed(torch.float32)
    out = cuda_kernels.flash_attn_varlen(q, k, v, cu)
    assert calls == [] and (out - ops.attention_varlen(q, k, v, cu)).abs().max() <= 1e-5


def test_missing_vendor_package_names_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    q, k, v, cu = _packed()
    with pytest.raises(ImportError, match="pip install \"flash-attn==2.8.3\""):
        cuda_kernels.flash_attn_varlen(q, k, v, cu)


def test_npu_layer_ops_translation(monkeypatch):
    _fake_module(monkeypatch, "torch_npu", npu_rms_norm=npu_rms_norm, npu_rotary_mul=npu_rotary_mul,
                 npu_swiglu=npu_swiglu)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 3, 8, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(npu_kernels.npu_rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
    xr, cos, sin = torch.randn(3, 5, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    torch.testing.assert_close(npu_kernels.npu_rotary(xr, cos, sin), ops.apply_rotary(xr, cos, sin))
    gate, up = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    torch.testing.assert_close(npu_kernels.npu_swiglu(gate, up), ops.swiglu(gate, up))
    assert calls == ["npu_rms_norm", "npu_rotary_mul", "npu_swiglu"]


def test_backend_selection_follows_preferences_and_availability(monkeypatch):
    # cuda here: no flash-attention installed -> sdpa; triton runs under its interpreter -> triton for the
    # fused ops; without the interpreter this host has no GPU driver for triton -> native
    assert ops.select("attention_varlen", backend="cuda")[0] == "sdpa"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.select("logprobs_entropy", backend="cuda")[0] == "triton"
    assert ops.select("rms_norm", backend="rocm")[0] == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert ops.select("logprobs_entropy", backend="cuda")[0] == "native"
    with pytest.raises(ops.OpError, match="no GPU driver"):
        ops.select("rms_norm", impl="triton", backend="rocm")
    with pytest.raises(ops.OpError, match=r'flash_attn is not installed \(pip install "flash-attn==2.8.3"'):
        ops.select("attention_varlen", impl="flash_attn", backend="cuda")
    _fake_module(monkeypatch, "flash_attn", flash_attn_varlen_func=flash_attn_varlen_func)
    assert ops.select("attention_varlen", backend="cuda")[0] == "flash_attn"
    _fake_module(monkeypatch, "torch_npu", npu_fusion_attention=npu_fusion_attention)
    assert ops.select("attention_varlen", backend="npu") == ("npu_fusion", npu_kernels.npu_fusion_attention_varlen)
    assert ops.select("swiglu", backend="npu")[0] == "npu_swiglu"
