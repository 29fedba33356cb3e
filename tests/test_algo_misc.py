"""Value loss, explained variance, entropy loss, DAPO overlong penalty and group filter, DPO / SPPO / positive LM loss."""

import math

import pytest
import torch

from portrl.algo import (compute_value_loss, dpo_loss, explained_variance, filter_groups, online_dpo_preference, overlong_penalty,
                         positive_lm_loss, sppo_advantage, sppo_loss)
from portrl.algo.value import compute_entropy_loss


def test_explained_variance_by_hand():
    ret = torch.tensor([[1.0, 1.0, 9.0], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the 9.0 is padding
    vals = torch.tensor([[0.5, 1.0, -4.0], [0.0, 0.5, 0.0]])
    r, v = [1.0, 1.0, 0.0, 0.0, 0.0], [0.5, 1.0, 0.0, 0.5, 0.0]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    want = 1 - var([a - b for a, b in zip(r, v)]) / var(r)
    assert explained_variance(ret, vals, m).item() == pytest.approx(want)
    assert explained_variance(ret, ret, m).item() == pytest.approx(1.0)  # a perfect critic
    mean = torch.full_like(ret, 0.4)  # the valid returns' mean: explains nothing
    assert explained_variance(ret, mean, m).item() == pytest.approx(0.0, abs=1e-12)
    assert explained_variance(ret, -ret, m).item() < 0  # worse than the mean
    assert math.isnan(explained_variance(torch.ones(2, 3), vals, m).item())  # every return the same
    assert math.isnan(explained_variance(ret, vals, torch.zeros_like(m)).item())
    with pytest.raises(ValueError, match="shape"):
        explained_variance(ret, vals[:, :2], m)


def test_value_loss_by_hand_and_shards():
    vp = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]], requires_grad=True)
    ret = torch.tensor([[1.5, 0.0, 0.0], [0.0, 0.0, 1.0]])
    old = torch.tensor([[0.0, 2.2, 0.0], [0.4, 0.0, 1.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    c = 0.5
    terms, clipped = [], 0
    for i in range(2):
        for t in range(3):
            if m[i, t]:
                v, r, o = vp[i, t].item(), ret[i, t].item(), old[i, t].item()
                vc = min(max(v, o - c), o + c)
                terms.append(max((v - r) ** 2, (vc - r) ** 2))
                clipped += (vc - r) ** 2 > (v - r) ** 2
    loss, frac = compute_value_loss(vp, ret, old, m, c)
    assert loss.item() == pytest.approx(0.5 * sum(terms) / len(terms))
    assert frac.item() == pytest.approx(clipped / len(terms))
    loss.backward()
    assert vp.grad[0, 2] == 0
    parts = [compute_value_loss(vp[s], ret[s], old[s], m[s], c, batch_num_tokens=5)[0].item()
             for s in (slice(0, 1), slice(1, 2))]
    assert sum(parts) == pytest.approx(loss.item())
    l64, _ = compute_value_loss(vp.detach().double(), ret.double(), old.double(), m, c)
    assert l64.item() == pytest.approx(loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="all-masked"):
        compute_value_loss(vp, ret, old, torch.zeros_like(m), c)


def test_entropy_loss():
    logits = torch.zeros(2, 3, 4)
    assert compute_entropy_loss(logits, torch.ones(2, 3)).item() == pytest.approx(math.log(4))


def test_overlong_penalty():
    pen = overlong_penalty([10, 12, 14, 16, 17], max_response_length=16, buffer_len=4, penalty_factor=0.5)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty([1], 16, 0)


def test_filter_groups():
    index = ["a", "b", "a", "c", "b", "d", "d"]
    metric = [1.0, 0.3, 0.0, 0.7, 0.3, 0.1 + 0.2, 0.3]  # d: 0.30000000000000004 vs 0.3 differ -> kept
    assert filter_groups(index, metric).tolist() == [True, False, True, True, False, True, True]
    assert filter_groups(["x", "x"], [0.1, 0.1]).tolist() == [False, False]
    with pytest.raises(ValueError, match="NaN"):
        filter_groups(["x"], [float("nan")])


def test_dpo_sigmoid_ipo_reference_free():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    rc, rr = torch.tensor([-1.2, -2.0]), torch.tensor([-1.2, -1.5])
    beta, ls = 0.5, 0.1
    zs = [(-1.0 + 1.5) - (-1.2 + 1.2), (-2.0 + 1.0) - (-2.0 + 1.5)]

    def logsig(x):
        return -math.log1p(math.exp(-x))

    want = sum(-logsig(beta * z) * (1 - ls) - logsig(-beta * z) * ls for z in zs) / 2
    loss, met = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls)
    assert loss.item() == pytest.approx(want, rel=1e-6) and met["dpo/accuracy"].item() == 0.5
    ipo, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="ipo")
    assert ipo.item() == pytest.approx(sum((z - 1 / (2 * beta)) ** 2 for z in zs) / 2, rel=1e-6)
    free, _ = dpo_loss(pc, pr, beta=beta, reference_free=True)
    assert free.item() == pytest.approx(sum(-logsig(beta * z) for z in [0.5, -1.0]) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        dpo_loss(pc, pr)
    with pytest.raises(ValueError, match="valid: ipo, sigmoid"):
        dpo_loss(pc, pr, rc, rr, loss_type="hinge")
    assert online_dpo_preference(torch.tensor([[1.0, 0], [0, 1.0], [0, 0], [2.0, 0]]),
                                 torch.ones(4, 2)).tolist() == [True, False, False, True]


def test_sppo_advantage_and_loss():
    r = torch.tensor([1.0, 0.0, 0.5])
    soft = math.log(sum(math.exp(2.0 * x) for x in r.tolist()) / 3) / 2.0
    assert sppo_advantage(r, beta=2.0).tolist() == pytest.approx([x - soft for x in r.tolist()])
    assert sppo_advantage(r, beta=0.0).tolist() == pytest.approx([0.5, -0.5, 0.0])
    assert sppo_advantage(r, beta=0.0, index=["a", "a", "b"]).tolist() == pytest.approx([0.5, -0.5, 0.0])
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-0.5, -0.5]])
    lp = torch.tensor([[-0.5, -2.5], [-1.0, -0.5], [-0.1, -0.1]])
    m = torch.tensor([[1, 1], [1, 0], [0, 0]])
    adv = torch.tensor([0.2, -0.4, 9.0])
    loss, _ = sppo_loss(old, lp, adv, m, eta=2.0)
    want = ((0.5 - 0.5) - 0.4) ** 2 + (0.0 + 0.8) ** 2
    assert loss.item() == pytest.approx(want / 2)
    loss_bt, _ = sppo_loss(old, lp, adv[:, None] * m, m, eta=2.0)
    assert loss_bt.item() == pytest.approx(loss.item())
    with pytest.raises(ValueError, match="all-masked"):
        sppo_loss(old, lp, adv, torch.zeros_like(m))


def test_positive_lm_loss():
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    m = torch.tensor([[1, 1], [1, 0]])
    assert positive_lm_loss(lp, m, torch.tensor([True, False])).item() == pytest.approx(1.5)
    zero = positive_lm_loss(lp, m, torch.tensor([False, False]))
    assert zero.item() == 0.0
    zero.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))
