"""Host-side bookkeeping of the code sandbox's processes (portrl/rewards/sandbox.py runs the programs).

* :class:`UidSlot` (root only): a sandbox uid from ``UID_BASE`` that no other run of any process uses now,
  reserved by an exclusive lock file in /run/portrl-sandbox-uids (:func:`uid_lock_path`); a uid with processes or
  an account is skipped.
* the process table read from /proc: :func:`live_processes` of a process group or a uid, :func:`user_task_count`
  (what RLIMIT_NPROC counts for a non-root user);
* cleanup after a run: :func:`kill_uid` and :func:`kill_group` SIGKILL until nothing of the run is left.

What the program sees lives elsewhere, and is re-exported here for the modules that import it from this one: the
interpreter (:func:`base_executable`, :func:`interpreter_info`: portrl/rewards/sandbox_interpreter.py), the
packages a program may import (``DEFAULT_PACKAGES``, :func:`check_package_names`:
portrl/rewards/sandbox_packages.py), the minimal root's layout, the exposed packages and the masked fallback view
(:func:`root_layout`, :func:`exposed_packages`, :func:`isolation_view`, ``WRITABLE_DIRS``, ``SYSTEM_DIRS``,
``SYSTEM_FILES``, ``DEVICES``: portrl/rewards/sandbox_layout.py); :class:`SandboxError` is
portrl/rewards/sandbox_errors.py's.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import signal
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from portrl.rewards.sandbox_errors import SandboxError
from portrl.rewards.sandbox_interpreter import base_executable, interpreter_info
from portrl.rewards.sandbox_layout import (
    DEVICES,
    SYSTEM_DIRS,
    SYSTEM_FILES,
    WRITABLE_DIRS,
    exposed_packages,
    isolation_view,
    root_layout,
)
from portrl.rewards.sandbox_packages import DEFAULT_PACKAGES, check_package_names

__all__ = ["DEFAULT_PACKAGES", "DEVICES", "SYSTEM_DIRS", "SYSTEM_FILES", "UID_BASE", "UID_COUNT", "WRITABLE_DIRS",
           "SandboxError", "UidSlot", "base_executable", "check_package_names", "exposed_packages",
           "interpreter_info", "isolation_view", "kill_group", "kill_uid", "live_processes", "root_layout",
           "uid_lock_path", "user_task_count"]

log = logging.getLogger("portrl.rewards.sandbox")  # the sandbox's warnings keep one logger name

UID_BASE = 64200  # sandbox uids UID_BASE .. UID_BASE + UID_COUNT - 1 (root only; Debian leaves 60000-64999 free)
UID_COUNT = 256


# ------------------------------------------------------------------------------------------- uid slots
def uid_lock_path(uid: int) -> Path:
    """The lock file whose exclusive holder is the one run using sandbox ``uid`` (the folder is created)."""
    # one place for every process of the machine (not TMPDIR, which differs between processes)
    lock_dir = Path("/run" if os.path.isdir("/run") else tempfile.gettempdir()) / "portrl-sandbox-uids"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    return lock_dir / str(uid)


class UidSlot:
    """A sandbox uid no other run (in any process) uses now, held by an exclusive lock file; root only."""

    def __init__(self):
        busy = _uids_with_tasks()
        for uid in range(UID_BASE, UID_BASE + UID_COUNT):
            # a uid with processes (a leftover zombie would count against RLIMIT_NPROC) or an account (its files
            # would be the program's, and its processes are killed after the run) is never used
            if uid in busy or _is_account(uid):
                continue
            fd = os.open(uid_lock_path(uid), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise SandboxError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are in use; lower the number of "
                           "concurrent sandbox runs (reward.code.max_workers x reward workers)")

    def release(self) -> None:
        os.close(self._fd)  # drops the lock


def _is_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


# --------------------------------------------------------------------------------------- process table
def _proc_tasks() -> Iterable[tuple[int, int, int, str]]:
    """(pid, uid, process group, state letter) of every process visible in /proc (none without /proc)."""
    for name in (os.listdir("/proc") if os.path.isdir("/proc") else ()):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat_line = f.read().decode(errors="replace")
            uid = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        fields = stat_line[stat_line.rfind(")") + 2:].split()  # after "pid (comm) "
        yield int(name), uid, int(fields[2]), fields[0]


def _uids_with_tasks() -> set[int]:
    return {uid for _, uid, _, _ in _proc_tasks()}


def live_processes(pgid: int | None = None, uid: int | None = None) -> list[int]:
    """Pids of the processes (not zombies) in process group ``pgid`` or owned by ``uid``."""
    return [pid for pid, u, g, state in _proc_tasks()
            if state != "Z" and ((pgid is not None and g == pgid) or (uid is not None and u == uid))]


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb refills; NPROC bounds it)."""
    for _ in range(100):
        pids = live_processes(uid=uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    log.warning("sandbox uid %d still has processes after repeated SIGKILL", uid)


def kill_group(pgid: int) -> None:
    """SIGKILL the process group until none of it is left (killed processes take a moment to go)."""
    for _ in range(200):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not live_processes(pgid=pgid):
            return
        time.sleep(0.01)
    log.warning("sandbox process group %d still has processes after repeated SIGKILL", pgid)


def user_task_count() -> int:
    """Threads of the calling user (what RLIMIT_NPROC counts for a non-root user)."""
    me, count = os.getuid(), 0
    for pid, uid, _, state in _proc_tasks():
        if uid == me:
            try:
                count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return count
