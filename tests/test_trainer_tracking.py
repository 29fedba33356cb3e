"""Tracker (metrics.jsonl, conversion, resume truncation, loggers) and plot_run / portrl plot."""

import json
import math

import numpy as np
import pytest
import torch

from portrl.trainer.tracking import Tracker, read_metrics, to_float


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_values_become_plain_floats(tmp_path):
    with Tracker(tmp_path, loggers=("jsonl",), progress_bar=False) as tr:
        rec = tr.log({"a": torch.tensor(1.5), "b": np.float32(2.0), "c": 3, "d": True, "e": float("nan"),
                      "f": torch.tensor([4.0]), "g": "text"}, step=1)
    assert rec == {"step": 1, "a": 1.5, "b": 2.0, "c": 3.0, "d": 1.0, "e": None, "f": 4.0, "g": "text"}
    assert _lines(tmp_path / "metrics.jsonl") == [rec]
    assert all(type(v) is float for k, v in rec.items() if k in "abcdf")


def test_one_line_per_step_and_flushed(tmp_path):
    tr = Tracker(tmp_path, loggers=("jsonl",), progress_bar=False)
    for s in range(1, 4):
        tr.log({"critic/rewards/mean": s / 10}, step=s)
        assert len(_lines(tmp_path / "metrics.jsonl")) == s  # readable before close (a killed run keeps it)
    tr.close()


def test_resume_drops_steps_after_checkpoint(tmp_path):
    with Tracker(tmp_path, loggers=("jsonl",), progress_bar=False) as tr:
        for s in range(0, 6):
            tr.log({"x": s}, step=s)
    with Tracker(tmp_path, loggers=("jsonl",), progress_bar=False, resume_step=3) as tr:
        tr.log({"x": 40}, step=4)
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 40)]
    with Tracker(tmp_path, loggers=("jsonl",), progress_bar=False) as tr:  # a fresh run starts a fresh file
        tr.log({"x": 1}, step=1)
    assert len(read_metrics(tmp_path)) == 1


def test_torn_last_line_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    assert read_metrics(tmp_path) == [{"step": 1, "x": 1.0}]
    with Tracker(tmp_path, loggers=("jsonl",), progress_bar=False, resume_step=1) as tr:
        tr.log({"x": 2}, step=2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_console_progress_bar_and_log_lines(tmp_path, capsys, caplog):
    with Tracker(tmp_path, loggers=("console",), total_steps=2, progress_bar=True) as tr:
        tr.log({"critic/rewards/mean": 0.25, "actor/entropy": 1.0}, step=1)
        tr.log({"critic/rewards/mean": 0.5}, step=2)
    assert "2/2" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()
    with caplog.at_level("INFO", logger="portrl.trainer.tracking"):
        with Tracker(tmp_path, loggers=("console",), total_steps=5, progress_bar=False) as tr:
            tr.log({"val/acc/mean": 0.75}, step=1)
    assert "step 1/5" in caplog.text and "val_acc=0.75" in caplog.text


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown logger.*valid: console"):
        Tracker("unused", loggers=("console", "neptune"))
    with pytest.raises(ValueError, match="not a number"):
        to_float([1, 2])
    with pytest.raises(ValueError, match="not a scalar"):
        to_float(torch.ones(3))
    assert to_float(np.int64(3)) == 3.0 and to_float(math.inf) is None


def test_selected_but_missing_logger_names_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name.split(".")[0] == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"wandb.*pip install 'portrl\[logging\]'"):
        Tracker(tmp_path, loggers=("jsonl", "wandb"), progress_bar=False)


def test_tensorboard_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    with Tracker(tmp_path, loggers=("tensorboard",), progress_bar=False) as tr:
        tr.log({"critic/rewards/mean": 0.5}, step=1)
    assert any((tmp_path / "tensorboard").iterdir())


def _fake_run(run_dir):
    with Tracker(run_dir, loggers=("jsonl",), progress_bar=False) as tr:
        tr.log({"val/acc/mean": 0.2}, step=0)
        for s in range(1, 6):
            tr.log({"critic/rewards/mean": s / 5, "critic/score/mean": s / 5, "critic/acc/mean": s / 6,
                    "actor/kl_loss": 0.01 * s,
                    "actor/entropy": 2 - s / 5, "response_length/mean": 10 + s}, step=s)


def test_plot_run_writes_pngs(tmp_path):
    from portrl.trainer.plot import plot_run

    _fake_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["accuracy.png", "reward.png", "kl.png", "entropy.png", "length.png",
                                       "curves.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000


def test_plot_skips_panels_without_data(tmp_path):
    from portrl.trainer.plot import plot_run

    with Tracker(tmp_path, loggers=("jsonl",), progress_bar=False) as tr:
        tr.log({"actor/entropy": 1.0}, step=1)
    assert [p.name for p in plot_run(tmp_path)] == ["entropy.png", "curves.png"]


def test_cli_plot(tmp_path, capsys):
    from portrl.cli import main

    _fake_run(tmp_path / "run")
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert "curves.png" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_metrics_file_untouched_until_the_first_log(tmp_path):
    """A launch that fails before its run logs anything leaves a finished run's metrics.jsonl as it was."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n')
    before = path.read_bytes()
    for resume_step in (0, 1):
        Tracker(tmp_path, loggers=("jsonl",), progress_bar=False, resume_step=resume_step).close()
        assert path.read_bytes() == before
    with Tracker(tmp_path, loggers=("jsonl",), progress_bar=False, resume_step=1) as tr:
        tr.log({"x": 20}, step=2)
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 20.0)]
