"""GAE against a python loop; VC-PPO decoupled λ; VAPO length-adaptive λ."""

import math
import statistics

import pytest
import torch

from portrl.algo import compute_advantage, vapo_length_adaptive_lambda

R = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 2.0], [0.3, 0.0, 0.0, 0.0]])
V = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 0.4, 0.3, 0.2], [0.0, 1.0, -1.0, 0.7]])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0]])  # row 1 has an interior masked position


def gae_loop(r, v, m, gamma, lams):
    adv = [[0.0] * 4 for _ in range(3)]
    for i in range(3):
        next_v, last = 0.0, 0.0
        for t in reversed(range(4)):
            cand = r[i][t] + gamma * next_v - v[i][t] + gamma * lams[i] * last
            if m[i][t]:
                next_v, last = v[i][t], cand
            adv[i][t] = last
    rets = [[(adv[i][t] + v[i][t]) * m[i][t] for t in range(4)] for i in range(3)]
    flat = [adv[i][t] for i in range(3) for t in range(4) if m[i][t]]
    mu, sd = statistics.mean(flat), statistics.stdev(flat)
    white = [[(adv[i][t] - mu) / math.sqrt(sd ** 2 + 1e-8) * m[i][t] for t in range(4)] for i in range(3)]
    return torch.tensor(white), torch.tensor(rets)


def test_gae_matches_loop():
    adv, ret = compute_advantage("gae", token_level_rewards=R, response_mask=M, values=V, gamma=0.9, lam=0.8)
    w, rt = gae_loop(R.tolist(), V.tolist(), M.tolist(), 0.9, [0.8] * 3)
    assert torch.allclose(adv, w, atol=1e-5) and torch.allclose(ret, rt, atol=1e-6)
    assert adv[0, 3] == 0 and ret[1, 1] == 0  # masked positions are zero


def test_vcppo_decoupled_lambda():
    adv, ret = compute_advantage("vcppo_gae", token_level_rewards=R, response_mask=M, values=V, lam=0.95)
    w_actor, _ = gae_loop(R.tolist(), V.tolist(), M.tolist(), 1.0, [0.95] * 3)
    _, r_critic = gae_loop(R.tolist(), V.tolist(), M.tolist(), 1.0, [1.0] * 3)
    assert torch.allclose(adv, w_actor, atol=1e-5) and torch.allclose(ret, r_critic, atol=1e-6)
    # Monte-Carlo return with γ = λ = 1: sum of future rewards at valid positions (the 0.5 at the
    # masked position t=1 is skipped, as masked tokens are observations, not actions)
    assert ret[1].tolist() == pytest.approx([2.0, 0.0, 2.0, 2.0])
    a2, r2 = compute_advantage("gae", token_level_rewards=R, response_mask=M, values=V, lam_actor=0.95, lam_critic=1.0)
    assert torch.equal(a2, adv) and torch.equal(r2, ret)


def test_vapo_length_adaptive_lambda():
    m = torch.tensor([[1] * 40 + [0] * 10, [1] * 10 + [0] * 40, [1] * 50, [0] * 50])
    lam = vapo_length_adaptive_lambda(m, 0.05)
    assert lam.tolist() == pytest.approx([1 - 1 / 2.0, 0.0, 1 - 1 / 2.5, 0.0])  # l=10: 1-1/0.5 = -1 -> 0
    adv, ret = compute_advantage("vapo_gae", token_level_rewards=R, response_mask=M, values=V)
    lams = vapo_length_adaptive_lambda(M, 0.05).tolist()  # lengths 3, 3, 2: all clamp to 0
    w, _ = gae_loop(R.tolist(), V.tolist(), M.tolist(), 1.0, lams)
    _, rc = gae_loop(R.tolist(), V.tolist(), M.tolist(), 1.0, [1.0] * 3)
    assert torch.allclose(adv, w, atol=1e-5) and torch.allclose(ret, rc, atol=1e-6)
    adv2, _ = compute_advantage("vapo_gae", token_level_rewards=R, response_mask=M, values=V, vapo_alpha=1.0)
    w2, _ = gae_loop(R.tolist(), V.tolist(), M.tolist(), 1.0, [1 - 1 / 3, 1 - 1 / 3, 0.5])
    assert torch.allclose(adv2, w2, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        compute_advantage("gae", token_level_rewards=R, response_mask=M, values=V, lam_actor=0.9, vapo_alpha=0.05)


def test_gae_edge_cases_and_dtypes():
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", token_level_rewards=R, response_mask=M)
    one = torch.zeros_like(M)
    one[0, 0] = 1
    with pytest.raises(ValueError, match="single"):
        compute_advantage("gae", token_level_rewards=R, response_mask=one, values=V)
    m = M.clone()
    m[2] = 0  # a fully masked row stays zero
    adv, ret = compute_advantage("gae", token_level_rewards=R, response_mask=m, values=V)
    assert torch.all(adv[2] == 0) and torch.all(ret[2] == 0)
    a64, r64 = compute_advantage("gae", token_level_rewards=R.double(), response_mask=M, values=V.double(), lam=0.9)
    a32, r32 = compute_advantage("gae", token_level_rewards=R, response_mask=M, values=V, lam=0.9)
    assert a64.dtype == torch.float64 and torch.allclose(a32.double(), a64, atol=1e-5)
    ab, _ = compute_advantage("gae", token_level_rewards=R.bfloat16(), response_mask=M, values=V.bfloat16(), lam=0.9)
    assert ab.dtype == torch.float32
