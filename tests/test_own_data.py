"""A user's own model and data: the commands of docs/own-model-and-data.md, and what the preflight fits.

The end-to-end test runs the section's commands as written (``~`` is the test's home folder) on a small local
GSM8K-style jsonl and a tiny model, with only the sizes that keep it fast added (tests/test_cli_commands.py's
SMALL settings); the others check each fitting rule of portrl.trainer.data_fit on the config the preflight leaves.
"""

import json
import logging
import re
from pathlib import Path

import pytest

from portrl.cli import main
from portrl.config import compose
from portrl.errors import UserError
from portrl.models import write_tiny_model
from portrl.trainer.preflight import TRAIN, preflight
from portrl.trainer.resources import settle_config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own-model-and-data.md"
# what keeps a run on a tiny model fast; none of it is a key the page asks the user to set
FAST = ["device.num_threads=1", "rollout.n=2", "data.max_response_length=4", "trainer.progress_bar=false",
        "trainer.total_steps=2", "trainer.test_freq=2"]


def section_commands() -> list[str]:
    """The shell lines of the page's first section's code blocks (before its first "## "), comments dropped."""
    section = PAGE.read_text().split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def gsm8k_rows(n: int) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys 3 more. How many now?",
             "answer": f"He has {i} + 3 = {i + 3} apples.\n#### {i + 3}"} for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "model", vocab="arith", hidden_size=32, num_layers=2,
                            num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def as_shell(command: str, home: Path, **paths: str) -> list[str]:
    """``command`` split into argv with ``~`` expanded (as the shell does) and the page's placeholders replaced."""
    for placeholder, value in paths.items():
        command = command.replace(placeholder, value)
    return [w.replace("~", str(home)) if w.startswith("~") or "=~" in w or "[~" in w else w for w in command.split()]


