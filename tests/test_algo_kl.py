"""KL estimators (incl. straight-through '+'), controllers, KL in reward, KL loss."""

import math

import pytest
import torch

from portrl.algo import apply_kl_penalty, compute_kl_loss, get_kl_controller, kl_penalty

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -30.0]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.3, -1.0]], dtype=torch.float64)


def k3(d):
    x = max(min(-d, 20.0), -20.0)
    return max(min(math.exp(x) - x - 1, 10.0), -10.0)


BASE = {"kl": lambda d: d, "abs": abs, "mse": lambda d: 0.5 * d * d, "low_var_kl": k3}
ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                                  "kl+", "k1+", "abs+", "low_var_kl+", "k3+", "k2+", "mse+"])
def test_values_match_loop(name):
    base = ALIASES.get(name.rstrip("+"), name.rstrip("+"))
    out = kl_penalty(LOGP, REF, name)
    for i in range(2):
        for t in range(3):
            d = (LOGP[i, t] - REF[i, t]).item()
            assert out[i, t].item() == pytest.approx(BASE[base](d), rel=1e-12, abs=1e-12)
    assert out[1, 2].item() == 10.0 if base == "low_var_kl" else True  # upper clamp binds


@pytest.mark.parametrize("name", ["kl+", "abs+", "low_var_kl+", "k3+", "k2+"])
def test_straight_through_gradient_is_d(name):
    lp = LOGP.clone().requires_grad_()
    kl_penalty(lp, REF, name).sum().backward()
    assert torch.allclose(lp.grad, LOGP - REF)


def test_plain_k3_gradient_differs_from_straight_through():
    lp = LOGP.clone().requires_grad_()
    kl_penalty(lp, REF, "k3").sum().backward()
    d = (LOGP - REF)[0, 0].item()
    assert lp.grad[0, 0].item() == pytest.approx(1 - math.exp(-d))  # d/dlogp of e^{-d} + d - 1


def test_unknown_and_full():
    with pytest.raises(KeyError, match="registered: abs"):
        kl_penalty(LOGP, REF, "full")


def test_float32_agrees_with_float64():
    for name in ["kl", "abs", "mse", "low_var_kl"]:
        assert torch.allclose(kl_penalty(LOGP.float(), REF.float(), name).double(), kl_penalty(LOGP, REF, name),
                              atol=1e-5)


def test_controllers():
    fixed = get_kl_controller("fixed", 0.01)
    fixed.update(5.0, 100)
    assert fixed.value == 0.01
    ad = get_kl_controller("adaptive", 0.01, target_kl=0.1, horizon=1000)
    ad.update(0.5, 100)  # error clipped to 0.2
    assert ad.value == pytest.approx(0.01 * (1 + 0.2 * 100 / 1000))
    ad.update(0.09, 10)
    assert ad.value == pytest.approx(0.01 * 1.02 * (1 + (-0.1) * 10 / 1000))
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", 0.01, horizon=0)
    with pytest.raises(ValueError, match="valid: adaptive, fixed"):
        get_kl_controller("pid", 0.01)


def test_apply_kl_penalty_by_hand():
    scores = torch.zeros(3, 3)
    scores[0, 1] = 1.0
    old = torch.tensor([[-1.0, -2.0, -5.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -2.0, -1.0], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    ctrl = get_kl_controller("adaptive", 0.5, target_kl=1.0, horizon=30)
    rewards, metrics = apply_kl_penalty(scores, old, ref, m, ctrl, "kl")
    expect = torch.tensor([[-0.25, 1.5, 0.0], [0.0, -0.5, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(rewards, expect)
    row0, row1 = (0.5 - 1.0) / 2, 1.0 / 3  # the all-masked row is skipped
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((row0 + row1) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    err = max(min(((row0 + row1) / 2) / 1.0 - 1, 0.2), -0.2)
    assert ctrl.value == pytest.approx(0.5 * (1 + err * 3 / 30))
    with pytest.raises(ValueError, match="all-masked"):
        apply_kl_penalty(scores, old, ref, torch.zeros_like(m), ctrl)


def test_kl_loss_term():
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = compute_kl_loss(LOGP, REF, m, "token-mean", "low_var_kl")
    vals = [k3((LOGP[i, t] - REF[i, t]).item()) for i, t in [(0, 0), (0, 1), (1, 0)]]
    assert out.item() == pytest.approx(sum(vals) / 3)
