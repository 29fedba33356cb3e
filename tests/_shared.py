"""Build a test input once per test session, across pytest-xdist workers too.

A session-scoped fixture runs once in each xdist worker process. For an input that costs seconds to minutes
(an SFT warm start, ...) :func:`built_once` makes the first worker that needs it build it into a folder of the
session's temporary root, under a file lock, and every other worker wait for that and reuse the folder. Without
xdist it builds once into the session's temporary folder. What is built is read-only for the tests: a test that
changes it must copy it first (``shutil.copytree``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

_DONE = ".built"


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary folder that every worker of this session shares: the parent of a worker's own
    ``popen-gwN`` base folder under xdist, the session's base folder without it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``session_root/name``, filled by ``build(folder)`` exactly once in this test session. ``build`` gets an
    empty folder; a build that raises leaves nothing marked built (the next caller tries again)."""
    root = session_root(tmp_path_factory)
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes; other workers wait here
        if not (out / _DONE).is_file():
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            build(out)
            (out / _DONE).touch()
    return out
