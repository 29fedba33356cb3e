"""The test session is hermetic (tests/_hermetic.py, tests/conftest.py): its caches are temporary folders, a
session that creates or changes ``outputs/`` fails, and a Ctrl-C stops the session and the runs its tests
started. The guards are checked on small pytest sessions of their own, run with this directory's conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _hermetic import CACHE_DIRS, outputs_changes, outputs_state

HERE = Path(__file__).parent


def _session(tmp_path: Path, tests: str) -> subprocess.CompletedProcess:
    """Run ``tests`` (a test module's source) as a pytest session in ``tmp_path`` (its root and current directory)
    with this directory's conftest."""
    for name in ("conftest.py", "_hermetic.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the root here: not the repository's settings
    (tmp_path / "test_inner.py").write_text(tests)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # a session of its own, not a worker
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_every_cache_is_a_temporary_folder():
    base = Path(os.environ["PORTRL_KERNEL_CACHE"]).parent  # the session's cache folder (conftest.py)
    assert base.name.startswith("portrl-test-cache-")
    assert Path(os.environ["PORTRL_CACHE"]).name.startswith(base.name)  # per xdist worker: a sibling
    for var, sub in CACHE_DIRS.items():
        assert Path(os.environ[var]) == base / sub, var
    if "RAY_AUTH_TOKEN" not in os.environ and Path(os.environ["RAY_AUTH_TOKEN_PATH"]).is_relative_to(base):
        assert Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text().strip()  # a token: Ray does not write ~/.ray's


def test_outputs_state_sees_created_changed_and_removed_paths(tmp_path):
    assert outputs_state(tmp_path) == {}
    run = tmp_path / "outputs" / "run"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    before = outputs_state(tmp_path)
    (run / "run.json").write_text('{"run_id": "x"}')
    (run / "metrics.jsonl").write_text("")
    changes = outputs_changes(before, outputs_state(tmp_path))
    assert "created outputs/run/metrics.jsonl" in changes and "changed outputs/run/run.json" in changes
    shutil.rmtree(run)
    assert "removed outputs/run/run.json" in outputs_changes(before, outputs_state(tmp_path))


def test_a_session_that_writes_outputs_fails_and_names_what_it_wrote(tmp_path):
    (tmp_path / "outputs" / "run").mkdir(parents=True)  # a user's run, left alone by the first test
    (tmp_path / "outputs" / "run" / "run.json").write_text("{}")
    proc = _session(tmp_path, "from pathlib import Path\n\n"
                              "def test_reads():\n    assert Path('outputs/run/run.json').read_text() == '{}'\n\n"
                              "def test_writes():\n    Path('outputs/run/metrics.jsonl').write_text('{}')\n")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout and "the tests changed outputs/" in proc.stdout, proc.stdout
    root = tmp_path.resolve()
    listed = [line for line in proc.stdout.splitlines() if line.startswith(f"{root}: ")]
    assert listed == [f"{root}: created outputs/run/metrics.jsonl", f"{root}: changed outputs/run"], proc.stdout
    (tmp_path / "outputs" / "run" / "metrics.jsonl").unlink()
    clean = _session(tmp_path, "def test_nothing():\n    pass\n")
    assert clean.returncode == 0 and "outputs/" not in clean.stdout, clean.stdout + clean.stderr


def test_a_ctrl_c_taken_by_a_run_in_the_test_stops_the_session(tmp_path):
    """portrl's run handler takes the SIGINT (the run ends with 130, as portrl.cli.main returns it); the session
    stops after that test instead of going on to the next."""
    proc = _session(tmp_path, "import os, signal\nfrom pathlib import Path\n"
                              "from portrl.trainer.interrupts import stop_signals\n\n"
                              "def test_a_run_stopped_by_ctrl_c():\n"
                              "    with stop_signals() as stop:\n"
                              "        os.kill(os.getpid(), signal.SIGINT)\n"
                              "    assert stop.exit_code == 130\n\n"
                              "def test_next():\n    Path('next_ran').touch()\n")
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, proc.stdout + proc.stderr
    assert "KeyboardInterrupt" in proc.stdout and "SIGINT during test_inner.py::test_a_run_stopped_by_ctrl_c" \
        in proc.stdout, proc.stdout
    assert not (tmp_path / "next_ran").exists()


def test_a_ctrl_c_ends_the_runs_tests_started_in_sessions_of_their_own(tmp_path):
    proc = _session(tmp_path, "import subprocess, sys\nfrom pathlib import Path\n\n"
                              "def test_a_run_in_its_own_session():\n"
                              "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
                              " start_new_session=True)\n"
                              "    Path('child.pid').write_text(str(child.pid))\n"
                              "    raise KeyboardInterrupt  # what Ctrl-C raises in pytest while the test waits\n")
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, proc.stdout + proc.stderr
    pid = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the child run outlived the interrupted session"


def _alive(pid: int) -> bool:
    """The process runs (a zombie, ended but not yet reaped by init, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
