"""Starting the sandbox's launcher (portrl/rewards/sandbox_child.py) for one run; portrl/rewards/sandbox.py says
what the run's settings are and finishes it.

:func:`launch` starts ``<base python> -I -S -c BOOTSTRAP FD`` in a new session (its own process group) with the
run's clean environment and the sandbox folder as cwd; the command line names nothing of the host. The launcher
reads from the pipe FD one marshal payload: the run's settings (with ``status_fd``, the write end of the status
pipe it reports on) and the code objects of sandbox_child and its siblings (``CHILD_MODULES``, compiled here once
per process: the child runs only the standard library and opens no file of the checkout). What does not fit in
the pipe's buffer is written after the start. The process group is recorded for the exit cleanup
(portrl/rewards/sandbox_cleanup.py), and killed at once when that cleanup has already run. :class:`Started` is
the run going.
"""

from __future__ import annotations

import fcntl
import functools
import marshal
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from portrl.rewards.sandbox_child import BOOTSTRAP
from portrl.rewards.sandbox_cleanup import note_group
from portrl.rewards.sandbox_host import UidSlot, kill_group

CHILD_MODULES = ("sandbox_child", "sandbox_syscalls", "sandbox_root", "sandbox_seccomp")  # what the child runs


@dataclass
class Started:
    """A sandboxed program that is running: ``proc`` has stdin, stdout and stderr pipes (the program's own).
    :func:`portrl.rewards.sandbox.finish` must follow, whatever happens (it kills what is left, removes the
    folder, frees the uid)."""

    proc: subprocess.Popen
    folder: str
    slot: UidSlot | None
    status_r: int
    cfg: dict
    start: float  # time.monotonic() at the start
    root: bool

    @property
    def deadline(self) -> float:
        return self.start + self.cfg["timeout_s"]


@functools.lru_cache(maxsize=1)
def child_code() -> dict:
    """The code objects of the child and its siblings, compiled once per process (the child runs the same
    Python: the base interpreter of this one)."""
    folder = Path(__file__).parent
    return {name: compile((folder / f"{name}.py").read_text(encoding="utf-8"), f"{name}.py", "exec",
                          dont_inherit=True) for name in CHILD_MODULES}


def _payload_pipe(payload: bytes) -> tuple[int, int | None, bytes]:
    """A pipe holding ``payload`` for the child: (read end, write end or None when all of it is written, the rest
    to write once the child reads)."""
    read_fd, write_fd = os.pipe()
    try:
        if len(payload) > 65536:
            try:
                fcntl.fcntl(write_fd, 1031, len(payload))  # F_SETPIPE_SZ
            except OSError:  # over /proc/sys/fs/pipe-max-size: the rest is written after the start
                pass
        os.set_blocking(write_fd, False)
        view = memoryview(payload)
        try:
            while view:
                view = view[os.write(write_fd, view):]
        except BlockingIOError:
            pass
        if not view:
            os.close(write_fd)
            return read_fd, None, b""
        os.set_blocking(write_fd, True)
        return read_fd, write_fd, bytes(view)
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def launch(settings: dict, slot: UidSlot | None, root: bool) -> Started:
    """Start the launcher for the run ``settings`` describe (the child's settings: "python" runs it, in "cwd" --
    the sandbox folder -- with "env"); ``slot`` is its uid (root), ``root`` whether this process is root."""
    status_r, status_w = os.pipe()
    cfg = {"status_fd": status_w, **settings}
    start = time.monotonic()
    try:
        cfg_r, cfg_w, rest = _payload_pipe(marshal.dumps({"cfg": cfg, "code": child_code()}))
    except BaseException:
        os.close(status_r)
        os.close(status_w)
        raise
    try:
        # the launcher is the base interpreter (the sandbox's own); its command line holds nothing of the host
        proc = subprocess.Popen(
            [cfg["python"], "-I", "-S", "-c", BOOTSTRAP, str(cfg_r)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cfg["cwd"], env=cfg["env"], start_new_session=True,
            pass_fds=(status_w, cfg_r), close_fds=True)
    except BaseException:
        os.close(status_r)
        if cfg_w is not None:
            os.close(cfg_w)
        raise
    finally:
        os.close(status_w)
        os.close(cfg_r)
    if note_group(cfg["cwd"], proc.pid):  # the exit cleanup ran meanwhile: this run must not outlive it
        kill_group(proc.pid)
    if cfg_w is not None:
        try:
            _write_all(cfg_w, rest)
        except OSError:  # the launcher is gone: finish() reports it
            pass
        finally:
            os.close(cfg_w)
    return Started(proc, cfg["cwd"], slot, status_r, cfg, start, root)
