"""``portrl eval --checkpoint <run>/checkpoints/global_step_N`` needs only that folder: the model comes from the
checkpoint's recorded run identity (the command line still wins, and a model that is not the checkpoint's is one
line with eval's own fix); eval shows its progress and says which file and how many rows it scored."""

from __future__ import annotations

import json

import pytest

from portrl.cli import main
from portrl.cli.evaluate import checkpoint_overrides

#: a run of two steps on 16 prompts, checkpointed at step 1 (seconds on one core)
RUN = ["device.name=cpu", "device.num_threads=1", "data.arith.num_train=16", "data.arith.num_test=8",
       "data.train_batch_size=4", "data.max_response_length=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
       "trainer.total_steps=1", "trainer.save_freq=1", "trainer.test_freq=0", "trainer.val_before_train=false",
       "trainer.progress_bar=false", "trainer.loggers=[jsonl]", "trainer.plot=false", "trainer.export_hf=false"]


@pytest.fixture(scope="module")
def run_dir(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("evalrun") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PORTRL_CACHE", str(out.parent / "cache"))  # its own: not shared with other test processes
        assert main(["--log-level", "WARNING", "train", *RUN, f"model.path={tiny_model}",
                     f"trainer.output_dir={out}"]) == 0
    return out


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))  # the generated arith split: not the user's cache


def test_eval_needs_only_the_checkpoint_folder(run_dir, tmp_path, capsys):
    ckpt = run_dir / "checkpoints" / "global_step_1"
    report = tmp_path / "r.json"
    argv = ["--log-level", "WARNING", "eval", "device.num_threads=1", "data.arith.num_test=8",
            "data.val_batch_size=3", "--checkpoint", str(ckpt), "--report", str(report)]
    assert main(argv) == 0, capsys.readouterr().err
    cap = capsys.readouterr()
    assert f"the model of {ckpt}: " in cap.err and "model.path=" in cap.err  # said once, before it loads
    # progress after each chunk of data.val_batch_size rows, then the file and the count
    assert [line.split("(")[0].strip() for line in cap.err.splitlines() if "scored" in line] == \
        ["portrl eval: scored 3/8 rows", "portrl eval: scored 6/8 rows", "portrl eval: scored 8/8 rows"]
    last = cap.out.strip().splitlines()[-1]
    assert last.startswith("scored 8 rows of ") and "test.parquet" in last and str(ckpt) in last
    assert 0.0 <= json.loads(report.read_text())["val/acc/mean"] <= 1.0


def test_a_model_that_is_not_the_checkpoints_is_refused_with_evals_fix(run_dir, tmp_path, capsys):
    ckpt = run_dir / "checkpoints" / "global_step_1"
    argv = ["eval", "device.num_threads=1", "data.arith.num_test=8", "model.path=null", "--checkpoint", str(ckpt)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("portrl eval: error: --checkpoint") and "(model.path: " in err and '-> "<tiny>")' in err
    assert "eval takes the model from the checkpoint" in err and "trainer.output_dir" not in err


def test_a_checkpoint_whose_model_moved_names_the_key(run_dir, tmp_path, capsys):
    """The model the checkpoint records is gone from this machine: one line saying which key gives it."""
    import shutil

    moved = tmp_path / "m"
    shutil.copytree(run_dir / "checkpoints" / "global_step_1", moved / "global_step_1")
    manifest = moved / "global_step_1" / "manifest.json"
    doc = json.loads(manifest.read_text())
    gone = str(tmp_path / "no-such-model")
    doc["meta"]["identity"]["model.path"] = gone
    manifest.write_text(json.dumps(doc))  # read before any checksum: the model's place is the first problem
    assert main(["eval", "--checkpoint", str(moved / "global_step_1")]) == 2
    err = capsys.readouterr().err
    assert f"model.path={gone}, which is not on this machine" in err and "model.path=DIR" in err


def test_the_command_line_wins_over_the_checkpoint():
    saved = {"model.path": "/runs/m", "model.tokenizer_path": None, "actor.lora_rank": 0}
    assert checkpoint_overrides(saved, frozenset()) == \
        ['actor.lora_rank=0', 'model.path="/runs/m"', 'model.tokenizer_path=null']
    assert checkpoint_overrides(saved, frozenset({"model.path"})) == ['actor.lora_rank=0', 'model.tokenizer_path=null']
    tiny = {"model.path": "<tiny>", "model.tiny.hidden_size": 32}
    assert checkpoint_overrides(tiny, frozenset()) == ["model.tiny.hidden_size=32"]  # model.path stays unset
    assert checkpoint_overrides(tiny, frozenset({"model.path"})) == []  # the user's own model: no tiny shape
