"""The decode kernel a backend gives the fast decoder (portrl/device/decode_kernel.py): the plain-torch default every
backend gets and the CPU's (backends/cpu/decode_kernel.py) store the same keys and values, each in its own layout,
and the decoder samples the same tokens through either as through the generic loop."""

from __future__ import annotations

import pytest
import torch

from portrl.backends.cpu import CPUBackend
from portrl.backends.cpu.decode_kernel import KEY_ALIGN, CPUDecodeKernel
from portrl.device.backend import Backend
from portrl.device.decode_kernel import DecodeKernel
from portrl.ops.decode_layer import decode_layer
from portrl.rollout import SamplingParams, make_engine
from portrl.rollout.fast_decode import fast_decoder_for
from portrl.rollout.hf_engine import HFEngine


class PlainCPU(CPUBackend):
    """The CPU backend's ops with the default decode kernel: what a backend that provides none gets."""

    def decode_kernel(self) -> DecodeKernel:
        return DecodeKernel()


def _qwen2(vocab=48, hidden=32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, eos_token_id=1, pad_token_id=0,
                                        initializer_range=0.2)).eval()


def test_a_backend_without_its_own_gets_the_plain_kernel_and_the_cpu_its_own():
    assert type(Backend.decode_kernel(CPUBackend())) is DecodeKernel  # the base class's answer
    assert isinstance(CPUBackend().decode_kernel(), CPUDecodeKernel)
    assert not DecodeKernel.step_attention and not DecodeKernel.own_norm
    assert CPUDecodeKernel.step_attention and CPUDecodeKernel.own_norm


@pytest.mark.parametrize("kernel", [DecodeKernel(), CPUDecodeKernel()], ids=["plain", "cpu"])
def test_writes_and_row_selections_read_back_the_same_in_either_layout(kernel):
    layers, rows, kv, slots, d = 2, 3, 2, 21, 8
    cache = kernel.allocate(layers, rows, kv, slots, d, torch.float32, torch.device("cpu"))
    want = torch.zeros(layers, rows, kv, slots, d), torch.zeros(layers, rows, kv, slots, d)
    g = torch.Generator().manual_seed(0)
    for layer, start, tokens in ((0, 0, 5), (1, 0, 5), (0, 5, 1), (1, 20, 1)):
        k, v = torch.randn(2, rows, kv, tokens, d, generator=g)
        kernel.write(cache, layer, start, k, v)
        want[0][layer, :, :, start:start + tokens], want[1][layer, :, :, start:start + tokens] = k, v
    index = torch.tensor([2, 0, 0])
    cache = kernel.select_rows(cache, index)
    assert torch.equal(cache.keys, want[0][:, index]) and torch.equal(cache.values, want[1][:, index])
    # key_store is the decode_layer op's view of the same keys: (layers, rows, kv_heads, head_dim, slots or more)
    assert torch.equal(cache.key_store[..., :slots], cache.keys.transpose(-1, -2))
    cache.key_store[0, 0, 0, 0, 0] = 7.0
    assert cache.keys[0, 0, 0, 0, 0] == 7.0


def test_the_cpu_kernel_stores_the_keys_transposed_and_padded():
    cache = CPUDecodeKernel().allocate(2, 3, 2, 21, 8, torch.float32, torch.device("cpu"))
    assert cache.key_store.is_contiguous() and cache.key_store.shape == (2, 3, 2, 8, 2 * KEY_ALIGN)
    assert cache.keys.shape == cache.values.shape == (2, 3, 2, 21, 8) and cache.values.is_contiguous()
    assert DecodeKernel().allocate(2, 3, 2, 21, 8, torch.float32, torch.device("cpu")).keys.is_contiguous()


def test_the_cpu_kernel_binds_the_layer_op_only_where_it_serves():
    kernel, default = CPUDecodeKernel(), DecodeKernel()
    weights = [[torch.ones(4)] * 10]

    def op(*args, **kwargs):
        return decode_layer(*args, **kwargs)
    op.max_rows = 8  # type: ignore[attr-defined]
    f32 = kernel.allocate(1, 8, 1, 4, 4, torch.float32, torch.device("cpu"))
    bf16 = kernel.allocate(1, 8, 1, 4, 4, torch.bfloat16, torch.device("cpu"))
    assert len(kernel.bind(op, weights, 1.0, 1, 1, 8, f32)) == 1
    assert kernel.head(op, torch.ones(4), 1e-6, torch.ones(3, 4), None, 8, f32) is None  # op has no bind_head
    for args in ((op, 9, f32), (op, 8, bf16), (None, 8, f32)):  # too many rows; not float32; the native op chosen
        assert kernel.bind(args[0], weights, 1.0, 1, 1, args[1], args[2]) == []
    assert default.bind(op, weights, 1.0, 1, 1, 8, f32) == []
    assert default.head(op, torch.ones(4), 1e-6, torch.ones(3, 4), None, 8, f32) is None


def test_the_decoder_samples_the_same_tokens_through_either_kernel_as_the_generic_loop():
    model = _qwen2()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
    params = SamplingParams(n=3, max_new_tokens=20, seed=11, stop_token_ids=tuple(range(1, 9)))
    plain = HFEngine(model=model, backend=PlainCPU())
    cpu = make_engine("hf", model=model, backend="cpu")
    generic = make_engine("hf", model=model, backend="cpu", fast_decode=False)
    assert plain._fast is not None and type(plain._fast.kernel) is DecodeKernel
    assert isinstance(cpu, HFEngine) and cpu._fast is not None and isinstance(cpu._fast.kernel, CPUDecodeKernel)
    a, b, c = (e.generate(prompts, params) for e in (plain, cpu, generic))
    assert a.response_ids == b.response_ids == c.response_ids
    assert a.finish_reasons == b.finish_reasons == c.finish_reasons
    for x, y, z in zip(a.logprobs, b.logprobs, c.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(z), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(y), torch.tensor(z), atol=1e-5, rtol=1e-5)


def test_the_plain_kernel_runs_every_part_of_a_step_op_by_op():
    dec = fast_decoder_for(_qwen2(), PlainCPU())
    assert dec is not None
    with torch.inference_mode():
        dec.start(4, 12, decode_rows=4, steps=8)
        assert dec._fused == [] and dec._fused_head is None and dec._rms_kernel is None
        assert dec.k_cache.is_contiguous()
        dec.release()
    assert dec.cache is None
