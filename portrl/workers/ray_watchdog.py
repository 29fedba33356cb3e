"""The watchdog of a local Ray: when the driver that started it ends, however it ends (``kill -9`` of the driver
alone included), every process of that Ray ends within seconds.

Ray ties its own daemons to the driver (it starts the raylet, the GCS and the log monitor with
``PR_SET_PDEATHSIG``), but not what the raylet starts: its agents (dashboard agent, runtime-env agent) outlive a
killed driver by about 60 s and its workers by a few seconds, until they notice the raylet is gone.

:func:`start` (called by :func:`portrl.workers.ray_env.init_ray` just before it starts a local Ray) spawns this
module as a process in a session of its own (a Ctrl-C or a SIGKILL sent to the driver's process group does not
reach it), holding the read end of a pipe whose write end only the driver holds. While the driver lives, the
watchdog records every :data:`POLL_S` the processes of the Ray the driver started: the driver's children whose
executable or script lies in Ray's package folder (raylet, gcs_server, log_monitor, ...) and all their
descendants, each with its start time (a recycled pid is never taken for one of them). When the pipe reaches
end-of-file or the watchdog's parent changes (the driver ended), or once every one of those daemons it saw has
ended while the driver lives (``ray.shutdown``, or a signal sent to them), it sends SIGTERM to each recorded
process still running, SIGKILL to those left after :data:`GRACE_S`, and exits.

A raylet that ends between two polls (a Ctrl-C to the process group while Ray starts) leaves orphans the watchdog
never recorded: agents it had just started, still importing, which notice the raylet gone only once they run.
Those are found by name: Ray calls a local session ``session_<date>_<pid of the driver>`` and passes that name to
every process it starts (``--session-name=``, ``--session-dir=``, ``--session_dir=``); at the end the watchdog also
ends this user's processes started after it whose arguments name a session of its driver (:func:`session_processes`).

A process that starts a second local Ray (after ``ray.shutdown``) first retires the watchdog of the first (:func:`retire_previous`),
whose final sweep by session name would otherwise reach the new Ray.

Nothing else is touched: a Ray the driver joined (``trainer.ray_address``, a cluster built with ``ray start``)
gets no watchdog, and its processes are not the driver's children anyway. Linux only (``/proc``); elsewhere
:func:`start` starts nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Iterable, List, Optional, Set

POLL_S = 0.5  # how often the processes of the Ray are recorded while the driver lives
GRACE_S = 2.0  # after SIGTERM, how long the processes get before SIGKILL

_running: List[subprocess.Popen] = []  # the watchdogs this process started; each holds the pipe's write end


# ------------------------------------------------------------------------------------------ driver side
def start(ray_dir: str) -> Optional[subprocess.Popen]:
    """Start the watchdog of the Ray this process is about to start; ``ray_dir``: Ray's package folder. None
    where there is no ``/proc``."""
    if not os.path.isdir("/proc/self/task"):
        return None
    retire_previous()
    proc = subprocess.Popen(
        [sys.executable, "-m", "portrl.workers.ray_watchdog", str(os.getpid()), os.path.abspath(ray_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _running.append(proc)  # keeps the write end open for as long as this process lives
    threading.Thread(target=proc.wait, name="ray-watchdog-reaper", daemon=True).start()
    return proc


def retire_previous(timeout_s: float = GRACE_S + 8.0) -> None:
    """End the watchdogs of this process's earlier local Rays (``ray.shutdown`` then a new ``ray.init``, as one
    pytest process does module after module) before the next Ray starts: closing the pipe makes each one end what
    is left of its own Ray and exit, and this waits for that. Without it, a watchdog whose Ray had just ended
    swept "every process naming a session of this driver started after it" while the next Ray started, and took
    the new GCS with it (CI: ``ray.init`` then waited in vain for the GCS's port file). One that does not exit
    within ``timeout_s`` is killed."""
    while _running:
        proc = _running.pop()
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------ /proc
def _stat(pid: int) -> Optional[tuple]:
    """(state letter, start time in clock ticks) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> List[int]:
    """The children of ``pid``, whichever of its threads started them."""
    out: List[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out += [int(c) for c in fh.read().split()]
        except (OSError, ValueError):
            continue
    return out


def _argv(pid: int) -> List[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def _program(argv: List[str]) -> List[str]:
    """The executable and, for an interpreter (``python -u script.py``), its script: argv[0] and the first
    argument after it that is not an option."""
    return argv[:1] + [a for a in argv[1:] if not a.startswith("-")][:1]


_SESSION_ARGS = ("--session-name=", "--session-dir=", "--session_dir=")


def _names_session_of(argv: List[str], driver: int) -> bool:
    """Whether an argument names a Ray session of ``driver`` (``session_<date>_<driver pid>``, the name itself or
    a folder of that name)."""
    for arg in argv:
        if arg.startswith(_SESSION_ARGS):
            name = os.path.basename(arg.split("=", 1)[1].rstrip("/"))
            if name.startswith("session_") and name.endswith(f"_{driver}"):
                return True
    return False


def session_processes(driver: int, since: int) -> Dict[int, int]:
    """This user's live processes started at or after ``since`` (clock ticks since boot) whose arguments name a
    Ray session of ``driver``: pid -> start time (module docstring)."""
    out: Dict[int, int] = {}
    uid = os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        st = _stat(pid)
        try:
            mine = os.stat(f"/proc/{pid}").st_uid == uid
        except OSError:
            continue
        if st is not None and st[0] != "Z" and st[1] >= since and mine and _names_session_of(_argv(pid), driver):
            out[pid] = st[1]
    return out


def ray_roots(driver: int, ray_dir: str) -> List[int]:
    """The driver's children that Ray started: their executable or script is in ``ray_dir``."""
    prefix = ray_dir.rstrip("/") + "/"
    return [c for c in children(driver) if any(a.startswith(prefix) for a in _program(_argv(c)))]


def _with_descendants(pids: Iterable[int]) -> Dict[int, int]:
    """``pids`` and every process below them: pid -> start time (live processes only)."""
    out: Dict[int, int] = {}
    todo = list(pids)
    while todo:
        pid = todo.pop()
        st = _stat(pid)
        if pid in out or st is None or st[0] == "Z":
            continue
        out[pid] = st[1]
        todo += children(pid)
    return out


def _alive(known: Dict[int, int]) -> Dict[int, int]:
    """Those of ``known`` that still run as the same process (same start time, not a zombie)."""
    out = {}
    for pid, started in known.items():
        st = _stat(pid)
        if st is not None and st[0] != "Z" and st[1] == started:
            out[pid] = started
    return out


def end_processes(known: Dict[int, int], grace_s: float = GRACE_S) -> None:
    """SIGTERM to each of ``known`` (pid -> start time) still running, SIGKILL to those left after ``grace_s``."""
    known = _with_descendants(_alive(known))  # what they started meanwhile goes too
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        for pid in _alive(known):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while _alive(known) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _alive(known):
            return


# ------------------------------------------------------------------------------------------ the watchdog
def _driver_ended(driver: int, pipe: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the driver to end: end-of-file on the pipe (every copy of its write end
    closed), or a new parent (the driver is gone; a process it forked may still hold the pipe)."""
    try:
        readable, _, _ = select.select([pipe], [], [], timeout_s)
        if readable and not os.read(pipe, 4096):
            return True
    except OSError:
        return True
    return os.getppid() != driver


def watch(driver: int, ray_dir: str, pipe: int = 0) -> None:
    """The watchdog's loop (module docstring)."""
    own = _stat(os.getpid())
    since = own[1] if own else 0
    known: Dict[int, int] = {}
    roots: Set[int] = set()
    while not _driver_ended(driver, pipe, POLL_S):
        new_roots = ray_roots(driver, ray_dir)
        roots |= set(new_roots)
        known = _alive(known) | _with_descendants(new_roots)
        if roots and not _alive({r: known[r] for r in roots if r in known}):
            break  # the Ray the driver started has ended
    end_processes(known | session_processes(driver, since))


def main(argv: List[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's signals are the driver's to act on
        signal.signal(sig, signal.SIG_IGN)
    watch(int(argv[0]), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