def test_readme_section_from_raw_rows_to_a_trained_policy(tmp_path, home, model_dir, caplog, capsys):
    commands = section_commands()
    assert commands[:3] == [
        "portrl preprocess gsm8k --input gsm8k-raw/main --output-dir ~/data/gsm8k",
        "portrl train --preset cpu data=gsm8k model.path=~/models/Qwen2.5-0.5B-Instruct",
        "portrl eval --preset cpu data=gsm8k --model outputs/run/hf_model",
    ]
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(12)))
    paths = {"gsm8k-raw/main": str(raw), "~/models/Qwen2.5-0.5B-Instruct": str(model_dir),
             "outputs/run": str(tmp_path / "run")}
    preprocess, train, evaluate = (as_shell(c, home, **paths)[1:] for c in commands[:3])
    assert main(preprocess) == 0
    assert (home / "data" / "gsm8k" / "test.parquet").is_file()

    caplog.set_level(logging.INFO, logger="portrl")
    assert main([*train, *FAST, f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "== portrl run summary ==" in out and "validation acc" in out
    # the preset's 1024 prompts per step (mini-batches of 256) fitted to the 11 training rows, said in the log
    assert "data.train_batch_size=1024 (not set by you) is more than the 11 training rows" in caplog.text
    assert "actor.ppo_mini_batch_size 256 -> 11" in caplog.text
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert any("val/acc/mean" in r for r in rows if r["step"] == 2)  # validated on ~/data/gsm8k/test.parquet
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()

    assert main([*evaluate, *FAST[:3]]) == 0
    assert "val/acc/openai/gsm8k" in capsys.readouterr().out


def test_readme_qa_commands_fit_the_gsm8k_preset_to_your_files(tmp_path, home, model_dir, caplog):
    qa_lines = [c for c in section_commands() if "qa" in c.split() or "~/data/mine" in c]
    assert qa_lines == [
        "portrl preprocess qa --input my_rows.jsonl --output-dir ~/data/mine",
        "portrl train --preset cpu data=gsm8k data.train_files=[~/data/mine/train.parquet] "
        "model.path=~/models/Qwen2.5-0.5B-Instruct",
    ]
    raw = tmp_path / "rows.jsonl"
    raw.write_text("".join(json.dumps({"problem": r["question"], "solution": r["answer"]}) + "\n"
                           for r in gsm8k_rows(20)))
    paths = {"my_rows.jsonl": str(raw), "~/models/Qwen2.5-0.5B-Instruct": str(model_dir)}
    preprocess, train = (as_shell(c, home, **paths)[1:] for c in qa_lines)
    assert main(preprocess) == 0
    caplog.set_level(logging.INFO, logger="portrl")
    cfg = compose(preset="cpu", overrides=[*train[3:], f"trainer.output_dir={tmp_path / 'run'}"])
    preflight(cfg, TRAIN)
    mine = home / "data" / "mine"
    assert list(cfg.data.val_files) == [str(mine / "test.parquet")]  # not the preset's ~/data/gsm8k/test.parquet
    assert "the test split beside the training split" in caplog.text
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (18, 6)  # 18 rows in ~4 mini-batches


def _cfg(tmp_path, model_dir, *overrides, preset="cpu"):
    return compose(preset=preset, overrides=["data=gsm8k", f"model.path={model_dir}",
                                             f"trainer.output_dir={tmp_path / 'run'}", *overrides])


def _parquet(tmp_path, name="d", n=6, test=True) -> Path:
    folder = tmp_path / name
    assert main(["preprocess", "qa", "--input", _jsonl(tmp_path, n), "--output-dir", str(folder),
                 "--test-fraction", "0.2" if test else "0"]) == 0
    return folder


def _jsonl(tmp_path, n) -> str:
    path = tmp_path / f"raw{n}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(n)))
    return str(path)


def test_a_batch_size_you_set_is_refused_not_changed(tmp_path, home, model_dir, capsys):
    data = _parquet(tmp_path, n=6, test=False)
    argv = ["train", "--preset", "cpu", "data=gsm8k", f"model.path={model_dir}", f"data.train_files=[{data}/train.parquet]",
            f"trainer.output_dir={tmp_path / 'run'}"]
    assert main([*argv, "data.train_batch_size=8", "actor.ppo_mini_batch_size=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data.train_batch_size=8 is more than the 6 rows of" in err
    assert main([*argv, "actor.ppo_mini_batch_size=4"]) == 2  # the preset's batch lowered to 6, which 4 does not divide
    err = capsys.readouterr().err.strip()
    assert "which actor.ppo_mini_batch_size=4 does not divide" in err and "divisor of 6" in err
    cfg = _cfg(tmp_path, model_dir, f"data.train_files=[{data}/train.parquet]", "actor.ppo_mini_batch_size=2")
    preflight(cfg, TRAIN)
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (6, 2)  # yours kept: it divides 6


def test_prompts_longer_than_the_limit_are_not_counted(tmp_path, home, model_dir, caplog):
    data = _parquet(tmp_path, n=10)
    caplog.set_level(logging.WARNING, logger="portrl")
    cfg = _cfg(tmp_path, model_dir, f"data.train_files=[{data}/train.parquet]", "data.max_prompt_length=1")
    with pytest.raises(UserError, match="only 0 of the 8 rows .* fit data.max_prompt_length=1"):
        preflight(cfg, TRAIN)


def test_validation_files_follow_the_training_files(tmp_path, home, model_dir, caplog):
    caplog.set_level(logging.INFO, logger="portrl")
    with_test, without_test = _parquet(tmp_path, "a", n=10), _parquet(tmp_path, "b", n=10, test=False)
    cfg = _cfg(tmp_path, model_dir, f"data.train_files=[{with_test}/train.parquet]", "data.val_files=[]")
    preflight(cfg, TRAIN)
    assert list(cfg.data.val_files) == []  # data.val_files=[] set by you: off
    settled = settle_config(cfg)  # what RLTrainer works on: it still knows you set it
    assert list(settled.data.train_files) == [str(with_test / "train.parquet")] and list(settled.data.val_files) == []
    cfg = _cfg(tmp_path, model_dir, f"data.train_files=[{without_test}/train.parquet]")
    preflight(cfg, TRAIN)
    assert list(cfg.data.val_files) == [] and "validation is off" in caplog.text
    cfg = _cfg(tmp_path, model_dir, f"data.train_files=[{without_test}/train.parquet]",
               f"data.val_files=[{with_test}/test.parquet]")
    preflight(cfg, TRAIN)
    assert list(cfg.data.val_files) == [str(with_test / "test.parquet")]  # yours, kept
    # the preset's files, present at its location: used as they are
    (home / "data").mkdir(parents=True)
    with_test.rename(home / "data" / "gsm8k")
    cfg = _cfg(tmp_path, model_dir)
    preflight(cfg, TRAIN)
    assert list(cfg.data.val_files) == [str(home / "data" / "gsm8k" / "test.parquet")]


def test_warm_start_only_where_it_applies(tmp_path, home, model_dir, caplog):
    data = _parquet(tmp_path, n=10)
    caplog.set_level(logging.INFO, logger="portrl")
    cfg = compose(preset="cpu", overrides=["model=tiny", "data=gsm8k", f"data.train_files=[{data}/train.parquet]",
                                           f"trainer.output_dir={tmp_path / 'run'}"])
    assert cfg.model.sft_warm_start  # the tiny model preset's
    preflight(cfg, TRAIN)
    assert not cfg.model.sft_warm_start and "built in for the generated rows of data.name=arith, arith_tool" in caplog.text
    cfg = _cfg(tmp_path, model_dir, f"data.train_files=[{data}/train.parquet]", "model.sft_warm_start=true")
    with pytest.raises(UserError, match="model.sft_warm_start trains on the generated rows of data.name=arith, arith_tool"):
        preflight(cfg, TRAIN)


def test_the_builtin_arith_run_is_not_fitted(tmp_path):
    cfg = compose(overrides=[f"trainer.output_dir={tmp_path / 'run'}", "model.tiny.hidden_size=32",
                             "model.tiny.intermediate_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"])
    before = (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, list(cfg.data.val_files),
              cfg.model.sft_warm_start)
    preflight(cfg, TRAIN)
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, list(cfg.data.val_files),
            cfg.model.sft_warm_start) == before
