"""verl's remaining estimators and losses (issue 18 item 5): grpo_vectorized, rloo_vectorized, gdpo,
tir_optimal_token_baseline, bypass_mode with compute_policy_loss_reinforce, PF-PPO. Hand references on small
tensors (the arithmetic in the comments), or an independent plain-Python loop where the case is larger; the
config checks; two training steps through the CLI for each new name that trains on the built-in task."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from portrl.algo import (compute_advantage, compute_policy_loss_reinforce, estimator_spec, get_policy_loss,
                         masked_whiten, pf_ppo_resample_indices, pf_ppo_weights)
from portrl.algo.advantages_tir import compute_multi_turn_optimal_token_baseline_advantage as tir
from portrl.algo.advantages_gdpo import reward_components
from portrl.cli import main
from portrl.config import ConfigError, compose

SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "model.sft_steps=4", "model.sft_batch_size=8", "trainer.progress_bar=false"]
FAST = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false", "model.sft_warm_start=false",
        "trainer.export_hf=false", "trainer.plot=false"]


def close(got: torch.Tensor, want, tol: float = 1e-6) -> None:
    """``got`` equals the nested list ``want`` to ``tol`` (absolute and relative)."""
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=tol, atol=tol)


def _outcome(scores, lengths, width=3):
    """(B,T) rewards with each score on its row's last valid token, and the mask."""
    mask = torch.zeros(len(scores), width)
    rewards = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


# ------------------------------------------------------------------------------ vectorized GRPO / RLOO
# groups: a = rows 0, 1, 3 with scores 1, 0, 0; b = row 2 alone with score 2; c = rows 4, 5, both 3
SCORES, INDEX = [1.0, 0.0, 2.0, 0.0, 3.0, 3.0], ["a", "a", "b", "a", "c", "c"]


def test_grpo_vectorized_hand_reference():
    rewards, mask = _outcome(SCORES, [3] * 6)
    adv, ret = compute_advantage("grpo_vectorized", token_level_rewards=rewards, response_mask=mask, index=INDEX)
    # group a: mean 1/3, unbiased var ((2/3)² + 2·(1/3)²)/2 = 1/3 -> std √(1/3); singleton b: mean 0, std 1;
    # group c: no spread -> exactly 0
    std = math.sqrt(1 / 3)
    want = [(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), 2 / (1 + 1e-6), (-1 / 3) / (std + 1e-6), 0.0, 0.0]
    assert adv[:, 0].tolist() == pytest.approx(want, rel=1e-6)
    assert torch.equal(adv, ret) and torch.all(adv == adv[:, :1])
    assert adv[4:].abs().sum() == 0
    flat, _ = compute_advantage("grpo_vectorized", token_level_rewards=rewards, response_mask=mask, index=INDEX,
                                norm_adv_by_std_in_grpo=False)
    # without std: s − mean; the singleton keeps its score
    assert flat[:, 0].tolist() == pytest.approx([2 / 3, -1 / 3, 2.0, -1 / 3, 0.0, 0.0], rel=1e-6)


