"""The e2e tier: envelope math, the committed cpu envelope, a fixed-seed run inside it.

Determinism (trainer.deterministic=true, two runs bitwise equal) is the trainer's test:
tests/test_trainer_resume.py::test_deterministic_runs_are_bitwise_identical."""

import json

import pytest

from portrl.parity.e2e import (METRICS, RUN_OVERRIDES, check_run, default_envelope_path, envelope_from_curves,
                               violations)


def _curve(offset=0.0, scale=1.0):
    return {m: [scale * (i + 1) + offset for i in range(5)] for m in METRICS}


def test_envelope_mean_std_and_floor():
    env = envelope_from_curves([_curve(-0.1), _curve(0.1), _curve(0.0)])
    band = env["actor/entropy"]
    assert band["mean"] == pytest.approx([1, 2, 3, 4, 5])
    assert band["std"] == pytest.approx([0.1] * 5)
    assert band["half_width"] == pytest.approx([0.3] * 5)
    same = envelope_from_curves([_curve(), _curve()])["actor/entropy"]
    assert same["half_width"] == pytest.approx([0.05 * (i + 1) + 1e-3 for i in range(5)])  # the floor
    assert violations(_curve(0.2), env) == []
    bad = violations(_curve(0.5), env)
    assert len(bad) == 5 * len(METRICS) and "outside" in bad[0]
    short = {m: v[:3] for m, v in _curve().items()}
    assert "3 steps, the envelope has 5" in violations(short, env)[0]
    with pytest.raises(ValueError, match="at least 2 seeds"):
        envelope_from_curves([_curve()])


def test_committed_envelope_matches_run_settings():
    env = json.loads(default_envelope_path("cpu").read_text())
    assert env["kind"] == "envelope" and env["overrides"] == list(RUN_OVERRIDES) and len(env["seeds"]) >= 3
    assert 0 not in env["seeds"]  # the checked run's seed is not one of the envelope's
    assert set(env["metrics"]) == set(METRICS)
    assert all(len(b["mean"]) == 10 for b in env["metrics"].values())


@pytest.mark.slow
def test_fixed_seed_run_stays_inside_envelope(tmp_path):
    from portrl.device import get_backend

    cpu = get_backend("cpu")
    report = check_run(cpu, default_envelope_path("cpu"), work_dir=tmp_path)
    assert report["verdict"] == "pass", report["violations"]
    assert len(report["curve"]["actor/entropy"]) == 10
