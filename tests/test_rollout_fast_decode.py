"""portrl.rollout.fast_decode: the lean static-cache forward matches Hugging Face's forward exactly, and the hf
engine samples the same tokens with and without it."""

from __future__ import annotations

import pytest
import torch

from portrl.rollout.fast_decode import FastDecoder, fast_decoder_for


def _qwen2(vocab=64, hidden=32, layers=2, heads=4, kv=2, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, initializer_range=0.2)
    return Qwen2ForCausalLM(cfg).eval()


def _llama(vocab=64, hidden=32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, initializer_range=0.2,
                      rope_theta=500.0)
    return LlamaForCausalLM(cfg).eval()


def _left_padded(lengths, plen, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (len(lengths), plen), generator=g)
    mask = torch.arange(plen)[None] >= (plen - torch.tensor(lengths))[:, None]
    return ids * mask, mask


@pytest.mark.parametrize("make", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_prefill_and_decode_logits_match_hf(make):
    model = make()
    dec = fast_decoder_for(model)
    assert isinstance(dec, FastDecoder)
    ids, mask = _left_padded([7, 4, 6], 7, 64)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    steps = 4
    with torch.inference_mode():
        dec.start(3, 7 + steps)
        got = dec.forward(ids, pos, 0, mask)
        want = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits[:, -1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        key_mask = torch.cat([mask, torch.ones(3, steps, dtype=torch.bool)], 1)
        seq, m, p = ids, mask.long(), pos
        for t in range(steps):
            tok = torch.randint(2, 64, (3, 1), generator=torch.Generator().manual_seed(t))
            npos = p[:, -1:] + 1
            got = dec.forward(tok, npos, 7 + t, key_mask[:, : 7 + t + 1])
            seq, m, p = torch.cat([seq, tok], 1), torch.cat([m, torch.ones(3, 1, dtype=torch.long)], 1), torch.cat([p, npos], 1)
            want = model(input_ids=seq, attention_mask=m, position_ids=p).logits[:, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        dec.release()


def test_unsupported_architectures_fall_back():
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert fast_decoder_for(qwen3) is None  # q/k norms are not reproduced
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4))
    assert fast_decoder_for(gpt2) is None
    assert fast_decoder_for(torch.nn.Linear(2, 2)) is None
    biased = _llama()
    biased.config.mlp_bias = True  # Llama's MLP with biases (gate, up, down): the fast path has none
    assert fast_decoder_for(biased) is None


def test_engine_samples_identical_tokens_with_and_without_fast_path():
    from portrl.rollout import SamplingParams, make_engine

    model = _qwen2(vocab=48)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
    # many stop ids so rows finish at different steps and the batch is compacted on the way
    params = SamplingParams(n=3, max_new_tokens=12, seed=11, stop_token_ids=tuple(range(1, 9)))
    fast = make_engine("hf", model=model, backend="cpu")
    slow = make_engine("hf", model=model, backend="cpu", fast_decode=False)
    assert fast._fast is not None and slow._fast is None
    a, b = fast.generate(prompts, params), slow.generate(prompts, params)
    assert a.response_ids == b.response_ids
    assert a.finish_reasons == b.finish_reasons
    assert len(set(map(len, a.response_ids))) > 1  # early stops really happened
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=1e-5)


def test_fast_path_sees_in_place_weight_updates():
    from portrl.rollout import SamplingParams, make_engine

    model = _qwen2(vocab=48)
    engine = make_engine("hf", model=model, backend="cpu")
    params = SamplingParams(n=2, max_new_tokens=6, seed=3, temperature=0.0)
    before = engine.generate([[5, 6, 7]], params)
    with torch.no_grad():  # what an optimizer step does: in-place updates of the shared parameters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(-3.0)
            layer.mlp.up_proj.weight.add_(0.5)
    after = engine.generate([[5, 6, 7]], params)
    reference = make_engine("hf", model=model, backend="cpu", fast_decode=False).generate([[5, 6, 7]], params)
    assert after.response_ids == reference.response_ids
    assert after.logprobs != before.logprobs


def test_prepacked_decode_linears_sample_the_same_tokens():
    """Long enough calls (>= PREPACK_MIN_STEPS steps) run the linears through the backend's linear_prepacked op
    (MKL-packed weights on x86); tokens and log-probs stay those of the generic loop, compaction included."""
    from portrl.rollout import SamplingParams, make_engine
    from portrl.rollout.fast_decode import PREPACK_MIN_STEPS

    model = _qwen2(vocab=48)
    fast = make_engine("hf", model=model, backend="cpu")
    slow = make_engine("hf", model=model, backend="cpu", fast_decode=False)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    params = SamplingParams(n=4, max_new_tokens=PREPACK_MIN_STEPS + 8, seed=5, stop_token_ids=(1, 2))
    used = []
    real = fast._fast._prepack
    fast._fast._prepack = lambda w, b, rows: used.append(rows) or real(w, b, rows)
    a, b = fast.generate(prompts, params), slow.generate(prompts, params)
    assert used and set(used) == {len(prompts) * params.n}
    assert a.response_ids == b.response_ids
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=1e-5)
    short = SamplingParams(n=2, max_new_tokens=PREPACK_MIN_STEPS - 4, seed=5)
    used.clear()
    assert fast.generate(prompts, short).response_ids == slow.generate(prompts, short).response_ids
    assert not used  # too few steps for the packing to pay


@pytest.mark.parametrize("fast_decode", [True, False], ids=["fast", "hf"])
def test_decode_loops_note_the_token_they_reached(fast_decode, monkeypatch):
    """Both decode loops tell the console's open phase how far they got (portrl/progress.py: ``gen token 16/40``)."""
    from portrl import progress
    from portrl.rollout import SamplingParams, make_engine

    seen = []
    monkeypatch.setattr("portrl.rollout.fast_decode.note" if fast_decode else "portrl.rollout.hf_engine.note",
                        seen.append)
    engine = make_engine("hf", model=_qwen2(vocab=48), backend="cpu", fast_decode=fast_decode)
    with progress.activity("gen"):
        engine.generate([[5, 6, 7]], SamplingParams(n=1, max_new_tokens=40, seed=0, stop_token_ids=()))
    assert seen[:2] == ["token 0/40", "token 16/40"]