def test_rloo_vectorized_hand_reference():
    rewards, mask = _outcome(SCORES, [3, 2, 3, 1, 3, 3])
    adv, _ = compute_advantage("rloo_vectorized", token_level_rewards=rewards, response_mask=mask, index=INDEX)
    # leave-one-out: row 0: 1 − mean(0, 0) = 1; rows 1, 3: 0 − mean(1, 0) = −0.5; row 2 alone keeps 2 (verl's rloo;
    # verl's rloo_vectorized gives 0 there); group c: 3 − 3 = 0. Broadcast over each row's mask.
    close(adv, [[1, 1, 1], [-0.5, -0.5, 0], [2, 2, 2], [-0.5, 0, 0], [0, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("loop, vectorized", [("grpo", "grpo_vectorized"), ("rloo", "rloo_vectorized")])
def test_vectorized_gives_the_loop_estimators_numbers(loop, vectorized):
    """Random batches with singletons, zero-spread groups and non-contiguous ids: float64 agrees to rounding,
    float32 (statistics in float64, cast once) to one unit in the last place."""
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        b = 12
        scores = (torch.randint(0, 3, (b,), generator=g).float() if seed % 2 else torch.rand(b, generator=g))
        lengths = torch.randint(1, 5, (b,), generator=g).tolist()
        rewards, mask = _outcome(scores.tolist(), lengths, width=4)
        index = [int(i) * 7 for i in torch.randint(0, 5, (b,), generator=g)]
        for dtype in (torch.float64, torch.float32):
            kw = dict(token_level_rewards=rewards.to(dtype), response_mask=mask, index=index)
            options = [{}] if loop == "rloo" else [{"norm_adv_by_std_in_grpo": True}, {"norm_adv_by_std_in_grpo": False}]
            for opt in options:
                want, _ = compute_advantage(loop, **kw, **opt)
                got, _ = compute_advantage(vectorized, **kw, **opt)
                assert got.dtype == want.dtype == dtype
                tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1.2e-7, atol=1.2e-7)
                torch.testing.assert_close(got, want, **tol)
                assert torch.equal(got == 0, want == 0)  # the exact zeros (zero spread, padding) are the same


# ---------------------------------------------------------------------------------------------- GDPO
def _whiten_loop(values, lengths):
    """Independent reference: the per-row values repeated over their tokens, whitened with the unbiased
    variance (masked_whiten's definition), as (rows x tokens) lists."""
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8)] * n for v, n in zip(values, lengths)]


def test_gdpo_normalises_each_component_then_whitens():
    # two prompts (p, q), two responses each; lengths 3, 2, 3, 3
    lengths = [3, 2, 3, 3]
    rewards, mask = _outcome([2.0, 0.0, 1.0, 2.0], lengths)  # the summed score (not used with components)
    fmt = torch.tensor([1.0, 0.0, 1.0, 1.0])
    correct = torch.tensor([1.0, 1.0, 0.0, 1.0])
    adv, ret = compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=["p", "p", "q", "q"],
                                 reward_components={"fmt": fmt, "correct": correct}, reward_weights=[1.0, 0.5])
    # GRPO of fmt: p = [1, 0]: mean 0.5, std √0.5 -> ±0.5/(√0.5 + 1e-6); q = [1, 1]: no spread -> 0
    # GRPO of correct: p = [1, 1] -> 0; q = [0, 1] -> ∓0.5/(√0.5 + 1e-6)
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    summed = [z, -z, 0.5 * -z, 0.5 * z]  # weights 1 and 0.5
    want = _whiten_loop(summed, lengths)
    for i, n in enumerate(lengths):
        assert adv[i, :n].tolist() == pytest.approx(want[i], rel=1e-6)
        assert adv[i, n:].abs().sum() == 0
    assert torch.equal(adv, ret)


def test_gdpo_without_components_is_whitened_grpo_and_rejects_bad_input():
    rewards, mask = _outcome([1.0, 0.0, 0.0, 1.0, 1.0], [3, 1, 2, 3, 2])
    index = [0, 0, 0, 1, 1]
    adv, _ = compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=index)
    grpo, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=index)
    torch.testing.assert_close(adv, masked_whiten(grpo, mask) * mask)
    # one weight per component
    with pytest.raises(ValueError, match="2 reward weights for 1 reward components"):
        compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=index,
                          reward_components={"a": [1, 0, 1, 0, 1]}, reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="'a' has 4 values for 5 rows"):
        compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=index,
                          reward_components={"a": [1, 0, 1, 0]})
    # an empty response's component does not count (verl places it on no token): it scores 0 in its group
    empty_mask = mask.clone()
    empty_mask[1] = 0
    a1, _ = compute_advantage("gdpo", token_level_rewards=rewards * empty_mask, response_mask=empty_mask, index=index,
                              reward_components={"a": [1.0, 5.0, 0.0, 1.0, 0.0]})
    a0, _ = compute_advantage("gdpo", token_level_rewards=rewards * empty_mask, response_mask=empty_mask, index=index,
                              reward_components={"a": [1.0, 0.0, 0.0, 1.0, 0.0]})
    assert torch.equal(a1, a0)


