"""The default preset (GRPO) learns the word-problem task (portrl.data.wordprob) with the default tiny model: after
the tiny preset's SFT warm start the validation accuracy is well above 0 and below ~70 %, and a short GRPO run
raises it."""

from __future__ import annotations

import pytest

from portrl.config.composition import compose


# slow: an SFT warm start of the tiny model on answers of ~55 tokens (hundreds of steps of 64 examples) and 15 GRPO
# steps of 16 prompts x 8 samples with validation on 200 problems: minutes on two cores, not seconds
@pytest.mark.slow
def test_grpo_raises_wordprob_accuracy_after_the_warm_start(tmp_path, monkeypatch):
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    cfg = compose(device="cpu", data="wordprob", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=15", "trainer.test_freq=15",
        "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "trainer.seed=0", "device.num_threads=2",
        "trainer.loggers=[jsonl]", "trainer.progress_bar=false", "trainer.plot=false", "trainer.save_final=false",
        "trainer.export_hf=false"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.model.sft_warm_start  # the defaults: GRPO, the warm start
    summary = run_training(cfg)
    before, after = summary["val_before_rl"], summary["val_after"]
    assert summary["val_before"] == 0.0  # the untrained model solves nothing
    assert 0.15 <= before <= 0.7, summary
    assert after >= before + 0.03, summary


# ------------------------------------------------------------------ benchmarks/learning_table.py, its pieces
def _bench():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import learning_table  # noqa: PLC0415

    return learning_table


def test_learning_table_command_line():
    lt = _bench()
    args = lt.parse_args(["out"])
    assert args.presets == lt.PRESETS and "vapo" in args.presets and "grpo" in args.presets
    assert args.tasks == ["arith", "wordprob"] and args.steps == 30
    some = lt.parse_args(["out", "--presets", "grpo, vapo", "--tasks", "wordprob", "--steps", "5"])
    assert some.presets == ["grpo", "vapo"] and some.tasks == ["wordprob"] and some.steps == 5
    overrides = lt.train_overrides(some, "vapo", "wordprob", "/m", __import__("pathlib").Path("/r"))
    assert {"algorithm=vapo", "data=wordprob", "model.path=/m", "model.sft_warm_start=false",
            "trainer.total_steps=5", "trainer.test_freq=5", "trainer.val_before_train=true"} <= set(overrides)


@pytest.mark.parametrize("argv, words", [
    (["out", "--presets", "grpo,nope"], "--presets: unknown nope; valid: dapo"),
    (["out", "--tasks", "gsm8k"], "--tasks: unknown gsm8k; valid: arith, wordprob"),
    (["out", "--steps", "0"], "--steps, --prompts and --threads must be >= 1"),
])
def test_learning_table_bad_options_exit_2_with_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        _bench().parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and words in err[-1]


def test_learning_table_reads_a_run_and_writes_the_table_and_plot(tmp_path):
    import json

    lt = _bench()
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": 0, "val/acc/mean": 0.4}] + [{"step": k, "critic/acc/mean": 0.3 + 0.05 * k} for k in (1, 2, 3)]
    records[-1]["val/acc/mean"] = 0.55
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = lt.summarize(run, 3)
    assert got["before"] == 0.4 and got["after"] == 0.55 and got["steps_done"] == 3.0
    assert got["train_acc_first"] == pytest.approx(0.4) and got["train_acc_last"] == pytest.approx(0.4)
    budget = {"steps": 3, "prompts": 4, "seed": 0}
    runs = [{"preset": "grpo", "task": "wordprob", "minutes": 1.25, "error": None, **budget, **got},
            {"preset": "ppo", "task": "wordprob", "minutes": 0.5, "error": "exit code 1: boom", **budget,
             "before": 0.4, "after": None}]
    text = lt.table(runs, {"wordprob": {"summary": "SFT: 450 steps", "minutes": 12.0}})
    assert "| grpo | wordprob | 40.0 | 55.0 | +15.0 | 1.2 |" in text
    assert "| ppo | wordprob | 40.0 | failed: exit code 1: boom | - | 0.5 |" in text
    assert "- wordprob: SFT: 450 steps (12.0 min)" in text
    lt.plot(runs, tmp_path / "table.png", 3)
    assert (tmp_path / "table.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
