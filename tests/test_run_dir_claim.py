"""A run stopped before its first checkpoint does not block the next command in its ``trainer.output_dir``: it has
nothing to resume, so it is moved aside (nothing deleted) with one line naming where it went. A run with a
checkpoint or a result (``hf_model``, ``plots``), or a folder with the user's own files, is still refused."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from omegaconf import OmegaConf

from portrl.config.options_schema import default_config
from portrl.trainer.checkpoint import CheckpointError, CheckpointManager
from portrl.trainer.run_dir import check_run_dir, prepare_run_dir
from portrl.trainer.run_identity import RUN_FILE, run_identity, write_run_record


def _cfg(out, **over):
    cfg = default_config()
    for k, v in {"device.name": "cpu", "trainer.output_dir": str(out), "trainer.seed": 3, **over}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _stopped_run(out, **over):
    """What a run killed during its first step leaves: run.json and the metrics of its validation."""
    write_run_record(out, run_identity(_cfg(out, **over)))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/acc/mean": 0.1}) + "\n")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / ".tmp_global_step_1_123").mkdir()  # a checkpoint write the stop cut short
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _prepare(cfg, out):
    ckpt = CheckpointManager(out / "checkpoints", max_to_keep=2)
    return prepare_run_dir(cfg, out, ckpt, run_identity(cfg))


@pytest.mark.parametrize("over", [{"trainer.seed": 4}, {"trainer.resume": "off"}])
def test_a_run_stopped_before_its_first_checkpoint_is_moved_aside_in_one_line(tmp_path, caplog, over):
    """Another run (a changed seed), or resume=off into the same one: the new run takes the folder."""
    out = tmp_path / "run"
    out.mkdir()
    before = _stopped_run(out)
    cfg = _cfg(out, **over)
    check_run_dir(cfg)  # the preflight refuses nothing (and moves nothing)
    assert (out / "metrics.jsonl").is_file()
    with caplog.at_level(logging.WARNING, logger="portrl"):
        path, rec = _prepare(cfg, out)
    assert path is None and rec["identity"] == run_identity(cfg)
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(moved) == 1
    after = {p.relative_to(moved[0]).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(moved[0].rglob("*")) if p.is_file()}
    assert after == before  # every file of the stopped run kept, unchanged
    assert sorted(p.name for p in out.iterdir()) == [RUN_FILE]  # the new run's own record only
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert f"trainer.output_dir={out} held an earlier run with no checkpoint to resume (run.json, metrics.jsonl)" \
        in lines[0] and f"moved to {moved[0]}" in lines[0]


@pytest.mark.parametrize("kept", ["hf_model", "plots", "checkpoints/global_step_1", "notes.txt"])
def test_a_run_with_a_checkpoint_or_a_result_or_user_files_is_still_refused(tmp_path, kept):
    out = tmp_path / "run"
    out.mkdir()
    _stopped_run(out)
    if kept == "notes.txt":
        (out / kept).write_text("mine")
    else:
        (out / kept).mkdir()
    cfg = _cfg(out, **{"trainer.seed": 4})
    with pytest.raises(CheckpointError, match=r"trainer.output_dir=.* holds"):
        check_run_dir(cfg)
    with pytest.raises(CheckpointError, match=r"trainer.output_dir=.* holds"):
        _prepare(cfg, out)
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name]


def test_the_same_run_without_a_checkpoint_starts_again_in_place(tmp_path):
    """resume=auto into its own stopped run: the same folder, the same run record (as before)."""
    out = tmp_path / "run"
    out.mkdir()
    _stopped_run(out)
    rec = json.loads((out / RUN_FILE).read_text())
    path, again = _prepare(_cfg(out), out)
    assert path is None and again["run_id"] == rec["run_id"]
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name]
