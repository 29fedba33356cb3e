"""`portrl train`, `portrl sft` and `portrl eval` end to end on a very small setup, and their input errors."""

from __future__ import annotations

import json

import pytest

from portrl.cli import main

SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "model.sft_steps=4", "model.sft_batch_size=8", "trainer.progress_bar=false"]


def test_train_sft_eval(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--log-level", "WARNING", "train", *SMALL, "trainer.total_steps=2", "trainer.test_freq=2",
                 f"trainer.output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "== portrl run summary ==" in text and "after SFT" in text and str(out) in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    step = next(r for r in rows if r["step"] == 1)  # one in-process worker: peak memory per phase
    assert 0 < step["memory/peak_gib/gen"] <= step["memory/peak_gib/step"]
    assert 0 < step["memory/peak_gib/update_actor"] <= step["memory/peak_gib/step"]
    assert (out / "hf_model" / "config.json").is_file()

    sft_dir = tmp_path / "sft"
    assert main(["--log-level", "WARNING", "sft", *SMALL, "--steps", "3", "--batch-size", "4",
                 "--output", str(sft_dir)]) == 0
    assert (sft_dir / "config.json").is_file() and not (tmp_path / "sft.tmp").exists()

    report = tmp_path / "eval.json"
    assert main(["--log-level", "WARNING", "eval", *SMALL, "--model", str(out / "hf_model"),
                 "--report", str(report)]) == 0
    metrics = json.loads(report.read_text())
    assert 0.0 <= metrics["val/acc/mean"] <= 1.0 and "val/acc/arith" in metrics


@pytest.mark.parametrize("algorithm", ["ppo", "online_dpo", "prime"])
def test_eval_of_an_algorithm_that_trains_with_more_workers(algorithm, tmp_path, capsys):
    """Evaluation needs no critic, reference or reward model, even when the run's algorithm trains with them
    (ppo's GAE, online DPO, PRIME): ``portrl eval algorithm=...`` must not refuse the config."""
    report = tmp_path / "eval.json"
    assert main(["--log-level", "WARNING", "eval", *SMALL, f"algorithm={algorithm}", "--report", str(report),
                 f"trainer.output_dir={tmp_path / 'run'}"]) == 0, capsys.readouterr().err
    assert 0.0 <= json.loads(report.read_text())["val/acc/mean"] <= 1.0


@pytest.mark.parametrize("argv, message", [
    (["train", "actor.optim.lrr=1"], "actor.optim.lr"),
    (["train", "--device", "nosuch"], "nosuch"),
    (["eval", "--checkpoint", "/nonexistent/global_step_1"], "no such checkpoint directory"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(["--log-level", "WARNING", *argv]) == 2
    assert message in capsys.readouterr().err
