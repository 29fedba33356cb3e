"""benchmarks/async_vs_sync.py: its command line (bad values exit 2 with one line), the figures it takes from a
run's metrics.jsonl records (samples per second over steps 2..S, accuracy after the last step, median phase
times), the table of medians and ratios, and (slow) its --quick smoke end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import async_vs_sync as bench  # noqa: E402


def _records(step_s, acc_before=0.4, acc_after=0.5, gen=1.0, staleness=None):
    out = [{"step": 0, "val/acc/mean": acc_before}]
    for k, t in enumerate(step_s, start=1):
        r = {"step": k, "timing_s/step": t, "timing_s/gen": gen, "timing_s/update_actor": t - gen}
        if staleness is not None:
            r.update({"async/staleness_mean": staleness, "async/staleness_max": staleness + 1,
                      "async/dropped_samples": 0.0})
        out.append(r)
    out[-1]["val/acc/mean"] = acc_after
    out[-1]["timing_s/val"] = 99.0
    return out


def test_defaults_and_quick():
    args = bench.parse_args([])
    assert args.seeds == [0, 1, 2] and args.modes == list(bench.MODES) and args.config == "medium"
    quick = bench.parse_args(["--quick", "--seeds", "4,5"])
    assert quick.config == "small" and quick.steps == 3 and quick.seeds == [0]


@pytest.mark.parametrize("argv, words", [
    (["--modes", "sync,later"], "unknown later; valid: sync-colocated"),
    (["--seeds", "a"], "comma-separated integers"),
    (["--steps", "1"], "--steps >= 2"),
    (["--table", "/nonexistent/run.json"], "--table: no such file /nonexistent/run.json"),
    (["--warm-start", "/nonexistent"], "not a model folder"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_summarize_skips_the_first_step_and_validation():
    s = bench.summarize(_records([10.0, 2.0, 2.0]), sequences_per_step=8)
    assert s["samples_per_s"] == pytest.approx(16 / 4.0)  # steps 2 and 3 only
    assert (s["acc_before"], s["acc_after"], s["steps"]) == (0.4, 0.5, 3)
    assert s["phases"]["gen"] == 1.0 and "val" not in s["phases"] and s["phases"]["step"] == 2.0
    assert s["staleness_mean"] != s["staleness_mean"]  # nan: a synchronous run logs none
    with pytest.raises(ValueError, match="at least 2 steps"):
        bench.summarize(_records([1.0]), sequences_per_step=8)


def test_table_has_medians_ratios_and_accuracy_difference():
    runs = []
    for seed, (sync_t, async_t) in enumerate([(2.0, 1.0), (4.0, 2.0), (2.0, 1.0)]):
        runs.append({"mode": "sync", "seed": seed, **bench.summarize(_records([9, sync_t, sync_t]), 8)})
        runs.append({"mode": "async-s1", "seed": seed,
                     **bench.summarize(_records([9, async_t, async_t], acc_after=0.48, staleness=0.5), 8)})
    lines = bench.table(runs, ["sync", "async-s1"]).splitlines()
    assert lines[0].startswith("| mode | seeds | samples/s | x sync |") and "update_actor s" in lines[0]
    sync_row, async_row = lines[2].split(" | "), lines[3].split(" | ")
    assert sync_row[2] == "4.00 [2.00-4.00]" and sync_row[3] == "1.00x"
    assert async_row[2] == "8.00 [4.00-8.00]" and async_row[3] == "2.00x"
    assert "40.0 -> 48.0" in async_row[4] and async_row[5] == "-2.0"
    assert lines[3].endswith("0.50 / 2 |")


def test_each_mode_is_a_valid_portrl_config(tmp_path):
    from portrl.config.composition import compose

    args = bench.parse_args(["--steps", "4"])
    for mode in bench.MODES:
        cfg = compose(overrides=bench.train_overrides(args, tmp_path, mode, 1, tmp_path / "run"))
        assert cfg.trainer.total_steps == 4 and cfg.trainer.test_freq == 4 and cfg.data.train_batch_size == 16


# slow: the benchmark end to end (a warm start, then a run per mode, each a process of its own). Two modes: the
# colocated one (no Ray) and an asynchronous one on a separated rollout worker; every mode is a valid config
# (test_each_mode_is_a_valid_portrl_config), and the trainer paths behind them run in tests/test_async_training.py
# (one_step_off, async) and tests/test_distributed_separated.py (sync on a separated rollout worker).
@pytest.mark.slow
def test_quick_smoke_prints_the_table(tmp_path):
    modes = ["sync-colocated", "async-s2"]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "async_vs_sync.py"), "--quick",
                           "--modes", ",".join(modes), "--model-cache", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [x for x in proc.stdout.splitlines() if x.startswith("| ")]
    assert [r.split(" | ")[0].strip("| ") for r in rows[1:]] == modes
    assert "x sync-colocated" in rows[0] and "x sync |" not in rows[0]  # ratios to the baselines that ran


def test_table_pools_runs_saved_apart(tmp_path, capsys):
    import json

    for seed in (0, 1):
        runs = [{"mode": m, "seed": seed, **bench.summarize(_records([9, 2.0 * (seed + 1), 2.0]), 8)}
                for m in ("async-s2", "sync")]
        (tmp_path / f"{seed}.json").write_text(json.dumps({"runs": runs}))
    assert bench.main(["--table", str(tmp_path / "0.json"), str(tmp_path / "1.json")]) == 0
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ")][1:]  # less the header
    assert [r.split(" | ")[0] for r in rows] == ["| sync", "| async-s2"]  # MODES order
    assert all(r.split(" | ")[1] == "2" for r in rows)  # both seeds pooled
