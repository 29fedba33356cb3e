"""Every policy loss against a per-token python loop; gradient checks for gspo and cispo; metrics."""

import math

import pytest
import torch

from portrl.algo import get_policy_loss, registered

torch.manual_seed(0)
OLD = (-torch.rand(3, 4, dtype=torch.float64) * 2).round(decimals=3)
LOGP = (OLD + torch.tensor([[0.3, -0.5, 0.05, 0.0], [-0.1, 0.25, -0.3, 1.0], [0.0, 0.1, -0.05, 0.2]],
                           dtype=torch.float64)).clamp(max=-0.01)  # valid log-probs
ADV = torch.tensor([[1.0, -1.0, 0.5, 2.0], [-2.0, 1.5, -0.5, 3.0], [0.7, -0.3, 1.0, 1.0]], dtype=torch.float64)
M = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
CFG = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
       "tau_pos": 1.0, "tau_neg": 1.05, "dro_beta": 0.5, "kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1}
VALID = [(i, t) for i in range(3) for t in range(4) if M[i, t]]


def tok(i, t):
    return OLD[i, t].item(), LOGP[i, t].item(), ADV[i, t].item()


def token_mean(f):
    return sum(f(i, t) for i, t in VALID) / len(VALID)


def seq_mean_token_mean(f):
    rows = sorted({i for i, _ in VALID})
    return sum(sum(f(i, t) for t in range(4) if M[i, t]) / int(M[i].sum()) for i in rows) / len(rows)


def vanilla_tok(i, t, el=0.2, eh=0.28, c=3.0):
    o, lp, a = tok(i, t)
    r = math.exp(lp - o)
    lc = max(-a * r, -a * min(max(r, 1 - el), 1 + eh))
    return min(lc, -a * c) if a < 0 else lc


def run(name, mode="token-mean", cfg=CFG, **kw):
    return get_policy_loss(name)(OLD, LOGP, ADV, M, mode, cfg, **kw)


def test_vanilla_and_metrics():
    loss, met = run("vanilla")
    assert loss.item() == pytest.approx(token_mean(vanilla_tok), rel=1e-12)
    clipped, lower = 0, 0
    for i, t in VALID:
        o, lp, a = tok(i, t)
        r = math.exp(lp - o)
        l1, l2 = -a * r, -a * min(max(r, 0.8), 1.28)
        clipped += l2 > l1
        lower += (max(l1, l2) > -a * 3.0) and a < 0
    assert met["pg_clipfrac"].item() == pytest.approx(clipped / len(VALID))
    assert met["pg_clipfrac_lower"].item() == pytest.approx(lower / len(VALID))
    assert met["ppo_kl"].item() == pytest.approx(sum(tok(i, t)[0] - tok(i, t)[1] for i, t in VALID) / len(VALID))


def test_vanilla_dual_clip_binds_and_validates_c():
    adv = torch.full_like(ADV, -1.0)
    logp = OLD + 2.0  # ratio e^2 ≈ 7.4 > c = 3
    loss, met = get_policy_loss("vanilla")(OLD, logp, adv, M, "token-mean", CFG)
    assert loss.item() == pytest.approx(3.0) and met["pg_clipfrac_lower"].item() == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run("vanilla", cfg={**CFG, "clip_ratio_c": 1.0})


def test_gspo_value_and_gradient():
    lp = LOGP.clone().requires_grad_()
    loss, _ = get_policy_loss("gspo")(OLD, lp, ADV, M, "token-sum", CFG)  # mode ignored

    def s(i):
        return sum(tok(i, t)[1] - tok(i, t)[0] for t in range(4) if M[i, t]) / int(M[i].sum())

    def f(i, t):
        a = ADV[i, t].item()
        r = math.exp(min(s(i), 10.0))
        return max(-a * r, -a * min(max(r, 0.8), 1.28))

    assert loss.item() == pytest.approx(seq_mean_token_mean(f), rel=1e-12)
    loss.backward()
    for i in range(3):
        for t in range(4):
            a, r, n = ADV[i, t].item(), math.exp(s(i)), int(M[i].sum())
            active = M[i, t] and not ((a > 0 and r > 1.28) or (a < 0 and r < 0.8))
            want = -a * r / n / 3 if active else 0.0  # d/dlogp_t of exp(logp − sg(logp) + sg(s)) = ratio
            assert lp.grad[i, t].item() == pytest.approx(want, abs=1e-12)


