"""Plots read at a glance: titled with the run's folder once (not "portrl run run"); plain tick labels, never an
offset or a shared exponent ("1e-5+1.1751e1"); a steady curve drawn flat, not magnified into noise; an accuracy
axis within [0, 1]; a plot that is not drawn (its metrics absent, 0 throughout, or drawn elsewhere) said in one
line."""

from __future__ import annotations

import logging
import math

import pytest

from portrl.cli import main
from portrl.trainer.plot import MIN_SPAN, overview_figure, panel_figure, plot_run, run_title, select_panels
from portrl.trainer.tracking import Tracker, read_metrics


def _write(run_dir, rows_by_step):
    with Tracker(run_dir, loggers=("jsonl",), progress_bar=False) as tr:
        for step, row in rows_by_step:
            tr.log(row, step=step)
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "step" in r]


def _steady_rows():
    """A run whose entropy is steady to the fifth digit (matplotlib's default axis: "1e-5+1.1751e1"), whose
    accuracy is 0 (its default axis: -0.05 to 0.05) and whose KL is a few 1e-5."""
    out = [(0, {"val/acc/mean": 0.0})]
    for s in range(1, 9):
        out.append((s, {"critic/acc/mean": 0.0, "critic/score/mean": 0.1 * s, "actor/kl_loss": 2e-5 * s,
                        "actor/entropy": 11.751 + 1e-5 * math.sin(s), "response_length/mean": 10.0 + s}))
    return out


@pytest.fixture
def plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as pyplot

    yield pyplot
    pyplot.close("all")


def test_the_title_is_the_runs_folder_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_title("outputs/run") == "outputs/run" and run_title(tmp_path / "outputs" / "run") == "outputs/run"
    assert run_title(".") == "."  # the working directory itself
    elsewhere = tmp_path.parent / "elsewhere" / "run"
    assert run_title(elsewhere) == str(elsewhere) or run_title(elsewhere).startswith("~")


def test_axes_are_plain_steady_curves_flat_and_accuracy_within_0_and_1(tmp_path, plt, monkeypatch):
    monkeypatch.chdir(tmp_path)
    panels = {p.name: p for p in select_panels(_write(tmp_path / "outputs" / "run", _steady_rows()))}
    fig = overview_figure(plt, list(panels.values()), run_title("outputs/run"))
    fig.canvas.draw()
    assert fig.get_suptitle() == "outputs/run"
    for ax in fig.axes:
        if not ax.axison:
            continue
        for axis in (ax.xaxis, ax.yaxis):
            assert axis.get_offset_text().get_text() == "", ax.get_title()  # no offset, no "1e-5" above the axis
            labels = [t.get_text() for t in axis.get_ticklabels() if t.get_text()]
            assert labels and not any("e" in t.lower() for t in labels), (ax.get_title(), labels)
    by_title = {ax.get_title(): ax for ax in fig.axes if ax.axison}
    lo, hi = by_title["Entropy"].get_ylim()
    assert hi - lo >= MIN_SPAN * 11.751 * 0.999 and lo < 11.751 < hi  # drawn flat in the middle, not as noise
    lo, hi = by_title["Accuracy"].get_ylim()
    assert lo == 0.0 and 0 < hi <= 1.0  # never below 0
    single = panel_figure(plt, panels["kl"], "outputs/run")
    single.canvas.draw()
    assert single.axes[0].get_title() == "KL divergence\noutputs/run"
    assert single.axes[0].yaxis.get_offset_text().get_text() == ""


def test_a_plot_not_drawn_is_said_in_one_line(tmp_path, capsys, caplog):
    rows = [(s, {"critic/acc/mean": 0.1 * s, "critic/score/mean": 0.1 * s, "actor/kl_loss": 0.0,
                 "actor/ppo_kl": 0.0, "actor/entropy": 1.0 - 0.1 * s}) for s in range(1, 4)]
    _write(tmp_path / "run", rows)
    assert main(["plot", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("no ")] == [
        "no reward plot: its curves equal curves of the accuracy plot (named in its legend)",
        "no KL divergence plot: actor/kl_loss and actor/ppo_kl are 0 at every step (not in use, or the policy did "
        "not move)",
        "no response length plot: the run logged no response_length/mean or response_length/max or "
        "val/response_length/mean",
        "no critic plot: the run logged no critic/vf_explained_var (it has no critic)"]
    # in a training run they are log lines (the trainer calls plot_run without `say`)
    with caplog.at_level(logging.INFO, logger="portrl.trainer.plot"):
        plot_run(tmp_path / "run")
    assert "no KL divergence plot: actor/kl_loss and actor/ppo_kl are 0" in caplog.text
