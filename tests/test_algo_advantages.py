"""Outcome and return advantage estimators against plain python loops, plus edge cases."""

import math
import statistics

import pytest
import torch

from portrl.algo import compute_advantage, get_adv_estimator

# 6 rows, T=4; groups: "a" (rows 0, 2, 5, non-contiguous), "b" (1, 3), "c" (4, singleton)
INDEX = ["a", "b", "a", "b", "c", "a"]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
SCORES = [1.0, 0.5, 0.0, 2.0, 3.0, 0.5]


def rewards_from(scores, mask=MASK, dtype=torch.float32):
    r = torch.zeros(mask.shape, dtype=dtype)
    for i, s in enumerate(scores):
        length = int(mask[i].sum())
        if length:
            r[i, length - 1] = s
    return r


def groups(index):
    out = {}
    for i, g in enumerate(index):
        out.setdefault(g, []).append(i)
    return out


def expand(per_seq, mask=MASK):
    return torch.tensor([[per_seq[i] * float(mask[i, t]) for t in range(mask.shape[1])] for i in range(len(per_seq))])


def run(name, scores=SCORES, index=INDEX, mask=MASK, **kw):
    return compute_advantage(name, token_level_rewards=rewards_from(scores, mask), response_mask=mask, index=index, **kw)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo(norm):
    eps = 1e-6
    expect = [0.0] * 6
    for rows in groups(INDEX).values():
        vals = [SCORES[i] for i in rows]
        mean, std = (statistics.mean(vals), statistics.stdev(vals)) if len(rows) > 1 else (0.0, 1.0)
        for i in rows:
            expect[i] = (SCORES[i] - mean) / (std + eps) if norm else SCORES[i] - mean
    adv, ret = run("grpo", norm_adv_by_std_in_grpo=norm)
    assert torch.allclose(adv, expand(expect), atol=1e-6) and torch.equal(adv, ret)
    assert adv[4, 0].item() == pytest.approx(3.0 / (1 + eps) if norm else 3.0)  # singleton keeps its score


def test_grpo_zero_spread_group_is_exactly_zero():
    adv, _ = run("grpo", scores=[0.1, 0.7, 0.1, 0.7, 1.0, 0.1])
    assert torch.all(adv[[0, 1, 2, 3, 5]] == 0)


def test_grpo_passk():
    adv, _ = run("grpo_passk", scores=[1.0, 0.5, 3.0, 0.5, 1.0, 2.0], index=["a", "b", "a", "b", "b", "a"])
    std_a = statistics.stdev([1.0, 3.0, 2.0])
    exp = [0.0, 0.0, (3.0 - 2.0) / (std_a + 1e-6), 0.0, (1.0 - 0.5) / (statistics.stdev([0.5, 0.5, 1.0]) + 1e-6), 0.0]
    assert torch.allclose(adv, expand(exp), atol=1e-6)
    adv, _ = run("grpo_passk", scores=[2.0, 2.0, 1.0, 0.0, 0.0, 0.0], index=["a", "a", "a", "b", "b", "b"],
                 norm_adv_by_std_in_grpo=False)
    assert adv.sum(-1).tolist() == [0.0] * 6  # ties: first max wins with r_max - r_2nd = 0
    with pytest.raises(ValueError, match=">= 2 samples"):
        run("grpo_passk")  # group "c" is a singleton


def test_rloo_opo_gpg_rfpp_baseline():
    g = groups(INDEX)
    rloo, opo, centered = [0.0] * 6, [0.0] * 6, [0.0] * 6
    lengths = [int(MASK[i].sum()) for i in range(6)]
    for rows in g.values():
        n = len(rows)
        for i in rows:
            others = [SCORES[j] for j in rows if j != i]
            rloo[i] = SCORES[i] - sum(others) / len(others) if others else SCORES[i]
            b = sum(lengths[j] * SCORES[j] for j in rows) / sum(lengths[j] for j in rows) if n > 1 else 0.0
            opo[i] = SCORES[i] - b
            centered[i] = SCORES[i] - (statistics.mean([SCORES[j] for j in rows]) if n > 1 else 0.0)
    assert torch.allclose(run("rloo")[0], expand(rloo), atol=1e-6)
    assert torch.allclose(run("opo")[0], expand(opo), atol=1e-6)
    alpha = 6 / sum(1 for s in SCORES if s != 0)
    assert torch.allclose(run("gpg")[0], expand([alpha * c for c in centered]), atol=1e-6)
    flat = [centered[i] for i in range(6) for t in range(4) if MASK[i, t]]
    mu, sd = statistics.mean(flat), statistics.stdev(flat)
    expect = expand([0.0] * 6)
    for i in range(6):
        for t in range(4):
            if MASK[i, t]:
                expect[i, t] = (centered[i] - mu) / math.sqrt(sd ** 2 + 1e-8)
    assert torch.allclose(run("reinforce_plus_plus_baseline")[0], expect, atol=1e-5)