def test_sapo():
    def f(i, t):
        o, lp, a = tok(i, t)
        tau = 1.0 if a > 0 else 1.05
        return -(1 / (1 + math.exp(-tau * (math.exp(lp - o) - 1)))) * 4 / tau * a

    assert run("sapo", "token-sum")[0].item() == pytest.approx(seq_mean_token_mean(f), rel=1e-12)


def test_gpg_and_dro():
    assert run("gpg")[0].item() == pytest.approx(token_mean(lambda i, t: -tok(i, t)[1] * tok(i, t)[2]), rel=1e-12)

    def dro(i, t):
        o, lp, a = tok(i, t)
        return -(lp * a - 0.25 * (lp - o) ** 2)

    assert run("dro")[0].item() == pytest.approx(token_mean(dro), rel=1e-12)
    with pytest.raises(ValueError, match="dro_beta"):
        run("dro", cfg={**CFG, "dro_beta": None})


def test_cispo_value_and_stop_gradient():
    lp = LOGP.clone().requires_grad_()
    loss, met = get_policy_loss("cispo")(OLD, lp, ADV, M, "token-mean", CFG)

    def w(i, t):
        o, l_, _ = tok(i, t)
        return min(max(math.exp(l_ - o), 0.8), 1.28)

    assert loss.item() == pytest.approx(token_mean(lambda i, t: -w(i, t) * ADV[i, t].item() * LOGP[i, t].item()))
    loss.backward()
    for i in range(3):
        for t in range(4):
            want = -w(i, t) * ADV[i, t].item() / len(VALID) if M[i, t] else 0.0
            assert lp.grad[i, t].item() == pytest.approx(want, abs=1e-12)  # clipped tokens keep their gradient


