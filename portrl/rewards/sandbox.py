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
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import pwd
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STATUSES = ("ok", "wrong", "timeout", "memory", "output_limit", "runtime_error", "syntax_error")
UID_BASE = 64200  # sandbox uids UID_BASE .. UID_BASE + UID_COUNT - 1 (root only; Debian leaves 60000-64999 free)
UID_COUNT = 256
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_CHILD = Path(__file__).with_name("sandbox_child.py")
_SETUP_ERROR_EXIT = 121


class SandboxError(RuntimeError):
    """The sandbox itself could not start a program (not the program's fault): the message says why."""


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


# ------------------------------------------------------------------------------------------- uid slots
class _UidSlot:
    """A sandbox uid no other run (in any process) uses now, held by an exclusive lock file; root only."""

    def __init__(self):
        # one place for every process of the machine (not TMPDIR, which differs between processes)
        lock_dir = Path("/run" if os.path.isdir("/run") else tempfile.gettempdir()) / "portrl-sandbox-uids"
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        busy = _uids_with_tasks()
        for uid in range(UID_BASE, UID_BASE + UID_COUNT):
            # a uid with processes (a leftover zombie would count against RLIMIT_NPROC) or an account (its files
            # would be the program's, and its processes are killed after the run) is never used
            if uid in busy or _is_account(uid):
                continue
            fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
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


def _kill_uid(uid: int) -> None:
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


def _user_task_count() -> int:
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


def _view(sandbox_dir: str, root: bool) -> tuple[list[str], list[str], bool]:
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
    masks = sorted(m for m in masks if not any(m != o and m.startswith(o + "/") for o in masks))
    keep = [p for p in needed if any(p == m or p.startswith(m + "/") for m in masks)]
    keep = sorted({p for p in keep if not any(p != o and p.startswith(o + "/") for o in keep)})
    return masks, keep, visible


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
    slot = _UidSlot() if root else None
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
            _kill_uid(slot.uid)
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
    masks, keep, visible = _view(tmp, root)
    nproc = limits.nproc if root else _user_task_count() + limits.nproc
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
        _kill_group(proc.pid)
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


def _kill_group(pgid: int) -> None:
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

