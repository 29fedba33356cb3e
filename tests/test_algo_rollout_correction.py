"""Rollout correction (portrl.algo.rollout_correction): truncated IS weights against hand references, the
rollout-vs-trainer gap metrics, and the actor logging a gap that grows when the engine's weights are stale."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from portrl.algo.rollout_correction import rollout_diff_stats, rollout_is_weights

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.2, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_weights_by_hand():
    w = rollout_is_weights(OLD, ROLLOUT, MASK, "token", threshold=1.5)
    want = torch.tensor([[min(math.exp(0.5), 1.5), math.exp(-1.0), 1.0], [1.0, math.exp(-2.8), 0.0]])
    torch.testing.assert_close(w, want)


def test_sequence_weights_by_hand():
    w = rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", threshold=10.0)
    r0, r1 = math.exp(0.5 - 1.0 + 0.0), math.exp(0.0 - 2.8)  # products over each row's response tokens
    torch.testing.assert_close(w, torch.tensor([[r0, r0, r0], [r1, r1, 0.0]]))
    assert float(rollout_is_weights(OLD + 100, ROLLOUT, MASK, "sequence", threshold=1e30).max()) == \
        pytest.approx(math.exp(20.0), rel=1e-5)  # the safety bound


def test_bad_level_or_threshold():
    with pytest.raises(ValueError, match="token"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "geometric")
    with pytest.raises(ValueError, match="> 0"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "token", threshold=0.0)


def test_diff_stats_by_hand():
    s = rollout_diff_stats(OLD, ROLLOUT, MASK)
    dl = [0.5, 1.0, 0.0, 0.0, 2.8]
    dp = [abs(math.exp(-1.0) - math.exp(-1.5)), abs(math.exp(-2.0) - math.exp(-1.0)), 0.0, 0.0,
          abs(math.exp(-3.0) - math.exp(-0.2))]
    assert s["tokens"] == 5 and s["log_probs_sum"] == pytest.approx(sum(dl)) and s["log_probs_max"] == pytest.approx(2.8)
    assert s["probs_sum"] == pytest.approx(sum(dp), rel=1e-6) and s["probs_max"] == pytest.approx(max(dp), rel=1e-6)


def _actor(path, **over):
    from portrl.config.options_schema import default_config
    from portrl.workers.actor import ActorRolloutWorker

    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "rollout.n": 4,
                 "data.max_response_length": 6, "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 5e-2, **over}.items():
        OmegaConf.update(cfg, k, v)
    return ActorRolloutWorker(cfg)


def _rollout(worker, seed):
    prompts = [worker.tokenizer(f"{i}+{i}=")["input_ids"] for i in range(4)]
    b = worker.generate(prompts, {"n": 4, "temperature": 1.0, "max_new_tokens": 6, "seed": seed},
                        meta={"uid": [f"p{i}" for i in range(4)]})
    b["advantages"] = torch.randn(b["response_mask"].shape, generator=torch.Generator().manual_seed(seed)) \
        * b["response_mask"]
    return b


def test_actor_logs_the_gap_and_it_grows_on_stale_rollouts(tiny_model):
    a = _actor(tiny_model)
    fresh = _rollout(a, 1)
    m = a.update_actor(fresh)  # the hf engine shares the module: the gap is float noise
    assert m["training/rollout_log_probs_diff_max"] < 1e-4 and m["training/rollout_probs_diff_mean"] < 1e-5
    stale = _rollout(a, 2)
    a.update_actor(_rollout(a, 3))  # the policy moves after `stale` was sampled: as if a weight sync was missed
    m = a.update_actor(stale)
    assert m["training/rollout_log_probs_diff_max"] > 1e-2 and m["training/rollout_probs_diff_mean"] > 1e-4


def test_token_is_weights_change_the_update_only_off_policy(tiny_model):
    def run(**over):
        a = _actor(tiny_model, **over)
        stale = _rollout(a, 2)
        a.update_actor(_rollout(a, 3))
        m = a.update_actor(stale)
        return m, torch.cat([p.detach().flatten() for p in a.module.parameters()])

    m0, w0 = run()
    m1, w1 = run(**{"algorithm.rollout_correction.rollout_is": "token",
                    "algorithm.rollout_correction.rollout_is_threshold": 2.0})
    assert "rollout_corr/is_weight_mean" in m1 and m1["rollout_corr/is_weight_mean"] != pytest.approx(1.0, abs=1e-4)
    assert not torch.equal(w0, w1)
    a = _actor(tiny_model, **{"algorithm.rollout_correction.rollout_is": "token"})
    assert a.update_actor(_rollout(a, 1))["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy
