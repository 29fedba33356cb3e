"""Run an untrusted Python program on one input, isolated and limited; a bounded pool runs many.

:func:`run_program` writes the program to a fresh temporary folder (its cwd, HOME and TMPDIR; removed
afterwards) and starts it through portrl.rewards.sandbox_child in a new session (its own process group) with
a clean environment (PATH, LANG, HOME, TMPDIR, and OMP/OPENBLAS/MKL_NUM_THREADS=1; the interpreter runs with
``-I``: no PYTHONPATH, no user site). Before exec the child sets up, in this order (each reported on the
:class:`RunResult`):

* a new network namespace (no interface but a down loopback: every connection fails) and a new mount
  namespace in which /tmp, /var/tmp, /dev/shm and /run/lock are private, empty tmpfs mounts and the sandbox
  folder is a tmpfs of ``disk_mb`` (without one, files are bounded only by ``file_size_mb`` each). As root
  this is ``unshare(CLONE_NEWNET|CLONE_NEWNS)``; as another user
  ``unshare(CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWNS)``. Where the platform refuses (Docker's default seccomp
  profile without CAP_SYS_ADMIN, kernels with unprivileged user namespaces off), the program runs without
  them: ``network_isolated`` / ``mount_isolated`` are False and a warning is logged once per process.
* limits (resource.setrlimit): CPU time, address space (``memory_mb``), file size, processes, open files,
  no core files.
* as root: the program runs as an unprivileged uid/gid of its own (from ``UID_BASE``, one per concurrent run,
  reserved across processes by a lock file in /run/portrl-sandbox-uids), so RLIMIT_NPROC applies (root is
  exempt from it), files outside the sandbox folder are writable only where the world may write (and those
  folders are private tmpfs when the mount namespace worked), and every process left with that uid is killed
  after the run, also one that left the process group with setsid(). Folders that hide the interpreter or the
  sandbox folder from that uid (Python under /root, a TMPDIR only root may enter) are replaced by a tmpfs in
  the mount namespace with just those paths bound back; without a mount namespace the uid is then not
  dropped (``uid_dropped`` False, a warning once).
* the program is killed when the process that started it dies (PR_SET_PDEATHSIG).

Not root: the program runs as the calling user. RLIMIT_NPROC counts all of that user's processes, so the
limit is set to the user's current count plus ``limits.nproc``; the program can write wherever the user can
(except the private tmpfs folders when the mount namespace worked); a process that leaves the process group
with setsid() survives the group kill. There is no PID namespace on any platform: the program can see (not
signal, when the uid was dropped) other processes.

Written for Linux (namespaces, /proc, prctl); elsewhere only the rlimits, the process-group kill and the
clean environment apply, untested.

The wall-time limit (``timeout_s``) kills the whole process group (SIGKILL); stdout is read up to
``output_bytes`` (more: the group is killed, status "output_limit"; the same for more stderr than that);
stderr keeps its last ``stderr_bytes``.
The process group is killed after every run, so nothing the program started outlives it.
The uid slots, the process table, that cleanup and the folders to mask live in portrl/rewards/sandbox_host.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from portrl.rewards.sandbox_host import (
    UID_BASE,
    UID_COUNT,
    WRITABLE_DIRS,
    SandboxError,
    UidSlot,
    isolation_view,
    kill_group,
    kill_uid,
    live_processes,
    user_task_count,
)

__all__ = ["STATUSES", "UID_BASE", "UID_COUNT", "WRITABLE_DIRS", "RunResult", "SandboxError", "SandboxLimits",
           "classify_exit", "live_processes", "run_program", "shared_pool"]

log = logging.getLogger(__name__)

STATUSES = ("ok", "wrong", "timeout", "memory", "output_limit", "runtime_error", "syntax_error")
_CHILD = Path(__file__).with_name("sandbox_child.py")
_SETUP_ERROR_EXIT = 121


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. ``cpu_s`` None: the wall time rounded up (CPU time never exceeds wall time for a
    single thread; more processes share the wall limit anyway)."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    cpu_s: float | None = None
    file_size_mb: int = 16
    disk_mb: int = 64  # all files written in the sandbox folder (with a mount namespace: a tmpfs of this size)
    nproc: int = 16
    nofile: int = 64
    output_bytes: int = 4 * 1024 * 1024
    stderr_bytes: int = 8192
    namespaces: bool = True


@dataclass
class RunResult:
    """One run: ``status`` is one of STATUSES ("wrong" is set by a scorer comparing ``stdout``)."""

    status: str
    stdout: str
    stderr: str  # the last SandboxLimits.stderr_bytes
    time_s: float
    returncode: int | None
    pid: int  # also the process group id (the group is gone when this is returned)
    network_isolated: bool = False  # a new network namespace
    mount_isolated: bool = False  # a new mount namespace with private /tmp, /var/tmp, /dev/shm, /run/lock
    uid_dropped: bool = False  # ran as its own unprivileged uid (root only), ``details["uid"]``
    details: dict = field(default_factory=dict)  # "uid" when dropped; why a namespace step failed


_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key not in _warned:
            _warned.add(key)
            log.warning(message)


# ------------------------------------------------------------------------------------------------ a run
def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``source`` (Python) with ``stdin`` under ``limits``; a RunResult whatever the program does.
    SandboxError only when the sandbox itself cannot start it."""
    root = os.geteuid() == 0
    slot = UidSlot() if root else None
    try:
        tmp = tempfile.mkdtemp(prefix="portrl-sandbox-")
    except BaseException:
        if slot is not None:
            slot.release()
        raise
    try:
        program = os.path.join(tmp, "main.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        if slot is not None:
            os.chown(tmp, slot.uid, slot.uid)
            os.chmod(program, 0o644)
        return _run(program, tmp, stdin, limits, slot.uid if slot else None, root)
    finally:
        if slot is not None:
            kill_uid(slot.uid)
            slot.release()
        _remove_tree(tmp)


def _remove_tree(path: str) -> None:
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


def _run(program: str, tmp: str, stdin: str, limits: SandboxLimits, uid: int | None, root: bool) -> RunResult:
    masks, keep, visible = isolation_view(tmp, root)
    nproc = limits.nproc if root else user_task_count() + limits.nproc
    status_r, status_w = os.pipe()
    cfg = {
        "status_fd": status_w, "parent_pid": os.getpid(), "python": sys.executable, "cwd": tmp,
        "program": os.path.basename(program), "uid": uid, "gid": uid, "namespaces": limits.namespaces,
        "masks": masks, "keep": keep, "interpreter_visible": visible,
        "cpu_s": math.ceil(limits.cpu_s if limits.cpu_s is not None else limits.timeout_s),
        "memory_mb": limits.memory_mb, "file_size_mb": limits.file_size_mb, "disk_mb": limits.disk_mb,
        "nofile": limits.nofile, "nproc": nproc,
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp,
                # one thread per math library (as verl): a thread pool per core would hit RLIMIT_NPROC
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    }
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_CHILD), json.dumps(cfg)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp, env=cfg["env"], start_new_session=True,
            pass_fds=(status_w,), close_fds=True)
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:
        out, err, timed_out, over = _communicate(proc, stdin.encode("utf-8", "replace"), limits,
                                                 start + limits.timeout_s)
        elapsed = time.monotonic() - start
    finally:
        kill_group(proc.pid)
        if proc.poll() is None:
            proc.wait()
        report = _read_status(status_r)
    if "error" in report or (proc.returncode == _SETUP_ERROR_EXIT and not report):
        raise SandboxError(f"the sandbox could not start the program: {report.get('error', 'no report')}")
    net, mnt, dropped = bool(report.get("net")), bool(report.get("mnt")), bool(report.get("uid_dropped"))
    if limits.namespaces and not net:
        _warn_once("net", "code sandbox: no new network namespace on this platform "
                          f"({report.get('ns_error', 'unknown reason')}); programs can reach the network")
    if root and not dropped:
        _warn_once("uid", "code sandbox: running as root without a uid drop (the interpreter is not reachable "
                          "by an unprivileged uid and no mount namespace); RLIMIT_NPROC does not apply to root")
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    status = classify_exit(proc.returncode, stderr, timed_out, over, elapsed, cfg["cpu_s"])
    details = {k: v for k, v in report.items() if k.endswith("error")}
    if dropped:
        details["uid"] = uid
    return RunResult(status, stdout, stderr, elapsed, proc.returncode, proc.pid, net, mnt, dropped, details)


