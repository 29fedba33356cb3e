"""The RL loop end to end on a tiny model: GRPO raises the arith reward; PPO with a critic runs;
dynamic sampling and the preference objectives run; the summary and metrics have verl's names."""

import json
import math

import pytest
from omegaconf import OmegaConf

from portrl.config.schema import default_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from portrl.models import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.2))


def _cfg(model, out, **over):
    cfg = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "model.path": model, "trainer.output_dir": str(out),
            "data.arith.num_train": 64, "data.arith.num_test": 8, "data.train_batch_size": 4,
            "data.max_response_length": 5, "rollout.n": 4, "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 1e-3,
            "trainer.total_steps": 2, "trainer.test_freq": 2, "trainer.progress_bar": False,
            "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.save_final": False}
    base.update(over)
    for k, v in base.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_run_summary_metrics_and_export(tiny_model, tmp_path, monkeypatch):
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    s = run_training(_cfg(tiny_model, tmp_path / "run", **{"trainer.export_hf": True}))
    assert s["steps"] == 2 and s["val_after"] is not None and (tmp_path / "run" / "hf_model" / "config.json").is_file()
    rows = _rows(tmp_path / "run")
    step = rows[-1]
    for key in ("critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
                "response_length/clip_ratio", "actor/entropy", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                "actor/grad_norm", "actor/lr", "timing_s/gen", "timing_s/reward", "timing_s/adv",
                "timing_s/update_actor", "timing_s/sync", "timing_s/step", "perf/tokens_per_s", "val/acc/arith",
                "val/acc/mean", "critic/acc/arith"):
        assert key in step, key
    assert "timing_s/old_log_prob" not in step and "timing_s/ref" not in step  # on-policy, no KL: skipped
    assert all(math.isfinite(v) for v in step.values() if isinstance(v, float))


def test_ppo_with_critic_kl_in_reward_runs(tiny_model, tmp_path, monkeypatch):
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    run_training(_cfg(tiny_model, tmp_path / "run", **{
        "algorithm.adv_estimator": "gae", "algorithm.lam": 0.95, "algorithm.use_kl_in_reward": True,
        "actor.ppo_epochs": 2, "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size_per_device": 3,
        "critic.optim.lr": 1e-3}))
    step = _rows(tmp_path / "run")[-1]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/returns/mean",
                "timing_s/update_critic", "timing_s/old_log_prob", "timing_s/ref", "actor/reward_kl_penalty"):
        assert key in step and math.isfinite(step[key]), key


@pytest.mark.parametrize("over", [
    {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": 2,
     "actor.clip_ratio_high": 0.28, "actor.loss_agg_mode": "token-mean", "reward.overlong_buffer.enable": True,
     "reward.overlong_buffer.len": 2},
    {"algorithm.objective": "sppo", "actor.use_kl_loss": True},
    {"algorithm.objective": "dpo"},
    {"algorithm.adv_estimator": "remax"},
    {"algorithm.adv_estimator": "vapo_gae", "algorithm.lam_critic": 1.0, "algorithm.vapo_alpha": 0.05,
     "actor.positive_lm_coef": 0.1, "critic.warmup_steps": 1},
], ids=["dapo", "sppo", "dpo", "remax", "vapo"])
def test_algorithm_variants_run(tiny_model, tmp_path, monkeypatch, over):
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    run_training(_cfg(tiny_model, tmp_path / "run", **{"trainer.test_freq": 0, "trainer.val_before_train": False,
                                                       **over}))
    rows = _rows(tmp_path / "run")
    assert len(rows) == 2
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))


@pytest.mark.slow
def test_grpo_raises_the_arith_reward(tmp_path, monkeypatch):
    """Warm start (SFT) then GRPO on a few fixed prompts: the training reward of the last steps beats the first."""
    from portrl.models import write_tiny_model
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    model = str(write_tiny_model(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=128, seed=0))
    cfg = _cfg(model, tmp_path / "run", **{
        "model.sft_warm_start": True, "model.sft_steps": 400, "model.sft_lr": 3e-3, "model.sft_batch_size": 64,
        "data.arith.num_train": 8, "data.train_batch_size": 8, "rollout.n": 8, "actor.ppo_mini_batch_size": 8,
        "actor.optim.lr": 5e-4, "trainer.total_steps": 40, "trainer.test_freq": 0, "trainer.val_before_train": False})
    run_training(cfg)
    scores = [r["critic/score/mean"] for r in _rows(tmp_path / "run")]
    first, last = sum(scores[:8]) / 8, sum(scores[-8:]) / 8
    assert last > first + 0.1, scores
