"""sample_next: the sampled distribution and the reported log-prob, checked against values worked out
directly from the probabilities."""

from __future__ import annotations

import pickle

import pytest
import torch

from portrl.rollout.sampling import sample_next


def frequencies(logits, draws=20000, **kw):
    gen = torch.Generator().manual_seed(0)
    rows = logits.expand(draws, -1)
    tokens, logp = sample_next(rows, generator=gen, **kw)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / draws, tokens, logp


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_temperature_distribution_and_logprob():
    t = 0.7
    freq, tokens, logp = frequencies(LOGITS, temperature=t)
    want = torch.softmax(LOGITS[0] / t, -1)
    assert (freq - want).abs().max() < 0.015
    torch.testing.assert_close(logp, torch.log(want)[tokens])


def test_top_k_truncates_but_logprob_is_untruncated():
    freq, tokens, logp = frequencies(LOGITS, temperature=1.0, top_k=2)
    assert set(tokens.unique().tolist()) == {0, 1}
    p = torch.softmax(LOGITS[0], -1)
    assert abs(freq[0].item() - (p[0] / (p[0] + p[1])).item()) < 0.015
    torch.testing.assert_close(logp, torch.log(p)[tokens])  # log_softmax(z / T), before truncation


def test_top_p_keeps_smallest_prefix_reaching_p():
    p = torch.softmax(LOGITS[0], -1)  # sorted descending already
    top_p = float(p[:2].sum()) + 1e-3  # needs the third token to reach top_p
    freq, tokens, _ = frequencies(LOGITS, temperature=1.0, top_p=top_p)
    assert set(tokens.unique().tolist()) == {0, 1, 2}
    kept = p[:3] / p[:3].sum()
    assert (freq[:3] - kept).abs().max() < 0.015
    _, only_first, _ = frequencies(LOGITS, draws=500, temperature=1.0, top_p=1e-6)
    assert set(only_first.tolist()) == {0}


def test_zero_mass_tokens_never_drawn_at_the_end():
    logits = torch.tensor([[0.0, 0.0, -1e4]])  # last token: masked by top-k and ~0 mass
    _, tokens, _ = frequencies(logits, draws=5000, temperature=1.0, top_k=2)
    assert 2 not in tokens.tolist()


def test_greedy():
    tokens, logp = sample_next(LOGITS.repeat(3, 1), temperature=0.0)
    assert tokens.tolist() == [0, 0, 0]
    torch.testing.assert_close(logp, torch.log_softmax(LOGITS[0], -1)[0].expand(3))


def test_generator_makes_draws_reproducible():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    a = sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(5))[0]
    b = sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(5))[0]
    c = sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(6))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_logprob_at_a_real_vocabulary_matches_float64():
    """Without truncation the log-sum-exp comes from the same exp pass as the draw; it stays float32-exact."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 151936, generator=gen) * 4
    tokens, logp = sample_next(logits, temperature=1.0, generator=gen)
    want = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), want, atol=2e-5, rtol=0)


def test_non_finite_logits_give_in_vocabulary_tokens_and_non_finite_logprobs():
    """A row of NaN / inf logits (diverged weights) never indexes past the vocabulary (before: `index 6 is out of
    bounds`, a device-side assert on a GPU); its log-prob is not finite, the other rows are sampled as usual."""
    logits = LOGITS.repeat(4, 1)
    logits[1, 2] = float("nan")
    logits[2] = float("nan")
    logits[3, 0] = float("inf")
    for kw in ({"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}, {"temperature": 1.0, "top_p": 0.5},
               {"temperature": 0.0}):
        tokens, logp = sample_next(logits, generator=torch.Generator().manual_seed(0), **kw)
        assert ((tokens >= 0) & (tokens < logits.shape[-1])).all(), kw
        assert torch.isfinite(logp).tolist() == [True, False, False, False], kw


def test_the_decode_loop_refuses_non_finite_logits_with_a_message():
    from portrl.errors import UserError
    from portrl.rollout.decode_rows import DecodeRows
    from portrl.rollout.sampling import NonFiniteLogitsError

    rows = DecodeRows(3, 8, 0, torch.tensor([5]), 0.5, "cpu")
    assert not rows.record(0, torch.tensor([1, 2, 3]), torch.tensor([-0.1, -2.0, -0.5]))
    with pytest.raises(NonFiniteLogitsError) as err:
        rows.record(1, torch.tensor([1, 2, 3]), torch.tensor([-0.1, float("nan"), float("-inf")]))
    assert isinstance(err.value, UserError) and (err.value.step, err.value.rows) == (1, 2)
    assert str(err.value).startswith("the policy's logits are not finite (NaN or inf) at decode step 1 in 2 rows: "
                                     "its weights diverged")
    again = pickle.loads(pickle.dumps(err.value))  # a Ray worker's error reaches the trainer whole
    assert str(again) == str(err.value) and again.step == 1


@pytest.mark.parametrize("greedy", [False, True])
def test_an_engine_on_diverged_weights_stops_with_the_message(greedy):
    """Finite but huge weights (what lr=1e20 leaves after one AdamW step) overflow the forward to NaN logits: the hf
    engine raises NonFiniteLogitsError at decode step 0 instead of an index error."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from portrl.rollout import SamplingParams, make_engine
    from portrl.rollout.sampling import NonFiniteLogitsError

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=3,
                      pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).eval()
    engine = make_engine("hf", model=model, backend="cpu")
    params = SamplingParams(n=2, max_new_tokens=4, seed=1, temperature=0.0 if greedy else 1.0)
    assert engine.generate([[5, 6, 7], [8, 9]], params).num_tokens > 0  # healthy weights: sampled as usual
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e16)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    with pytest.raises(NonFiniteLogitsError, match="at decode step 0"):
        engine.generate([[5, 6, 7], [8, 9]], params)