def test_gdpo_components_come_from_the_reward_extras():
    algorithm = OmegaConf.create({"gdpo_reward_keys": ["fmt", "correct"]})
    tensors = {"reward_extra/fmt": torch.tensor([1.0, 0.0]), "reward_extra/correct": torch.tensor([0.0, 1.0]),
               "reward_extra/other": torch.tensor([3.0, 3.0])}
    comps = reward_components(algorithm, tensors)
    assert list(comps) == ["fmt", "correct"] and comps["correct"].tolist() == [0.0, 1.0]
    assert reward_components(OmegaConf.create({"gdpo_reward_keys": None}), tensors) is None
    with pytest.raises(ValueError, match=r"\['missing'\] are not numeric values .* it returned: correct, fmt, other"):
        reward_components(OmegaConf.create({"gdpo_reward_keys": ["fmt", "missing"]}), tensors)


# ------------------------------------------------------------------------------- TIR optimal token baseline
def _tir_loop(rewards, mask, index, old, spi, zero_tail=True, eps=1e-8):
    """Independent reference in plain Python: per row, the returns and cumulative weights at its valid tokens;
    per group of non-empty rows, the baseline at the k-th valid token over the rows that have one."""
    rows = []
    for i in range(len(mask)):
        pos = [t for t in range(len(mask[i])) if mask[i][t]]
        g = [sum(rewards[i][u] for u in pos if u >= t) for t in pos]
        w, run = [], 0.0
        for t in pos:
            run += 1 - 2 * math.exp(old[i][t]) + spi[i][t]
            w.append(run)
        rows.append((pos, g, w))
    adv = [[0.0] * len(mask[0]) for _ in mask]
    groups = {}
    for i, gid in enumerate(index):
        if rows[i][0]:
            groups.setdefault(gid, []).append(i)
    for members in groups.values():
        for i in members:
            pos, g, w = rows[i]
            others = sorted((len(rows[j][0]) for j in members if j != i), reverse=True)
            for k, t in enumerate(pos):
                if len(members) < 2:
                    b = 0.0
                elif zero_tail and others and len(pos) > others[0] and k >= others[0]:
                    b = 0.0  # the strictly longest row, past every other row's length
                else:
                    num = sum(rows[j][1][k] * rows[j][2][k] for j in members if len(rows[j][0]) > k)
                    den = sum(rows[j][2][k] for j in members if len(rows[j][0]) > k)
                    b = num / (den + eps)
                adv[i][t] = g[k] - b
    return adv


