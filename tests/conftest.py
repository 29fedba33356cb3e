"""Test-session settings that must be in place before torch is imported, and the inputs the whole session shares.

The suite runs in parallel processes (pytest-xdist, README "Tests"); each worker imports this file first.
The session is hermetic (tests/_hermetic.py): every cache lives in a temporary folder, a session that creates or
changes ``outputs/`` in the repository root or the current directory fails, and a Ctrl-C stops the session,
the runs its tests started included.
"""

import os
import sys
from pathlib import Path

import pytest

from _hermetic import SigintWatch, end_child_sessions, isolate_caches, outputs_changes, outputs_state

# No vendor plugin may autoload into torch on a CPU test machine.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Spinning OpenMP threads slow CPU training by up to 10x when the cores are shared (portrl/process_env.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Tests never read or write the user's caches: set, not defaulted, so a user's PORTRL_CACHE or HF_HOME is not used.
_CACHE = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"portrl-test-cache-{os.getuid()}")
isolate_caches(os.environ, _CACHE, os.environ.get("PYTEST_XDIST_WORKER", ""))

_SIGINT = SigintWatch()
_OUTPUTS: dict = {}  # folder -> its outputs_state when the session started (xdist controller, or the only process)
_CHANGES = pytest.StashKey[list]()


def pytest_sessionstart(session):
    _SIGINT.install()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller watches outputs/ over the whole run, its workers' sessions included
    for folder in {Path(str(session.config.rootpath)).resolve(), Path.cwd().resolve()}:
        _OUTPUTS[folder] = outputs_state(folder)


def pytest_sessionfinish(session, exitstatus):
    changes = [f"{folder}: {change}" for folder, before in _OUTPUTS.items()
               for change in outputs_changes(before, outputs_state(folder))]
    if changes:  # a test ran a command without its own output folder (trainer.output_dir or a temporary cwd)
        session.config.stash[_CHANGES] = changes
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    changes = config.stash.get(_CHANGES, [])
    if changes:
        terminalreporter.write_sep("=", "the tests changed outputs/ (they must write only to temporary folders)",
                                   red=True)
        for line in changes[:20] + ([f"... {len(changes) - 20} more"] if len(changes) > 20 else []):
            terminalreporter.write_line(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A Ctrl-C taken by a run inside the test (it returns 130) stops the session after the test."""
    _SIGINT.take()
    try:
        return (yield)
    finally:
        if _SIGINT.take():
            raise KeyboardInterrupt(f"SIGINT during {item.nodeid}")


def pytest_keyboard_interrupt(excinfo):
    """Ctrl-C: the runs the tests started in sessions of their own (which the terminal's signal did not reach)
    end with pytest."""
    end_child_sessions()


@pytest.fixture(scope="module", autouse=True)
def _ray_ends_with_its_file():
    """A local Ray a test file started ends with the file. portrl's init_ray keeps a Ray that runs, so a later file
    in the same xdist process would otherwise run on a cluster sized for another file (CI: a PRIME run found 3
    CPUs where it starts 4, and its PRM could not reserve its 2)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


# The tiny model most tests use: 1 layer, hidden size 32, 2 heads (1 kv head), initializer range 0.2.
TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64, "seed": 0,
        "initializer_range": 0.2}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of the tiny model TINY (the ``arith`` tokenizer), written once per session and shared by every
    test that asks for it: read-only, a test that changes it copies it first."""
    from portrl.models import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", **TINY))

