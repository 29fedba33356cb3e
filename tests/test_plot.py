"""Which curves `portrl plot` draws and what their legends say (portrl.trainer.plot.select_panels), on metrics.jsonl
files as runs write them: words, not metric keys; no critic panel without a critic; no curve hidden under an equal
one; no KL term that is 0 throughout. Pixels are not checked; the PNGs are checked to be written."""

from __future__ import annotations

from portrl.cli import main
from portrl.trainer.plot import select_panels
from portrl.trainer.tracking import Tracker, read_metrics

#: the tiny model and batch of tests/test_cli_commands.py
SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "trainer.progress_bar=false"]


def _write(run_dir, rows_by_step):
    with Tracker(run_dir, loggers=("jsonl",), progress_bar=False) as tr:
        for step, row in rows_by_step:
            tr.log(row, step=step)
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "step" in r]


def _drawn(rows):
    return {p.name: [s.label for s in p.series] for p in select_panels(rows)}


def _grpo_rows(steps=6):
    """A GRPO run on a 0/1 rule reward: score = reward = accuracy; KL loss on; on-policy, so the PPO KL is 0."""
    out = [(0, {"val/acc/mean": 0.5, "val/score/mean": 0.5, "val/response_length/mean": 3.0})]
    for s in range(1, steps + 1):
        acc = 0.4 + 0.03 * s
        out.append((s, {"critic/acc/mean": acc, "critic/score/mean": acc, "critic/rewards/mean": acc,
                        "actor/kl_loss": 0.01 * s, "actor/ppo_kl": 0.0, "actor/entropy": 0.4 - 0.01 * s,
                        "response_length/mean": 3.0 + 0.1 * s, "response_length/max": 4.0}))
        if s % 3 == 0:
            out.append((s, {"val/acc/mean": 0.5 + 0.02 * s, "val/score/mean": 0.5 + 0.02 * s,
                            "val/response_length/mean": 3.1}))
    return out


def test_grpo_run_on_a_rule_reward(tmp_path):
    drawn = _drawn(_write(tmp_path, _grpo_rows()))
    assert drawn == {
        "accuracy": ["training accuracy (= training reward)", "validation accuracy (= validation reward)"],
        "kl": ["policy to reference (KL loss)"],  # the PPO KL, 0 at every step, is left out
        "entropy": ["policy entropy on training responses"],
        "length": ["training mean", "training maximum", "validation mean"],
    }
    assert not any("/" in label for labels in drawn.values() for label in labels)  # no metric keys


def test_ppo_with_a_critic_a_kl_penalty_and_a_graded_reward(tmp_path):
    rows = []
    for s in range(1, 6):
        score = 0.3 + 0.05 * s
        rows.append((s, {"critic/acc/mean": 0.2 + 0.05 * s, "critic/score/mean": score,
                         "critic/rewards/mean": score - 0.01, "actor/reward_kl_penalty": 0.01 * s,
                         "actor/ppo_kl": 1e-3 * s, "actor/entropy": 0.5, "critic/vf_explained_var": 0.1 * s}))
    drawn = _drawn(_write(tmp_path, rows))
    assert list(drawn) == ["accuracy", "reward", "kl", "entropy", "critic"]
    assert drawn["accuracy"] == ["training accuracy"]
    assert drawn["reward"] == ["training reward", "training reward less the KL penalty"]
    assert drawn["kl"] == ["policy to reference (KL penalty in the reward)", "rollout policy to updated policy (PPO)"]
    assert drawn["critic"] == ["share of the returns' variance the critic explains"]


def test_equal_curves_are_drawn_once_but_a_zero_accuracy_is_drawn(tmp_path):
    rows = [(s, {"critic/acc/mean": 0.0, "critic/score/mean": 0.1 * s, "critic/rewards/mean": 0.1 * s,
                 "actor/kl_loss": 0.0, "actor/ppo_kl": 3e-8 * (-1) ** s}) for s in range(1, 5)]
    drawn = _drawn(_write(tmp_path, rows))
    # no KL panel (0 throughout, float noise included); the reward without a penalty is the score: drawn once,
    # and not called "less the KL penalty"; an accuracy of 0 at every step is the run's result: drawn
    assert drawn == {"accuracy": ["training accuracy"], "reward": ["training reward"]}


def test_a_real_run_plots_named_curves(tmp_path, capsys):
    """A two-step GRPO run of the built-in arith task (rule reward: accuracy = reward; KL loss on; on-policy)."""
    out = tmp_path / "run"
    assert main(["--log-level", "WARNING", "train", *SMALL, "model.sft_warm_start=false", "trainer.total_steps=2",
                 "trainer.test_freq=2", f"trainer.output_dir={out}"]) == 0
    drawn = _drawn([r for r in read_metrics(out / "metrics.jsonl") if "step" in r])
    assert drawn["accuracy"] == ["training accuracy (= training reward)", "validation accuracy (= validation reward)"]
    assert "reward" not in drawn and "critic" not in drawn
    assert "rollout policy to updated policy (PPO)" not in drawn.get("kl", [])
    assert drawn["entropy"] == ["policy entropy on training responses"]
    assert sorted(p.name for p in (out / "plots").iterdir()) == sorted([f"{n}.png" for n in drawn] + ["curves.png"])
    capsys.readouterr()