def test_tir_optimal_token_baseline_hand_reference():
    # one group of two rows; row 0 has a hole at t=1 (a tool output), row 1 is a plain 3-token response.
    # old prob 0.5 and Σπ² = 0.5 everywhere: w = 1 − 2·0.5 + 0.5 = 0.5 per valid token, so the cumulative
    # weights at the k-th valid token are 0.5, 1.0, 1.5 in both rows. Row 0 scores 1, row 1 scores 0:
    # returns at the valid tokens 1, 1, 1 and 0, 0, 0; baseline (1·W + 0·W)/(2W) = 0.5 at every k.
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.full((2, 4), math.log(0.5), dtype=torch.float64)
    spi = torch.full((2, 4), 0.5, dtype=torch.float64)
    adv, ret = compute_advantage("tir_optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                                 index=[0, 0], old_log_probs=old, sum_pi_squared=spi)
    close(adv, [[0.5, 0.0, 0.5, 0.5], [-0.5, -0.5, -0.5, 0.0]], 1e-8)
    assert ret.tolist() == [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    # optimal_token_baseline aligns by position instead: at t=1 only row 1 is valid, so its baseline there is
    # its own return (0) and its advantage 0, not −0.5
    otb, _ = compute_advantage("optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                               index=[0, 0], old_log_probs=old, sum_pi_squared=spi)
    assert otb[1, 1].item() == pytest.approx(0.0, abs=1e-8)


def test_tir_optimal_token_baseline_against_a_loop_and_otb():
    g = torch.Generator().manual_seed(3)
    b, t = 8, 6
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    mask[5] = 0  # an empty row takes no part in its group
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64) * mask
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    spi = 0.2 + 0.6 * torch.rand(b, t, generator=g, dtype=torch.float64)
    index = [0, 0, 0, 1, 1, 1, 2, 3]
    adv, _ = compute_advantage("tir_optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                               index=index, old_log_probs=old, sum_pi_squared=spi)  # handle_zero_tail on (verl's)
    close(adv, _tir_loop(rewards.tolist(), mask.tolist(), index, old.tolist(), spi.tolist(), zero_tail=True), 1e-10)
    no_tail, _ = tir(rewards, mask, index, old, spi, handle_zero_tail=False)
    close(no_tail, _tir_loop(rewards.tolist(), mask.tolist(), index, old.tolist(), spi.tolist(), zero_tail=False), 1e-10)
    assert not torch.equal(adv, no_tail)  # this batch has a strictly longest row in some group
    # without holes (every mask a prefix) it is exactly optimal_token_baseline
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    prefix = (torch.arange(t)[None, :] < lengths[:, None]).double()
    kw = dict(token_level_rewards=rewards * prefix, response_mask=prefix, index=index, old_log_probs=old,
              sum_pi_squared=spi)
    a, r = compute_advantage("tir_optimal_token_baseline", **kw)
    o, r2 = compute_advantage("optimal_token_baseline", **kw)
    torch.testing.assert_close(a, o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r, r2)
    spec = estimator_spec("tir_optimal_token_baseline")
    assert spec.needs_old_log_probs and spec.needs_sum_pi_squared and spec.per_token_rewards and not spec.needs_critic


# ------------------------------------------------------------------------------- bypass mode, REINFORCE
LOGP = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-1.2, -0.5], [-1.0, -0.2]], dtype=torch.float64)
ADV = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_reinforce_loss_hand_reference():
    lp = LOGP.clone().requires_grad_()
    loss, met = compute_policy_loss_reinforce(ROLLOUT, lp, ADV, MASK)
    # ℓ = −A·logp: row 0: 1·1 + 1·0.5 = 1.5 (token sum); row 1: −(−2)(−2) = −4 (t=1 masked);
    # seq-mean-token-sum: (1.5 − 4)/2 = −1.25
    assert loss.item() == pytest.approx(-1.25)
    loss.backward()
    close(lp.grad, [[-0.5, -0.5], [1.0, 0.0]])  # −A/2 on valid tokens
    # ppo_kl = mean(rollout − logp) over valid tokens: (−0.2 + 0 + 1)/3
    assert float(met["ppo_kl"]) == pytest.approx(0.8 / 3)
    w = torch.tensor([[2.0, 1.0], [0.5, 1.0]], dtype=torch.float64)
    lw, _ = compute_policy_loss_reinforce(ROLLOUT, LOGP, ADV, MASK, "token-mean", rollout_is_weights=w)
    # token-mean of −A·logp·w: (2·1 + 0.5 − 4·0.5)/3 = 0.5/3
    assert lw.item() == pytest.approx(0.5 / 3)


def _bypass_cfg(loss_type, rollout_is=None, threshold=2.0):
    return {"clip_ratio": 0.2, "rollout_correction": {"loss_type": loss_type, "rollout_is": rollout_is,
                                                      "rollout_is_threshold": threshold}}


def test_bypass_mode_ppo_clip_is_vanilla_against_the_rollout_policy():
    for level in (None, "token"):
        loss, met = get_policy_loss("bypass_mode")(ROLLOUT, LOGP, ADV, MASK, "token-mean", _bypass_cfg("ppo_clip", level))
        want, _ = get_policy_loss("vanilla")(ROLLOUT, LOGP, ADV, MASK, "token-mean", {"clip_ratio": 0.2})
        assert loss.item() == want.item()  # no IS weights on top of the ratio, even with rollout_is set
    # the IS weights are then only a metric: min(exp(logp − rollout), 2) = e^0.2, e^0, e^-1 on the valid tokens
    assert float(met["rollout_corr/is_weight_mean"]) == pytest.approx((math.exp(0.2) + 1 + math.exp(-1)) / 3)
    # every log-ratio 1: e^1 = 2.718 truncated at 2
    _, met = get_policy_loss("bypass_mode")(ROLLOUT, ROLLOUT + 1.0, ADV, MASK, "token-mean",
                                            _bypass_cfg("ppo_clip", "token", threshold=2.0))
    assert float(met["rollout_corr/is_weight_mean"]) == pytest.approx(2.0)


