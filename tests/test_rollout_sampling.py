"""sample_next: the sampled distribution and the reported log-prob, checked against values worked out
directly from the probabilities."""

from __future__ import annotations

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