def returns_loop(r, m, gamma):
    out = [[0.0] * len(r[0]) for _ in r]
    for i in range(len(r)):
        run_ = 0.0
        for t in reversed(range(len(r[0]))):
            new = r[i][t] + gamma * run_
            if m[i][t]:
                out[i][t] = new
                run_ = new
    return out


def test_reinforce_plus_plus_carries_through_interior_mask():
    r = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.5, 0.0, 1.0, 0.0], [0.0, 0.0, 3.0, 0.0]])
    m = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    adv, ret = compute_advantage("reinforce_plus_plus", token_level_rewards=r, response_mask=m, gamma=0.9)
    g = returns_loop(r.tolist(), m.tolist(), 0.9)
    assert torch.allclose(ret, torch.tensor(g), atol=1e-6)
    flat = [g[i][t] for i in range(3) for t in range(4) if m[i, t]]
    mu, sd = statistics.mean(flat), statistics.stdev(flat)
    for i in range(3):
        for t in range(4):
            want = (g[i][t] - mu) / math.sqrt(sd ** 2 + 1e-8) if m[i, t] else 0.0
            assert adv[i, t].item() == pytest.approx(want, abs=1e-5)


def test_remax():
    r = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, ret = compute_advantage("remax", token_level_rewards=r, response_mask=m, reward_baselines=torch.tensor([0.5, 3.0]))
    assert ret.tolist() == [[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]]
    assert adv.tolist() == [[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]]
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", token_level_rewards=r, response_mask=m)


def test_optimal_token_baseline_loop():
    torch.manual_seed(0)
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    r = rewards_from([1.0, 0.0, 0.5, 2.0], m)
    old = -torch.rand(4, 4)
    spi = torch.rand(4, 4) * 0.5
    index = ["x", "x", "x", "y"]
    adv, ret = compute_advantage("optimal_token_baseline", token_level_rewards=r, response_mask=m, index=index,
                                 old_log_probs=old, sum_pi_squared=spi)
    G = [[sum(r[i, k].item() * m[i, k].item() for k in range(t, 4)) for t in range(4)] for i in range(4)]
    W = [[0.0] * 4 for _ in range(4)]
    for i in range(4):
        acc = 0.0
        for t in range(4):
            acc += (1 - 2 * math.exp(old[i, t].item()) + spi[i, t].item()) * m[i, t].item()
            W[i][t] = acc
    rows = [0, 1, 2]
    for t in range(4):
        num = sum(G[i][t] * W[i][t] * m[i, t].item() for i in rows)
        den = sum(W[i][t] * m[i, t].item() for i in rows)
        b = num / (den + 1e-8)
        for i in rows:
            if i == 0 and t >= 3:  # unique longest row beyond the 2nd longest length (3): baseline 0
                b_i = 0.0
            else:
                b_i = b
            assert adv[i, t].item() == pytest.approx((G[i][t] - b_i) * m[i, t].item(), abs=1e-5)
    assert adv[3, 0].item() == pytest.approx(2.0)  # singleton: B = 0
    assert torch.allclose(ret, torch.tensor(G) * m, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_fully_masked_row_gets_zero_and_float64_agrees(name):
    mask = MASK.clone()
    mask[1] = 0
    adv, _ = run(name, mask=mask)
    assert torch.all(adv[1] == 0) and torch.isfinite(adv).all()
    r64 = rewards_from(SCORES, dtype=torch.float64)
    a64, _ = compute_advantage(name, token_level_rewards=r64, response_mask=MASK, index=INDEX)
    a32, _ = compute_advantage(name, token_level_rewards=r64.float(), response_mask=MASK, index=INDEX)
    assert a64.dtype == torch.float64 and a32.dtype == torch.float32
    assert torch.allclose(a32.double(), a64, atol=1e-5)


@pytest.mark.parametrize("name", ["grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus",
                                  "reinforce_plus_plus_baseline", "remax", "optimal_token_baseline", "gae"])
def test_all_masked_batch_is_a_clear_error(name):
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="all-masked"):
        compute_advantage(name, token_level_rewards=z, response_mask=z, index=["a", "a"], values=z,
                          reward_baselines=torch.zeros(2), old_log_probs=z, sum_pi_squared=z)


def test_dispatch_errors_and_inputs_unchanged():
    r = rewards_from(SCORES)
    before = r.clone()
    compute_advantage("grpo", token_level_rewards=r, response_mask=MASK, index=INDEX)
    assert torch.equal(r, before)
    with pytest.raises(KeyError, match="registered: gae"):
        get_adv_estimator("ppo")
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=MASK)
    with pytest.raises(ValueError, match="does not take lam_actor"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=MASK, index=INDEX, lam_actor=0.9)
    with pytest.raises(ValueError, match="index has 2 entries"):
        compute_advantage("rloo", token_level_rewards=r, response_mask=MASK, index=["a", "b"])