def test_bypass_mode_reinforce_uses_truncated_is_weights():
    lp = LOGP.clone().requires_grad_()
    loss, _ = get_policy_loss("bypass_mode")(ROLLOUT, lp, ADV, MASK, "token-mean", _bypass_cfg("reinforce", "token"))
    # w = min(exp(logp − rollout), 2), detached: row 0: e^0.2, e^0 = 1; row 1: min(e^-1, 2) = e^-1 (t=1 masked)
    w = [[math.exp(0.2), 1.0], [math.exp(-1.0), 0.0]]
    want = sum(-ADV[i, t].item() * LOGP[i, t].item() * w[i][t] for i in range(2) for t in range(2)) / 3
    assert loss.item() == pytest.approx(want)
    loss.backward()  # the weight is a constant: ∂ℓ/∂logp = −A·w/3
    close(lp.grad, [[-ADV[i, t].item() * w[i][t] / 3 for t in range(2)] for i in range(2)])
    # sequence level: one weight per row, exp(Σ valid log-ratios) truncated: row 0 e^0.2, row 1 e^-1
    seq, _ = get_policy_loss("bypass_mode")(ROLLOUT, LOGP, ADV, MASK, "token-mean",
                                            _bypass_cfg("reinforce", "sequence"))
    assert seq.item() == pytest.approx((1.0 * math.exp(0.2) + 0.5 * math.exp(0.2) - 4 * math.exp(-1.0)) / 3)
    # no rollout_is: plain REINFORCE
    plain, _ = get_policy_loss("bypass_mode")(ROLLOUT, LOGP, ADV, MASK, "token-mean", _bypass_cfg("reinforce"))
    assert plain.item() == pytest.approx((1.0 + 0.5 - 4.0) / 3)


def test_bypass_mode_needs_its_settings():
    with pytest.raises(ValueError, match="no rollout_correction"):
        get_policy_loss("bypass_mode")(ROLLOUT, LOGP, ADV, MASK, "token-mean", {"clip_ratio": 0.2})
    with pytest.raises(ValueError, match="loss_type 'ppo' is unknown; valid: \\['ppo_clip', 'reinforce'\\]"):
        get_policy_loss("bypass_mode")(ROLLOUT, LOGP, ADV, MASK, "token-mean", _bypass_cfg("ppo"))


# ---------------------------------------------------------------------------------------------- PF-PPO
def test_pf_ppo_weights_hand_reference():
    scores = torch.tensor([0.0, 1.0, -2.0, 0.5])
    assert pf_ppo_weights(scores, "pow", 2.0).tolist() == pytest.approx([1e-8, 1 + 1e-8, 4 + 1e-8, 0.25 + 1e-8])
    # max 1.0 (row 1) and min −2.0 (row 2) get 1, the others 0 (then + 1e-8)
    assert pf_ppo_weights(scores, "max_min").tolist() == pytest.approx([1e-8, 1 + 1e-8, 1 + 1e-8, 1e-8])
    assert pf_ppo_weights(scores, "max_random").tolist() == pytest.approx([0.1, 0.4, 0.1, 0.1])
    with pytest.raises(ValueError, match="reweight_method 'top' is unknown"):
        pf_ppo_weights(scores, "top")


