"""Masked statistics, response mask, entropy, registries."""

import math

import pytest
import torch

from portrl.algo import (entropy_from_logits, get_response_mask, masked_mean, masked_var, masked_whiten, registered)
from portrl.algo.registry import Registry, UnknownNameError


def test_masked_mean_ignores_nan_and_all_masked_is_zero():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 5.0, 0.0]])
    m = torch.tensor([[1, 0, 1], [0, 1, 0]])
    assert masked_mean(x, m).item() == pytest.approx(3.0)
    assert torch.allclose(masked_mean(x, m, axis=-1), torch.tensor([2.0, 5.0]))
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0
    assert torch.equal(masked_mean(x, torch.tensor([[0, 0, 0], [0, 1, 0]]), axis=-1), torch.tensor([0.0, 5.0]))


def test_masked_var_and_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 99.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    vals = [1.0, 2.0, 3.0, 4.0]
    mu = sum(vals) / 4
    var = sum((v - mu) ** 2 for v in vals) / 3
    assert masked_var(x, m).item() == pytest.approx(var)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(var * 3 / 4)
    w = masked_whiten(x, m)
    expect = [[(v - mu) / math.sqrt(var + 1e-8) for v in (1.0, 2.0)] + [0.0],
              [(v - mu) / math.sqrt(var + 1e-8) for v in (3.0, 4.0)] + [0.0]]
    assert torch.allclose(w, torch.tensor(expect), atol=1e-6)
    w2 = masked_whiten(x, m, shift_mean=False)
    assert torch.allclose(w2[:, :2], w[:, :2] + mu, atol=1e-6) and torch.all(w2[:, 2] == 0)
    assert x[0, 2] == 99.0  # input unchanged


def test_masked_var_raises_on_empty_or_single():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="all-masked"):
        masked_var(x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="single"):
        masked_whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_get_response_mask_includes_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 6, 7, 8, 9], [2, 1, 1, 1, 1], [5, 3, 9, 9, 9]])
    assert get_response_mask(ids, 2).tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0], [1] * 5]
    assert get_response_mask(ids, [2, 3]).tolist()[3] == [1, 1, 0, 0, 0]
    with pytest.raises(ValueError):
        get_response_mask(ids, [])


def test_entropy_matches_loop_chunked_and_low_precision():
    torch.manual_seed(0)
    z = torch.randn(3, 4, 7, dtype=torch.float64) * 3
    ref = torch.empty(3, 4, dtype=torch.float64)
    for i in range(3):
        for j in range(4):
            p = torch.softmax(z[i, j], -1)
            ref[i, j] = -(p * torch.log(p)).sum()
    assert torch.allclose(entropy_from_logits(z), ref, atol=1e-12)
    assert torch.allclose(entropy_from_logits(z, chunk_size=5), ref, atol=1e-12)
    e32 = entropy_from_logits(z.float(), chunk_size=2)
    assert e32.dtype == torch.float32 and torch.allclose(e32.double(), ref, atol=1e-5)
    ebf = entropy_from_logits(z.to(torch.bfloat16), chunk_size=3)
    assert ebf.dtype == torch.float32 and torch.allclose(ebf.double(), ref, atol=5e-2)
    zz = z.float().requires_grad_()
    entropy_from_logits(zz, chunk_size=4).sum().backward()
    assert torch.isfinite(zz.grad).all()


def test_registry_rules():
    reg = Registry("thing")

    def f():
        return 1

    def g():
        return 2

    reg.register("a", f)
    reg.register("a", f)  # same fn: fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", g)
    reg.alias("b", "a")
    assert reg.get("b") is f
    with pytest.raises(UnknownNameError, match="registered: a; aliases: b"):
        reg.get("zzz")
    with pytest.raises(ValueError, match="unknown registry kind"):
        registered("nope")


def test_registered_lists_every_required_name():
    assert set(registered("adv_estimator")) >= {"gae", "grpo", "grpo_passk", "reinforce_plus_plus",
                                                 "reinforce_plus_plus_baseline", "remax", "rloo", "opo", "gpg",
                                                 "optimal_token_baseline", "vcppo_gae", "vapo_gae"}
    assert set(registered("policy_loss")) >= {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean",
                                               "cispo", "dppo_tv", "dppo_kl", "dro"}
    assert registered("loss_agg_mode") == sorted(["token-mean", "token-sum", "seq-mean-token-sum",
                                                  "seq-mean-token-mean", "seq-mean-token-sum-norm"])
    assert {"grpo", "bnpo", "dapo", "dr_grpo"} <= set(registered("loss_agg_mode", include_aliases=True))
    assert {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "k3+", "low_var_kl+",
            "k2+", "mse+"} <= set(registered("kl_penalty", include_aliases=True))