def test_dppo_tv_and_kl():
    def tv(i, t):
        o, lp, a = tok(i, t)
        p, q = math.exp(lp), math.exp(o)
        valid = (p - q <= 0.28) if a > 0 else (p - q >= -0.2)
        return -a * min(math.exp(lp - o), 3.0) * lp * valid

    def kl(i, t):
        o, lp, a = tok(i, t)
        p, q = math.exp(lp), math.exp(o)
        b = q * (o - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
        valid = (b <= 0.28 or p <= q) if a > 0 else (b <= 0.2 or p >= q)
        return -a * min(math.exp(lp - o), 3.0) * lp * valid

    assert run("dppo_tv")[0].item() == pytest.approx(token_mean(tv), rel=1e-12)
    assert run("dppo_kl")[0].item() == pytest.approx(token_mean(kl), rel=1e-12)
    assert run("dppo_tv")[1]["pg_clipfrac"].item() > 0  # the 1.0 log-ratio step leaves the TV region


def test_kl_cov_top_k():
    vals = [(i, t) for i, t in VALID]
    a = [ADV[i, t].item() for i, t in vals]
    lp = [LOGP[i, t].item() for i, t in vals]
    ma, ml = sum(a) / len(a), sum(lp) / len(lp)
    cov = [(x - ma) * (y - ml) for x, y in zip(a, lp)]
    k = max(1, int(len(vals) * 0.2))
    top = sorted(range(len(vals)), key=lambda j: -cov[j])[:k]
    total = 0.0
    for j, (i, t) in enumerate(vals):
        o, l_, adv = tok(i, t)
        total += -adv * math.exp(l_ - o) + (0.1 * abs(l_ - o) if j in top else 0.0)
    loss, met = run("kl_cov")
    assert loss.item() == pytest.approx(total / len(vals), rel=1e-12)
    assert met["ppo_kl"].item() == pytest.approx(sum(abs(tok(i, t)[1] - tok(i, t)[0]) for i, t in vals) / len(vals))


def test_clip_cov_deterministic_when_all_candidates_chosen():
    cfg = {**CFG, "clip_cov_ratio": 1.0, "clip_cov_lb": -100.0, "clip_cov_ub": 100.0}
    loss, met = run("clip_cov", cfg=cfg)
    # every valid token not clipped by PPO gets corr = 0, so only PPO-clipped tokens keep their loss
    total, zeroed = 0.0, 0
    for i, t in VALID:
        o, lp, a = tok(i, t)
        r = math.exp(lp - o)
        l1, l2 = -a * r, -a * min(max(r, 0.8), 1.28)
        if l2 > l1:
            total += max(l1, l2)
        else:
            zeroed += 1
    assert loss.item() == pytest.approx(total / len(VALID), rel=1e-12)
    assert met["pg_clipfrac"].item() == pytest.approx(zeroed / len(VALID))
    torch.manual_seed(1)
    _, met = run("clip_cov", cfg={**cfg, "clip_cov_ratio": 0.1})  # k = 1 random token
    assert met["pg_clipfrac"].item() == pytest.approx(1 / len(VALID))


def test_geo_mean():
    def row(i):
        n = int(M[i].sum())
        s, abar = 0.0, 0.0
        for t in range(4):
            if M[i, t]:
                o, lp, a = tok(i, t)
                d = lp - o
                dc = min(max(d, -0.2), 0.28)
                sg = (a > 0) - (a < 0)
                s += sg * min(sg * d, sg * dc)
                abar += a
        return -abar / n * math.exp(s / n)

    m = M.clone()
    m[2] = 0  # fully masked row: contributes 0 but counts in the mean over B rows
    loss, _ = get_policy_loss("geo_mean")(OLD, LOGP, ADV, m, "token-mean", CFG)
    assert loss.item() == pytest.approx((row(0) + row(1)) / 3, rel=1e-12)
    loss_g, _ = get_policy_loss("geo_mean")(OLD, LOGP, ADV, M, "token-mean",
                                            {**CFG, "global_batch_info": {"global_batch_size": 6}})
    assert loss_g.item() == pytest.approx((row(0) + row(1) + row(2)) / 6, rel=1e-12)


def test_geo_mean_clipfrac_counts_clipped_tokens_with_nonzero_advantage():
    # on-policy (Δ = 0 everywhere): nothing is clipped, whatever the advantages
    adv = torch.tensor([[0.0, 1.0, -1.0, 0.0]])
    m = torch.ones(1, 4)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    _, met = get_policy_loss("geo_mean")(old, old.clone(), adv, m, "token-mean", CFG)
    assert float(met["pg_clipfrac"]) == 0.0
    # Δ = 0.5 > ε_h = 0.28 on every token: clipped where A > 0 (σΔc < σΔ); A < 0 keeps Δ; A = 0 is not counted
    _, met = get_policy_loss("geo_mean")(old, old + 0.5, adv, m, "token-mean", CFG)
    assert float(met["pg_clipfrac"]) == pytest.approx(1 / 4) and float(met["pg_clipfrac_lower"]) == 0.0


@pytest.mark.parametrize("name", registered("policy_loss"))
def test_every_loss_common_contract(name):
    # bypass_mode reads the rollout-correction settings (the others ignore the key)
    base = {**CFG, "clip_cov_ratio": 1.0, "rollout_correction": {"loss_type": "ppo_clip"}}
    loss, met = run(name, cfg=base)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} <= set(met)
    # float32 agrees with float64
    l32, _ = get_policy_loss(name)(OLD.float(), LOGP.float(), ADV.float(), M, "token-mean",
                                   base)
    assert l32.dtype == torch.float32 and l32.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    # fully masked row: loss equals the loss without that row (geo_mean counts rows, so only row sums)
    m = M.clone()
    m[2] = 0
    lp = LOGP.clone().requires_grad_()
    lm, _ = get_policy_loss(name)(OLD, lp, ADV, m, "token-mean", base)
    lm.backward()
    assert torch.all(lp.grad[2] == 0) and torch.isfinite(lm)
    # IS weights of 1 change nothing; all-masked batch is a clear error; inputs unchanged
    lw, _ = run(name, cfg=base, rollout_is_weights=torch.ones_like(LOGP))
    assert lw.item() == pytest.approx(loss.item(), rel=1e-9)
    with pytest.raises(ValueError, match="all-masked"):
        get_policy_loss(name)(OLD, LOGP, ADV, torch.zeros_like(M), "token-mean", base)
    # an empty DP shard with global counts is 0, not an error
    info = {"global_batch_info": {"dp_size": 2, "batch_num_tokens": 9, "global_batch_size": 6}}
    l0, _ = get_policy_loss(name)(OLD, LOGP, ADV, torch.zeros_like(M), "token-mean", {**base, **info})
    assert l0.item() == 0.0


def test_is_weights_scale_tokens_and_config_fallbacks():
    w = torch.full_like(LOGP, 0.5)
    assert run("vanilla", rollout_is_weights=w)[0].item() == pytest.approx(0.5 * run("vanilla")[0].item())
    loss, _ = get_policy_loss("vanilla")(OLD, LOGP, ADV, M, "token-mean", {})  # ActorConfig defaults
    assert loss.item() == pytest.approx(token_mean(lambda i, t: vanilla_tok(i, t, 0.2, 0.2, 3.0)), rel=1e-12)
    with pytest.raises(KeyError, match="registered: bypass_mode, cispo"):
        get_policy_loss("ppo")