def test_pf_ppo_resampling_follows_the_weights_and_the_seed():
    scores = torch.tensor([0.0, 1.0, 2.0] * 400)  # pow 2: weights ~0, 1, 4
    idx = pf_ppo_resample_indices(scores, "pow", 2.0, seed=5)
    assert idx.shape == (1200,) and torch.equal(idx, pf_ppo_resample_indices(scores, "pow", 2.0, seed=5))
    picked = scores[idx]
    assert int((picked == 0).sum()) == 0  # probability 1e-8 per row
    share = float((picked == 2).float().mean())
    assert abs(share - 0.8) < 0.05  # 4/(1+4), 1200 draws: 4.3 standard deviations of slack


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("over, message", [
    (["algorithm.gdpo_reward_keys=[fmt]"], "algorithm.gdpo_reward_keys only applies to the estimators that take it "
                                           "(gdpo), not 'grpo'"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,fmt]"], "must be a non-empty list of distinct"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_weights=[1.0]"], "gdpo_reward_keys is null"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
     "has 1 entries for 2 gdpo_reward_keys"),
    (["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss.loss_mode=gspo"],
     "actor.policy_loss.loss_mode='gspo' would not be used"),
    (["actor.policy_loss.loss_mode=bypass_mode"], "needs algorithm.rollout_correction.bypass_mode=true"),
    (["algorithm.rollout_correction.loss_type=reinforce"], "only applies with algorithm.rollout_correction.bypass_mode"),
    (["algorithm.rollout_correction.loss_type=pg"], "algorithm.rollout_correction.loss_type='pg' is not one of"),
    (["algorithm.pf_ppo.reweight_method=top"], "algorithm.pf_ppo.reweight_method='top' is not one of 'pow'"),
    (["algorithm.pf_ppo.weight_pow=-1"], "algorithm.pf_ppo.weight_pow=-1.0 must be >= 0"),
    (["algorithm=online_dpo", "algorithm.use_pf_ppo=true"], "breaks the response pairs"),
    (["algorithm.adv_estimator=tir_optimal_token_baseline", "algorithm.rollout_correction.bypass_mode=true"],
     "which algorithm.rollout_correction.bypass_mode=true skips"),
])
def test_config_checks_of_the_new_keys(over, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides=over)
    assert message in str(e.value)


def test_valid_configs_of_the_new_keys_compose():
    cfg = compose(overrides=["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,correct]",
                             "algorithm.gdpo_reward_weights=[1.0,0.5]", "algorithm.rollout_correction.bypass_mode=true",
                             "algorithm.rollout_correction.loss_type=reinforce", "algorithm.use_pf_ppo=true",
                             "algorithm.pf_ppo.reweight_method=max_min"])
    assert list(cfg.algorithm.gdpo_reward_keys) == ["fmt", "correct"] and cfg.algorithm.pf_ppo.weight_pow == 2.0


# --------------------------------------------------------------------------------------- two CLI steps
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = float(solution_str.strip() == str(ground_truth).strip())
    fmt = float(solution_str.strip().isdigit())
    return {"score": correct + 0.1 * fmt, "correct": correct, "fmt": fmt}
'''


@pytest.mark.parametrize("case", [
    ["algorithm.adv_estimator=grpo_vectorized"],
    ["algorithm.adv_estimator=rloo_vectorized"],
    ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[correct,fmt]", "algorithm.gdpo_reward_weights=[1.0,0.5]",
     "reward.custom.path={reward}"],
    ["algorithm.rollout_correction.bypass_mode=true", "actor.ppo_epochs=2"],
    ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
     "algorithm.rollout_correction.rollout_is=token"],
    ["algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_random"],
    ["actor.ppo_epochs=2"],  # the control of bypass mode: two epochs need the old-log-prob forward
], ids=["grpo_vectorized", "rloo_vectorized", "gdpo", "bypass_ppo_clip", "bypass_reinforce", "pf_ppo", "control"])
def test_two_steps_through_the_cli(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    out = tmp_path / "run"
    argv = ["--log-level", "WARNING", "train", *SMALL, *FAST, *[c.format(reward=reward) for c in case],
            f"trainer.output_dir={out}"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in steps)
    # the rollout's log-probs stand in for the old policy: no extra forward in bypass mode
    assert ("timing_s/old_log_prob" in steps[0]) == (case == ["actor.ppo_epochs=2"])
    if "rollout_is=token" in " ".join(case):
        assert "rollout_corr/is_weight_mean" in steps[0]
