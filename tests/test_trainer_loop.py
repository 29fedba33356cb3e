"""The RL loop end to end on a tiny model: GRPO raises the arith reward; PPO with a critic runs;
dynamic sampling and the preference objectives run; the summary and metrics have verl's names; value
pretraining (critic.pretrain_steps) trains the critic alone before step 1."""

import json
import math

import pytest
from omegaconf import OmegaConf

from portrl.config.options_schema import default_config


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


def test_a_resumed_run_summarises_the_whole_run(tiny_model, tmp_path, monkeypatch):
    """Re-launching a run resumes it; its summary's accuracy before / after and tokens/s come from the whole run
    (metrics.jsonl), not only from the steps this process ran."""
    from portrl.cli.train import format_summary
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    over = {"trainer.save_freq": 1, "trainer.test_freq": 1, "trainer.resume": "auto"}
    first = run_training(_cfg(tiny_model, tmp_path / "run", **over))
    finished = run_training(_cfg(tiny_model, tmp_path / "run", **over))  # nothing left to run
    assert "resumed_from" in finished and finished["steps"] == 2
    assert f"resumed from       {finished['resumed_from']}" in format_summary(finished)
    for key in ("val_before", "val_after", "tokens_per_s"):
        assert first[key] is not None and finished[key] == first[key], key
    rows = _rows(tmp_path / "run")
    assert first["val_before"] == rows[0]["val/acc/mean"] and first["val_after"] == rows[-1]["val/acc/mean"]


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


def _parity_reward(tmp_path):
    """A reward that varies between responses even for an untrained model (the explained variance needs it)."""
    path = tmp_path / "parity_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(sum(map(ord, solution_str)) % 2)\n")
    return str(path)


def _pretrain_cfg(model, tmp_path, **over):
    return _cfg(model, tmp_path / "run", **{
        "algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3, "critic.optim.scheduler": "cosine",
        "reward.custom.path": _parity_reward(tmp_path), "trainer.test_freq": 0, "trainer.val_before_train": False,
        **over})


def test_value_pretraining_trains_the_critic_alone(tiny_model, tmp_path):
    """Pretraining steps move the critic (and its explained variance is reported) but not the actor, the
    critic's LR schedule or the RL step count; the run then trains its own total_steps."""
    import torch

    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer
    from portrl.trainer.value_pretrain import pretrain_critic

    trainer = RLTrainer(settle_config(_pretrain_cfg(tiny_model, tmp_path, **{"critic.pretrain_steps": 3})))
    actor0 = {k: v.clone() for k, v in trainer.actor.rank0("state_dict")["model"].items()}
    critic0 = trainer.critic.rank0("state_dict")
    heads0 = {k: v.clone() for k, v in critic0["model"].items()}
    out = pretrain_critic(trainer.cfg, trainer.critic, trainer._rollout)
    assert out["critic/pretrain_steps"] == 3 and math.isfinite(out["critic/pretrain_ev"])
    actor1 = trainer.actor.rank0("state_dict")["model"]
    assert all(torch.equal(actor0[k], actor1[k]) for k in actor0)
    critic1 = trainer.critic.rank0("state_dict")
    assert not torch.equal(heads0["value_head.weight"], critic1["model"]["value_head.weight"])
    assert critic1["scheduler"]["last_epoch"] == critic0["scheduler"]["last_epoch"]
    assert trainer.global_step == 0


def test_value_pretraining_in_a_run_stops_at_the_target(tiny_model, tmp_path):
    """fit() pretrains before step 1 and reports it; a reached target stops it after one full window."""
    from portrl.cli.train import format_summary
    from portrl.trainer import run_training
    from portrl.trainer.value_pretrain import PRETRAIN_EV_WINDOW

    s = run_training(_pretrain_cfg(tiny_model, tmp_path, **{"critic.pretrain_steps": 50,
                                                              "critic.pretrain_target_ev": -1e9}))
    assert s["critic/pretrain_steps"] == PRETRAIN_EV_WINDOW and s["steps"] == 2
    assert f"value pretraining  {PRETRAIN_EV_WINDOW} steps, explained variance" in format_summary(s)
    rows = _rows(tmp_path / "run")
    assert len(rows) == 2 and all(math.isfinite(r["critic/vf_explained_var"]) for r in rows)



def test_a_resumed_run_does_not_pretrain_again(tiny_model, tmp_path):
    """The critic of a resumed run comes from its checkpoint: no second pretraining."""
    from portrl.trainer import run_training

    over = {"critic.pretrain_steps": 2, "trainer.total_steps": 1, "trainer.save_freq": 1, "trainer.resume": "auto"}
    assert run_training(_pretrain_cfg(tiny_model, tmp_path, **over))["critic/pretrain_steps"] == 2
    resumed = run_training(_pretrain_cfg(tiny_model, tmp_path, **{**over, "trainer.total_steps": 2}))
    assert "resumed_from" in resumed and "critic/pretrain_steps" not in resumed and resumed["steps"] == 2

def test_value_pretraining_config_errors():
    from portrl.config import ConfigError, compose

    with pytest.raises(ConfigError, match="critic.pretrain_steps=-1 must be >= 0"):
        compose(algorithm="ppo", overrides=["critic.pretrain_steps=-1"])
    with pytest.raises(ConfigError, match="critic.pretrain_target_ev=0.5 needs critic.pretrain_steps > 0"):
        compose(algorithm="ppo", overrides=["critic.pretrain_target_ev=0.5"])
    with pytest.raises(ConfigError, match="critic.pretrain_target_ev=1.0 needs"):
        compose(algorithm="ppo", overrides=["critic.pretrain_steps=10", "critic.pretrain_target_ev=1.0"])
    with pytest.raises(ConfigError, match="critic.pretrain_steps=10 pretrains a critic, but none runs"):
        compose(algorithm="grpo", overrides=["critic.pretrain_steps=10"])
    compose(algorithm="ppo", overrides=["critic.pretrain_steps=10", "critic.pretrain_target_ev=0.4"])