def _read_status(fd: int) -> dict:
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    report: dict = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except json.JSONDecodeError:
            report["error"] = f"unreadable status {line[:200]!r}"
    return report


def _communicate(proc: subprocess.Popen, data: bytes, limits: SandboxLimits,
                 deadline: float) -> tuple[bytes, bytes, bool, bool]:
    """(stdout, stderr tail, timed out, stdout or stderr over ``output_bytes``). Writes stdin as the program reads it, reads
    both pipes, and stops at the deadline, at the cap, or shortly after the program exits (a background
    process it left holding the pipes does not keep the run going)."""
    sel = selectors.DefaultSelector()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
    if data:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    out, err = bytearray(), bytearray()
    view, timed_out, over, exited_at, err_total = memoryview(data), False, False, None, 0
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in sel.select(min(deadline - now, 0.05)):
                if key.fileobj is proc.stdin:
                    try:
                        view = view[os.write(proc.stdin.fileno(), view[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the program closed its stdin
                        view = view[:0]
                    if not view:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()  # EOF: reading past it gets "" / EOFError
                    continue
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is proc.stdout:
                    out += chunk
                    if len(out) > limits.output_bytes:
                        over = True
                else:
                    err += chunk
                    err_total += len(chunk)
                    del err[:-limits.stderr_bytes]
                    over = over or err_total > limits.output_bytes
            if over:
                break
    finally:
        sel.close()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if not stream.closed:
                stream.close()
    return bytes(out[:limits.output_bytes]), bytes(err), timed_out, over


def classify_exit(returncode: int | None, stderr: str, timed_out: bool, over: bool, elapsed: float,
              cpu_s: int) -> str:
    if over:
        return "output_limit"
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == 0:
        return "ok"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if last.startswith("MemoryError"):
        return "memory"
    if last.startswith(("SyntaxError", "IndentationError", "TabError")) and "Traceback" not in stderr:
        return "syntax_error"  # a compile error of the program itself prints no traceback
    if returncode == -signal.SIGKILL and elapsed >= cpu_s:
        return "timeout"  # the hard CPU limit
    return "runtime_error"


# ------------------------------------------------------------------------------------------------- pool
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(max_workers: int) -> ThreadPoolExecutor:
    """One shared thread pool per size (threads only wait on child processes; each run is its own process)."""
    with _pools_lock:
        if max_workers not in _pools:
            _pools[max_workers] = ThreadPoolExecutor(max_workers, thread_name_prefix="portrl-sandbox")
        return _pools[max_workers]

