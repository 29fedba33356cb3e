"""A decode step's last norm and head on the CPU's decode-layer threads (backends/cpu/decode_layer.cpp, op ``head``;
its helper threads: spin_pool.h): bit-equal to the backend's ``rms_norm`` then the rows kernel, for every row count
of both tilings and every instruction-set variant this CPU runs; the native ops where the kernel does not serve; and
the helper threads under what a process does to them (thread counts changing between calls, two callers at once, a
fork); and the decoder calling it."""

import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from portrl.backends.cpu import isa, kernels
from portrl.backends.cpu.decode_layer import ROWS_MAX, bind_head, decode_layer_fused
from portrl.backends.cpu.rms_norm import rms_norm_fused
from portrl.ops.decode_layer import bind_head as bind_head_of
from portrl.ops.layers import rms_norm
from portrl.rollout.fast_decode import PREPACK_MIN_STEPS, fast_decoder_for

RUNNABLE = [v for v in isa.NEEDS if not isa.missing(v, isa.cpu_flags())]
variants = pytest.mark.parametrize("variant", RUNNABLE or [pytest.param(None, marks=pytest.mark.skip(
    reason="this CPU runs no variant of the native kernels (needs AVX2 + FMA)"))])
needs_kernels = pytest.mark.skipif(not RUNNABLE, reason="this CPU runs no variant of the native kernels")

#: vocabularies whose head is under the kernel's INLINE_FLOATS weights (the calling thread alone), and over (helpers)
ONE_THREAD, HELPERS = 80, 1000


def _inputs(rows, vocab=HELPERS, hidden=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g), 1e-6,
            torch.randn(vocab, hidden, generator=g) / hidden ** 0.5, torch.randn(vocab, generator=g))


def _rows_kernel(x, norm_w, eps, head_w, head_b, variant=None):
    """What the decoder computes without the bound head: the backend's norm, then the rows kernel."""
    return kernels.linear_prepacked_rows(head_w, head_b, x.shape[0], variant=variant)(
        rms_norm_fused(x, norm_w, eps, variant=variant))


@variants
@pytest.mark.parametrize("vocab", [ONE_THREAD, HELPERS], ids=["one-thread", "helpers"])
@pytest.mark.parametrize("rows", [1, 5, 11, 12, 16, 17, 32, 64])
def test_a_bound_head_equals_the_norm_then_the_rows_kernel(rows, vocab, variant):
    x, norm_w, eps, head_w, head_b = _inputs(rows, vocab)
    with torch.inference_mode():
        got = bind_head(norm_w, eps, head_w, head_b, variant=variant)(x)
        assert torch.equal(got, _rows_kernel(x, norm_w, eps, head_w, head_b, variant))
        assert torch.equal(bind_head(norm_w, eps, head_w, None, variant=variant)(x),
                           _rows_kernel(x, norm_w, eps, head_w, None, variant))


@needs_kernels
@pytest.mark.parametrize("case", ["rows", "strided input", "gradients"])
def test_a_bound_head_takes_the_native_ops_where_the_kernel_does_not_serve(case):
    x, norm_w, eps, head_w, head_b = _inputs(ROWS_MAX + 1 if case == "rows" else 4)
    if case == "strided input":
        x = x.t().contiguous().t()
    with torch.set_grad_enabled(case == "gradients"):
        norm_w.requires_grad_(case == "gradients")
        got = bind_head(norm_w, eps, head_w, head_b)(x)
        assert torch.equal(got, F.linear(rms_norm(x, norm_w, eps), head_w, head_b))
    assert (got.grad_fn is not None) == (case == "gradients")


@needs_kernels
def test_an_implementation_without_its_own_head_or_weights_it_does_not_serve_leave_the_head_to_the_caller():
    from portrl.ops.decode_layer import decode_layer

    x, norm_w, eps, head_w, head_b = _inputs(3)
    assert bind_head_of(decode_layer, norm_w, eps, head_w, head_b) is None
    assert bind_head_of(decode_layer_fused, norm_w, eps, head_w, head_b) is not None
    assert bind_head_of(decode_layer_fused, norm_w, eps, head_w.t().contiguous().t(), head_b) is None
    assert bind_head_of(decode_layer_fused, norm_w.double(), eps, head_w.double(), None) is None


@needs_kernels
def test_the_helpers_follow_the_thread_count_call_by_call():
    x, norm_w, eps, head_w, head_b = _inputs(16)
    want = _rows_kernel(x, norm_w, eps, head_w, head_b)
    head = bind_head(norm_w, eps, head_w, head_b)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for n in (1, 2, 3, 1, 2, 4, 2):  # more threads than cores: helpers beyond them just find the work taken
                torch.set_num_threads(n)
                assert torch.equal(head(x), want)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_two_threads_calling_at_once_each_get_their_own_result():
    heads = [(_inputs(16, seed=s), None) for s in range(2)]
    wants = [_rows_kernel(*inputs) for inputs, _ in heads]
    results: list = [[], []]

    def call(i):
        (x, norm_w, eps, head_w, head_b), _ = heads[i]
        head = bind_head(norm_w, eps, head_w, head_b)
        with torch.inference_mode():
            for _ in range(200):
                results[i].append(head(x))
    workers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for want, got in zip(wants, results):
        assert len(got) == 200 and all(torch.equal(g, want) for g in got)


@needs_kernels
def test_a_forked_process_computes_the_head_on_its_own_helpers():
    x, norm_w, eps, head_w, head_b = _inputs(16)
    head = bind_head(norm_w, eps, head_w, head_b)
    with torch.inference_mode():
        want = head(x)  # the parent's helpers exist now
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 when its results are the parent's
            ok = all(torch.equal(head(x), want) for _ in range(20))
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked process hung computing the head")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0


@needs_kernels
def test_the_decoder_steps_through_the_bound_head_as_op_by_op():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, pad_token_id=0,
                                         max_position_embeddings=64)).eval()
    dec = fast_decoder_for(model, "cpu")
    ids = torch.randint(2, 1000, (6, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(6, 8, dtype=torch.bool)
    calls, logits = [], {}
    with torch.inference_mode():
        for bound in (True, False):
            dec.start(6, 8 + PREPACK_MIN_STEPS, decode_rows=6, steps=PREPACK_MIN_STEPS)  # the head: the rows kernel
            assert dec._fused_head is not None
            head = dec._fused_head
            dec._fused_head = (lambda x: calls.append(1) or head(x)) if bound else None
            dec.forward(ids, torch.arange(4).expand(6, 4), 0, mask[:, :4])
            logits[bound] = torch.stack([dec.forward(ids[:, t:t + 1], torch.full((6, 1), 4 + t), 4 + t,
                                                     mask[:, : 5 + t]) for t in range(3)])
            dec.release()
    assert len(calls) == 3 and dec._fused_head is None
    assert torch.equal(logits[True], logits[False])
