"""Native ops against independent float64 references, and the ops registry."""

import logging
import math

import pytest
import torch

from portrl import ops
from portrl.ops.logprobs import logprobs_entropy_full


def _packed(lengths, hq=4, hkv=2, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, hq, d, generator=g, dtype=dtype)
    k = torch.randn(total, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(total, hkv, d, generator=g, dtype=dtype)
    return q, k, v, ops.cu_seqlens_from_lengths(lengths)


def _dense_reference(q, k, v, lengths, causal=True):
    """Float64, one sequence at a time, written out with explicit loops over heads."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    start = 0
    for n in lengths:
        for h in range(q.shape[1]):
            qi, ki, vi = (t[start:start + n, hh].double() for t, hh in ((q, h), (k, h // rep), (v, h // rep)))
            s = qi @ ki.T / math.sqrt(q.shape[-1])
            if causal:
                s = s + torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
            out[start:start + n, h] = torch.softmax(s, -1) @ vi
        start += n
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_attention_varlen_matches_dense_reference(causal):
    lengths = [5, 1, 9, 3]
    q, k, v, cu = _packed(lengths)
    out = ops.attention_varlen(q, k, v, cu, max(lengths), causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, lengths, causal), atol=1e-5, rtol=1e-5)


def test_attention_varlen_no_leak_across_sequences_and_causal():
    q, k, v, cu = _packed([4, 6])
    out = ops.attention_varlen(q, k, v, cu, 6)
    k2, v2 = k.clone(), v.clone()
    k2[4:] += 3.0  # change every key/value of the second sequence
    v2[4:] -= 2.0
    k2[7:] += 1.0
    assert torch.equal(ops.attention_varlen(q, k2, v2, cu, 6)[:4], out[:4])
    k3 = k.clone()
    k3[9] += 5.0  # the last token must not change earlier outputs of its own sequence
    assert torch.equal(ops.attention_varlen(q, k3, v, cu, 6)[:9], out[:9])


def test_attention_varlen_input_errors():
    q, k, v, cu = _packed([3, 4])
    with pytest.raises(ValueError, match="end at total_tokens=7"):
        ops.attention_varlen(q, k, v, torch.tensor([0, 3, 6]), 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ops.attention_varlen(q[:, :3], k, v, cu, 4)
    with pytest.raises(ValueError, match="integer"):
        ops.attention_varlen(q, k, v, cu.float(), 4)


def test_cu_seqlens_from_position_ids():
    cu, mx = ops.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu.tolist() == [0, 3, 5, 9] and mx == 4 and cu.dtype == torch.int32


def _lp_case(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = (0.5 * torch.randn(37, 16, generator=g, dtype=dtype)).requires_grad_()
    w = (0.5 * torch.randn(50, 16, generator=g, dtype=dtype)).requires_grad_()
    b = torch.randn(50, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=g)
    gl, ge = torch.randn(37, generator=g, dtype=dtype), torch.randn(37, generator=g, dtype=dtype)
    return h, w, b, y, gl, ge


def _lp_and_grads(fn, h, w, b, y, gl, ge, temperature, **kw):
    lp, ent = fn(h, w, y, temperature, b, **kw)
    return (lp, ent, *torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), (h, w, b)))


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_logprobs_entropy_chunked_matches_full_logits(chunk, temperature, dtype, atol):
    case = _lp_case(dtype)
    got = _lp_and_grads(ops.logprobs_entropy, *case, temperature, chunk_size=chunk)
    want = _lp_and_grads(logprobs_entropy_full, *case, temperature)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.mark.parametrize("use", ["logp", "entropy"])
def test_logprobs_entropy_one_output_in_the_loss(use):
    """An output the loss does not use reaches backward as None (its terms skipped): same gradients."""
    h, w, b, y, gl, ge = _lp_case(torch.float64)
    grads = []
    for fn in (ops.logprobs_entropy, logprobs_entropy_full):
        lp, ent = fn(h, w, y, 0.7, b)
        loss = (lp * gl).sum() if use == "logp" else (ent * ge).sum()
        grads.append(torch.autograd.grad(loss, (h, w, b)))
    for a, want in zip(*grads):
        torch.testing.assert_close(a, want, atol=1e-10, rtol=0)


def test_logprobs_entropy_gradcheck_and_frozen_head():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (9,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: ops.logprobs_entropy(h, w, y, 1.3, None, 4), (h, w))
    frozen = w.detach()
    lp, ent = ops.logprobs_entropy(h, frozen, y, chunk_size=4)
    (gh,) = torch.autograd.grad(lp.sum() + ent.sum(), (h,))
    assert gh.shape == h.shape and frozen.grad is None


def test_logprobs_entropy_entropy_is_entropy():
    h, w = torch.zeros(2, 4), torch.randn(8, 4)
    lp, ent = ops.logprobs_entropy(h, w, torch.tensor([0, 5]))
    torch.testing.assert_close(ent, torch.full((2,), math.log(8)))
    torch.testing.assert_close(lp, torch.full((2,), -math.log(8)))


def test_logprobs_entropy_input_errors():
    h, w = torch.randn(3, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 8\)"):
        ops.logprobs_entropy(h, w, torch.tensor([0, 8, 1]))
    with pytest.raises(ValueError, match="temperature"):
        ops.logprobs_entropy(h, w, torch.tensor([0, 1, 1]), temperature=0.0)
    with pytest.raises(ValueError, match=r"weight \(V, H\)"):
        ops.logprobs_entropy(h, torch.randn(8, 5), torch.tensor([0, 1, 1]))


def test_rms_norm_rotary_swiglu():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 5, 16, generator=g), torch.randn(16, generator=g)
    want = w.double() * x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6).double(), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.rms_norm(x, torch.ones(8))

    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    ang = torch.randn(2, 5, 4, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(ops.apply_rotary(q, cos[:, None], sin[:, None]), hq)
    torch.testing.assert_close(ops.apply_rotary(k, cos[:, None], sin[:, None]), hk)

    gate, up = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    torch.testing.assert_close(ops.swiglu(gate, up), gate / (1 + torch.exp(-gate)) * up)


def test_registry_selects_backend_preference_and_native(caplog):
    with caplog.at_level(logging.INFO, logger="portrl.ops.registry"):
        name, fn = ops.select("attention_varlen", backend="cpu")
        ops.select("attention_varlen", backend="cpu")
    assert name == "sdpa"
    assert sum("attention_varlen -> sdpa" in r.getMessage() for r in caplog.records) <= 1
    # an op the CPU has no kernel for
    assert ops.select("rotary_multimodal", backend="cpu") == ("native", ops.apply_multimodal_rotary)
    assert ops.select("attention_varlen", impl="eager", backend="cpu")[0] == "eager"
    assert {"native", "sdpa", "eager"} <= set(ops.runnable("attention_varlen"))


def test_registry_errors_list_what_can_run():
    op = "rotary_multimodal"  # an op the CPU has no kernel for
    ops.register(op, "test_unavailable", ops.apply_multimodal_rotary, available=lambda: "needs the test-only package")
    try:
        assert ops.implementations(op)["test_unavailable"] == "needs the test-only package"
        with pytest.raises(ops.OpError, match=r"needs the test-only package.*that can: native"):
            ops.select(op, impl="test_unavailable", backend="cpu")
        assert ops.select(op, backend="cpu")[0] == "native"
    finally:
        ops.unregister(op, "test_unavailable")
    with pytest.raises(ops.OpError, match="not registered.*that can:.*sdpa"):
        ops.select("attention_varlen", impl="nope", backend="cpu")
    with pytest.raises(ops.OpError, match="valid ops: attention_varlen"):
        ops.select("softmax")
