"""The sandbox runs going in this process, so none outlives it, and the removal of a run's folder.

Every run (portrl/rewards/sandbox.py) takes its folder from :func:`new_folder`, records its process group with
:func:`note_group` once started and leaves with :func:`forget` when finished. At interpreter exit -- before threads
are joined, so a run abandoned in a thread (e.g. a tool call past the agent loop's timeout) is not waited for --
every run still going has its process group and uid killed, its thread a moment to finish it, and its folder
removed; after that no new run starts (SandboxError). A process forked from this one (a multiprocessing worker)
owns none of these runs. A process killed by a signal (SIGKILL) cannot clean up: its programs die with it
(PR_SET_PDEATHSIG), their folders stay in TMPDIR.

:func:`remove_tree` removes a sandbox folder, also one whose folders the program made unreadable.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook first: _at_exit, registered later, runs before it
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass

from portrl.rewards.sandbox_errors import SandboxError
from portrl.rewards.sandbox_host import UidSlot, kill_group, kill_uid

log = logging.getLogger("portrl.rewards.sandbox")  # the sandbox's warnings keep one logger name


@dataclass
class _Live:
    slot: UidSlot | None
    pgid: int | None = None


_live: dict[str, _Live] = {}  # sandbox folder -> what to kill and free if the process exits with the run going
_live_lock = threading.Lock()
_exiting = False


def new_folder(slot: UidSlot | None) -> str:
    """A fresh sandbox folder in TMPDIR, recorded as a run going (with its uid ``slot``); SandboxError when the
    interpreter is exiting."""
    with _live_lock:
        if _exiting:
            raise SandboxError("the interpreter is exiting: no new sandbox runs")
        tmp = tempfile.mkdtemp(prefix="portrl-sandbox-")
        _live[tmp] = _Live(slot)
        return tmp


def note_group(folder: str, pgid: int) -> bool:
    """Record the process group of the run in ``folder``; True when the exit cleanup has run meanwhile (the
    caller must kill the group: the run must not outlive it)."""
    with _live_lock:
        run = _live.get(folder)
        if run is not None:
            run.pgid = pgid
        return _exiting


def forget(folder: str) -> None:
    """The run in ``folder`` is over (its group killed, its uid freed, its folder removed)."""
    with _live_lock:
        _live.pop(folder, None)


def _at_exit() -> None:
    """At interpreter exit, before threads are joined (a thread abandoned in run_program, e.g. a tool call past
    the agent loop's timeout, would never finish it): kill every run's process group and uid, give their threads
    a moment to finish the runs, then remove the folders left."""
    global _exiting
    with _live_lock:
        _exiting = True
        runs = list(_live.items())
    for _, run in runs:
        if run.pgid is not None:
            kill_group(run.pgid)
        if run.slot is not None:
            kill_uid(run.slot.uid)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        with _live_lock:
            if not _live:
                return
        time.sleep(0.01)
    with _live_lock:
        left = list(_live)
        _live.clear()
    for folder in left:
        remove_tree(folder)


def _after_fork_in_child() -> None:
    """A forked child (a multiprocessing worker) owns none of its parent's runs: its exit must not end them."""
    global _live_lock, _exiting
    _live.clear()
    _live_lock = threading.Lock()
    _exiting = False


try:  # runs before concurrent.futures joins its workers (registered at its import above: the later runs first)
    threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another Python, or imported while the interpreter exits
    atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def remove_tree(path: str) -> None:
    """Remove the sandbox folder, also when the program made folders in it unreadable (chmod 0)."""
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass
    for folder, subfolders, _ in os.walk(path):  # open every folder up before walking into it
        for name in subfolders:
            sub = os.path.join(folder, name)
            if not os.path.islink(sub):
                try:
                    os.chmod(sub, 0o700)
                except OSError:
                    pass
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        log.warning("could not remove the sandbox folder %s", path)
