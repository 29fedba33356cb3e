"""Host-side bookkeeping of the code sandbox (portrl/rewards/sandbox.py runs the programs).

* :class:`UidSlot` (root only): a sandbox uid from ``UID_BASE`` that no other run of any process uses now,
  reserved by an exclusive lock file in /run/portrl-sandbox-uids; a uid with processes or an account is skipped.
* the process table read from /proc: :func:`live_processes` of a process group or a uid, :func:`user_task_count`
  (what RLIMIT_NPROC counts for a non-root user);
* cleanup after a run: :func:`kill_uid` and :func:`kill_group` SIGKILL until nothing of the run is left;
* :func:`root_layout`: what the minimal root (portrl/rewards/sandbox_root.py) binds read-only -- the system's
  /usr and its companions, three entries of /etc, the interpreter's prefixes, five devices -- computed once per
  process;
* :func:`isolation_view`: the fallback where that root cannot be built: the folders the child masks with tmpfs in
  its mount namespace (``WRITABLE_DIRS`` and, as root, folders a dropped uid cannot enter) and the paths it binds
  back (the sandbox folder, the interpreter).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import pwd
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("portrl.rewards.sandbox")  # the sandbox's warnings keep one logger name

UID_BASE = 64200  # sandbox uids UID_BASE .. UID_BASE + UID_COUNT - 1 (root only; Debian leaves 60000-64999 free)
UID_COUNT = 256
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# a folder is bound, a link copied; /etc/alternatives holds the links of Debian tools (/usr/bin/awk -> ...)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/alternatives")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # the loader's library index; the local time zone
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


class SandboxError(RuntimeError):
    """The sandbox itself could not start a program (not the program's fault): the message says why."""


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


# ------------------------------------------------------------------------------------------ isolation view
def _searchable_by_others(path: str) -> bool:
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def _blocking_ancestor(path: str) -> str | None:
    """The top-most folder on ``path`` that others cannot enter (so a dropped uid cannot reach ``path``)."""
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        folder = str(Path(*parts[:i]))
        if not _searchable_by_others(folder):
            return folder
    return None


def _interpreter_paths() -> list[str]:
    paths = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix),
             os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(paths)


def _inside(path: str, folders) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


@functools.lru_cache(maxsize=1)
def root_layout() -> dict:
    """What the minimal root holds besides the program's folder: {"binds": [[source, target], ...] (folders,
    read-only), "files": [[source, target], ...] (read-only), "links": [[path, link text], ...], "devices":
    [...]}. The interpreter's prefixes are bound at their real paths and at the paths Python is started by (a
    virtual environment is found next to the executable it is started as); a folder inside another is left out
    (the outer bind holds it), and "/" never is bound."""
    binds: dict[str, str] = {}
    files, links = [], []
    for path in SYSTEM_DIRS + SYSTEM_FILES:
        if os.path.islink(path):
            links.append([path, os.readlink(path)])
        elif os.path.isdir(path):
            binds[path] = path
        elif os.path.isfile(path):
            files.append([path, path])
    linked = [path for path, _ in links]
    for path in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable)):
        for target in (os.path.abspath(path), os.path.realpath(path)):
            if target != "/" and not _inside(target, linked):
                binds.setdefault(target, os.path.realpath(path))
    outer = [t for t in binds if not any(t != o and _inside(t, [o]) for o in binds)]
    return {"binds": [[binds[t], t] for t in sorted(outer)], "files": files, "links": links,
            "devices": [d for d in DEVICES if os.path.exists(d)]}


def isolation_view(sandbox_dir: str, root: bool) -> tuple[list[str], list[str], bool]:
    """(folders to mask with tmpfs, folders to bind back, whether a dropped uid reaches the interpreter and the
    sandbox folder without the masks)."""
    masks = {os.path.realpath(d) for d in WRITABLE_DIRS if os.path.isdir(d)}
    needed = [os.path.realpath(sandbox_dir)] + _interpreter_paths()
    visible = True
    if root:
        for path in needed:
            blocker = _blocking_ancestor(path)
            if blocker is not None:
                visible = False
                masks.add(blocker)
    outer = sorted(m for m in masks if not any(m != o and m.startswith(o + "/") for o in masks))
    keep = [p for p in needed if any(p == m or p.startswith(m + "/") for m in outer)]
    keep = sorted({p for p in keep if not any(p != o and p.startswith(o + "/") for o in keep)})
    return outer, keep, visible


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
