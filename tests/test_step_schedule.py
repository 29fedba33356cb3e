"""portrl.trainer.step_schedule alone: when a checkpoint is due, put off, saved on a signal, and when a diverged run
stops (the same rules run end to end in test_trainer_divergence.py and test_trainer_interrupts.py)."""

from __future__ import annotations

import pytest

from portrl.trainer.checkpoint import CheckpointManager
from portrl.trainer.divergence import DivergenceWatch, TrainingDiverged
from portrl.trainer.step_schedule import StepSchedule


def _schedule(tmp_path, max_nonfinite=3, **over) -> StepSchedule:
    kw = {"total_steps": 6, "save_freq": 2, "save_final": True, "save_on_interrupt": True, **over}
    return StepSchedule(DivergenceWatch(max_nonfinite), CheckpointManager(tmp_path / "checkpoints"), **kw)


def _run(schedule: StepSchedule, skipped: dict, stop_at: int = 0) -> tuple[list[int], list[dict]]:
    """Steps 1..total through the schedule, an update skipped at the steps in ``skipped``; returns the steps saved
    and each step's metrics."""
    saved, rows = [], []
    for step in range(1, schedule.total_steps + 1):
        m = {"actor/nonfinite_skipped": float(skipped.get(step, 0))}
        schedule.metrics(step, m)
        rows.append(m)
        schedule.end_step(step, step == stop_at, lambda: saved.append(step) or None)
    return saved, rows


@pytest.mark.parametrize("over, saved", [
    ({}, [2, 4, 6]),
    ({"save_freq": 4}, [4, 6]),
    ({"save_freq": 4, "save_final": False}, [4]),
    ({"save_freq": 0}, [6]),
    ({"save_freq": 0, "save_final": False}, []),
])
def test_the_cadence(tmp_path, over, saved):
    assert _run(_schedule(tmp_path, **over), {})[0] == saved


def test_a_checkpoint_due_at_a_skipped_step_waits_for_the_next_clean_one(tmp_path, caplog):
    saved, rows = _run(_schedule(tmp_path), {2: 1, 3: 2})
    assert saved == [4, 6] and "checkpoint of step 2 put off" in caplog.text
    assert [r["train/nonfinite_streak"] for r in rows] == [0.0, 1.0, 2.0, 0.0, 0.0, 0.0]
    assert rows[-1]["actor/nonfinite_skipped_total"] == 3.0


def test_the_last_step_skipped_ends_without_its_checkpoint(tmp_path, caplog):
    assert _run(_schedule(tmp_path, save_freq=0), {6: 1})[0] == []
    assert "checkpoint of step 6 put off: its update was skipped (a non-finite loss or gradient norm); the run ends " \
           "without it" in caplog.text


@pytest.mark.parametrize("on_interrupt, saved", [(True, [2, 3, 4, 6]), (False, [2, 4, 6])])
def test_a_signal_saves_the_finished_step_when_asked(tmp_path, on_interrupt, saved):
    assert _run(_schedule(tmp_path, save_on_interrupt=on_interrupt), {3: 1}, stop_at=3)[0] == saved


def test_a_save_reports_its_seconds_with_the_next_step(tmp_path):
    _, rows = _run(_schedule(tmp_path), {})
    assert ["timing_s/save" in r for r in rows] == [False, False, True, False, True, False]


def test_a_streak_of_max_steps_stops_before_any_save(tmp_path):
    schedule = _schedule(tmp_path, max_nonfinite=2, save_freq=1)
    with pytest.raises(TrainingDiverged, match=r"steps 2-3 in a row had a non-finite loss"):
        _run(schedule, {2: 1, 3: 1})
    assert schedule.owed  # step 2's checkpoint was put off, step 3 never saved
