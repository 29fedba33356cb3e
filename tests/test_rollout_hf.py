"""The ``hf`` rollout engine on a tiny Qwen2: log-probs against a plain forward (before and after
update_weights), seed determinism, stop tokens, n > 1 ordering, finish reasons, colocation, sleep."""

from __future__ import annotations

import pytest
import torch

from portrl.rollout import SamplingParams, make_engine

EOS = 3


def tiny_model(seed=0, vocab=96):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=EOS,
                      pad_token_id=0, initializer_range=0.3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = EOS
    return model


def plain_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


PROMPTS = [[10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33], [40]]


def check_against_forward(model, out, n, temperature):
    for r, (ids, lps) in enumerate(zip(out.response_ids, out.logprobs)):
        want = plain_logprobs(model, PROMPTS[r // n], ids, temperature)
        torch.testing.assert_close(torch.tensor(lps), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_match_plain_forward(temperature):
    model = tiny_model()
    engine = make_engine("hf", model=model, backend="cpu")
    out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=temperature, max_new_tokens=12, seed=0))
    assert len(out) == len(PROMPTS) * 3
    check_against_forward(model, out, 3, temperature)


def test_logprobs_match_after_update_weights_owned_copy(tmp_path):
    trainer = tiny_model(seed=0)
    trainer.save_pretrained(tmp_path)
    engine = make_engine("hf", model_path=str(tmp_path), backend="cpu")
    assert not engine.colocated and engine.model is not trainer
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    params = SamplingParams(n=2, max_new_tokens=10, seed=5)
    stale = engine.generate(PROMPTS, params)
    engine.update_weights(trainer.state_dict().items())
    fresh = engine.generate(PROMPTS, params)
    check_against_forward(trainer, fresh, 2, 1.0)
    assert fresh.logprobs != stale.logprobs


def test_colocated_update_is_shared_noop():
    model = tiny_model()
    engine = make_engine("hf", model=model, backend="cpu")
    from portrl.rollout.weights import load_named_tensors

    counts = load_named_tensors(engine.model, model.state_dict().items())
    assert counts["copied"] == 0 and counts["shared"] == len(model.state_dict())
    model.train()
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=0))
    assert model.training, "generate must restore the trainer's train mode"


def test_update_weights_errors():
    engine = make_engine("hf", model=tiny_model(), backend="cpu")
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(7))])


def test_determinism_by_seed():
    engine = make_engine("hf", model=tiny_model(), backend="cpu")
    a = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16, seed=123))
    b = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16, seed=123))
    c = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16, seed=124))
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    assert a.response_ids != c.response_ids
    torch.manual_seed(9)
    d = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16))
    torch.manual_seed(9)
    e = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16))
    assert d.response_ids == e.response_ids, "seed=None draws from torch's global RNG"


def test_stop_tokens_and_finish_reasons():
    model = tiny_model()
    engine = make_engine("hf", model=model, backend="cpu")
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, seed=1, stop_token_ids=()))
    stop_tok = free.response_ids[0][4]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, seed=1, stop_token_ids=(stop_tok,)))
    for ids, reason in zip(out.response_ids, out.finish_reasons):
        ended = ids[-1] in (stop_tok, EOS)
        assert reason == ("stop" if ended else "length")
        assert all(t not in (stop_tok, EOS) for t in ids[:-1])
        if reason == "length":
            assert len(ids) == 20
    assert out.finish_reasons[0] == "stop" and len(out.response_ids[0]) <= 5
    # rows that stopped early were dropped from the batch; the others must be unaffected by that
    check_against_forward(model, out, 1, 1.0)


def test_n_rows_are_prompt_major():
    model = tiny_model()
    engine = make_engine("hf", model=model, backend="cpu")
    n = 4
    prompts = [[50, 51, 52], [60]]
    out = engine.generate(prompts, SamplingParams(n=n, temperature=0.0, max_new_tokens=6))
    for i, p in enumerate(prompts):
        greedy_rows = out.response_ids[i * n : (i + 1) * n]
        assert all(r == greedy_rows[0] for r in greedy_rows)  # greedy: every sample of a prompt is the same
        with torch.no_grad():
            first = model(input_ids=torch.tensor([p])).logits[0, -1].argmax().item()
        assert greedy_rows[0][0] == first
    assert out.response_ids[0] != out.response_ids[n]
    sampled = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=6, seed=0))
    check_against_forward_rows = [(prompts[r // n], ids, lps) for r, (ids, lps) in enumerate(zip(sampled.response_ids, sampled.logprobs))]
    for p, ids, lps in check_against_forward_rows:
        torch.testing.assert_close(torch.tensor(lps), plain_logprobs(model, p, ids, 1.0), atol=1e-4, rtol=1e-4)


def test_max_batch_rows_chunks_give_valid_rows():
    model = tiny_model()
    engine = make_engine("hf", model=model, backend="cpu", max_batch_rows=4)
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert len(out) == 8
    check_against_forward(model, out, 2, 1.0)


def test_top_k_one_is_greedy():
    engine = make_engine("hf", model=tiny_model(), backend="cpu")
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    topk1 = engine.generate(PROMPTS, SamplingParams(top_k=1, max_new_tokens=8, seed=3))
    assert greedy.response_ids == topk1.response_ids


def test_sleep_wake_and_bad_prompts():
    engine = make_engine("hf", model=tiny_model(), backend="cpu")
    engine.sleep()
    engine.wake()
    assert len(engine.generate([[5]], SamplingParams(max_new_tokens=2, seed=0))) == 1
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty"):
        engine.generate([[1], []], SamplingParams())



def test_a_generate_call_gives_no_kept_memory_back(monkeypatch):
    """The engine shares the update's allocator: a generate call (fast path recording, or the generic loop) leaves
    what the allocator kept for the next update instead of calling ``empty_cache``."""
    engine = make_engine("hf", model=tiny_model(), backend="cpu")
    seen = []
    monkeypatch.setattr(type(engine.backend), "empty_cache", lambda self: seen.append(1))
    engine.start_recording()
    engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert engine.stop_recording() is not None
    engine._fast = None  # the generic loop
    engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert seen == []
