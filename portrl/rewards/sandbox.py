"""Run an untrusted Python program on one input, isolated and limited; a bounded pool runs many.

:func:`run_program` writes the program to a fresh temporary folder (its cwd, HOME and TMPDIR; removed
afterwards) and starts it through portrl.rewards.sandbox_child in a new session (its own process group) with
a clean environment (PATH, LANG, HOME, TMPDIR, and OMP/OPENBLAS/MKL_NUM_THREADS=1; the interpreter runs with
``-I``: no PYTHONPATH, no user site). Each part below is reported on the :class:`RunResult`.

What the program gets where every part applies (Linux on x86_64 or aarch64; as root, or as any user where
unprivileged user namespaces are on; tested on kernel 6.18 x86_64 as root and as uid 65534):

* its own file system (``root_isolated``, portrl/rewards/sandbox_root.py, the layout in
  portrl/rewards/sandbox_host.root_layout): a tmpfs root holding, read-only, the base interpreter (the real
  executable behind a virtual environment's launcher: no virtual environment is needed in there) with its
  standard library (stdlib, lib-dynload) and its library folders (LIBDIR, e.g. libpython or conda's lib), the
  system's programs and shared libraries (/bin, /lib*, /usr/bin, /usr/lib*, /usr/libexec, /etc/alternatives),
  /etc/ld.so.cache, /etc/localtime and /usr/share/zoneinfo; every Python package folder inside those (the
  interpreter's site-packages, any site-packages / dist-packages below the bound library folders) is an empty
  tmpfs, except the interpreter's site folder, which holds only the packages of ``limits.packages`` (below);
  five devices, a /proc of its own (where the kernel refuses a new procfs, e.g. a user namespace under a partly
  masked /proc: none, ``details["proc_error"]``); its own folder (a tmpfs of ``disk_mb``), /tmp and /dev/shm
  (64 MiB each) are the only places it may write. Not there: the checkout, the training data and its ground
  truths, portrl and its package data (the shipped problems and their tests) whether installed editable or not,
  the virtual environment, every other package, home folders, /etc, /usr/local, /usr/src, /usr/share, /opt,
  /var, /sys and every other mount of the host. The interpreter may live anywhere (/tmp, /dev/shm, a home
  folder, /opt, conda): the private /tmp and /dev/shm are mounted before the binds.
* the packages it may import besides the standard library: ``SandboxLimits.packages`` (top-level import names,
  default :data:`DEFAULT_PACKAGES`, numpy), each found in this interpreter without importing it
  (importlib.util.find_spec) and bound read-only into the sandboxed interpreter's site folder with its bundled
  libraries (numpy.libs); their dependencies are not followed (list them too), their metadata (dist-info) is
  not there. A name not installed here is left out (:func:`exposed_packages` says which are available).
* its own PID and IPC namespaces (``pid_isolated``): the program is pid 2, the namespace's init pid 1;
  /proc lists only them and what the program starts; no process of the machine can be seen or signalled.
  When the program exits, init exits and the kernel kills everything else in the namespace, also a process
  that left the process group with setsid(). Init's command line and environment (/proc/1/cmdline, environ)
  hold nothing of the host: it is the base interpreter started with a fixed bootstrap that reads its code and
  the run's settings from a pipe.
* its own network namespace (``network_isolated``; no interface but a down loopback: every connection
  fails, abstract unix sockets included) and mount namespace (``mount_isolated``).
* a seccomp filter (``seccomp_filtered``, portrl/rewards/sandbox_seccomp.py, with no_new_privs): ptrace,
  process_vm_readv/writev, mount, unshare, setns, clone with CLONE_NEW*, bpf, perf_event_open, io_uring,
  keyrings, modules, kexec and a few more fail with EPERM; a syscall of another ABI (i386 ``int 0x80``, x32)
  kills the program with SIGSYS.
* limits (resource.setrlimit): CPU time, address space (``memory_mb``), file size, processes, open files,
  no core files.
* as root: an unprivileged uid/gid of its own (``uid_dropped``; from ``UID_BASE``, one per concurrent run,
  reserved across processes by a lock file in /run/portrl-sandbox-uids), so RLIMIT_NPROC applies and init
  (root's) cannot be signalled; every process left with that uid is killed after the run. As another user
  the program keeps that user's uid inside a user namespace with an identity map (RLIMIT_NPROC counts all of
  the user's processes, so it is set to the user's current count plus ``limits.nproc``).
* it is killed when the process that started it dies (PR_SET_PDEATHSIG on the launcher and on init).

What it does not give: protection from kernel bugs (the kernel is shared) or CPU side channels (timing,
caches, Spectre-class leaks); a /proc without host-wide facts (cpuinfo, meminfo, loadavg, /proc/sys are the
machine's; /proc/self/mountinfo names the host paths of the bound folders, so the path -- not the contents --
of an exposed package's folder, e.g. a virtual environment in the checkout, can be read there); privacy of
anything the caller puts into the program's own source or stdin (a test harness with the expected values in it
can be read by the program); limits on the memory its tmpfs files take (not counted in ``memory_mb``); the
exposed packages' own files and the standard library are readable (they are what it imports).

No unisolated run by surprise: where the platform refuses a part -- the network, mount or PID namespace, the
minimal root, the seccomp filter, or as root the uid drop (Docker's default seccomp profile refuses the
namespaces without CAP_SYS_ADMIN and pivot_root always; AppArmor's docker-default profile refuses mount; kernels
with unprivileged user namespaces off, or restricted as on Ubuntu 24.04, refuse them to a non-root user) -- the
program is not run: :class:`SandboxUnisolated` (one line: what is missing, the kernel's reason, and how to allow
it: for Docker ``--security-opt seccomp=unconfined``, as root also ``--cap-add SYS_ADMIN``, and
``--security-opt apparmor=unconfined`` where AppArmor is on; the sysctls kernel.unprivileged_userns_clone=1,
user.max_user_namespaces, Ubuntu 24.04's kernel.apparmor_restrict_unprivileged_userns=0; or the config key
``sandbox.allow_unisolated=true``). ``SandboxLimits.allow_unisolated=True`` (what that key sets) runs it anyway,
with a warning per missing part logged once per process, and these fallbacks: only the limits, the seccomp
filter and, as root, the uid drop (where that uid can reach the interpreter) apply without namespaces -- the
program runs with this process's own interpreter (sys.executable, its virtual environment and every package),
can read every file its uid may read and see every process (not signal them, when the uid was dropped); where
only the PID namespace is refused, the root is built without /proc; where the root cannot be built (pivot_root
refused, an architecture without a syscall table), the mount namespace hides only the world-writable folders
(/tmp, /var/tmp, /dev/shm, /run/lock), the sandbox folder is still a tmpfs of ``disk_mb`` and /proc is the PID
namespace's. ``SandboxLimits(namespaces=False)`` (no namespaces at all: the caller's choice of no isolation)
is refused (ValueError) unless allow_unisolated=True is given with it. Kernels before 5.12 make each bound
folder's top mount read-only, not mounts below it (no mount_setattr). Elsewhere than Linux only the rlimits, the
process-group kill and the clean environment would apply: refused unless allow_unisolated, untested.

The wall-time limit (``timeout_s``) kills the whole process group (SIGKILL); stdout is read up to
``output_bytes`` (more: the group is killed, status "output_limit"; the same for more stderr than that);
stderr keeps its last ``stderr_bytes``.
The process group is killed after every run, so nothing the program started outlives it. At interpreter exit
(before threads are joined: a run abandoned in a thread, e.g. a tool call past the agent loop's timeout, is
not waited for) every run still going is killed and its folder removed; a process killed by a signal
(SIGKILL) cannot clean up: its programs die with it (PR_SET_PDEATHSIG), their folders stay in TMPDIR.
The uid slots, the process table, that cleanup, the root's layout, the exposed packages and the folders to
mask live in portrl/rewards/sandbox_host.py.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import logging
import marshal
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
from typing import Any

from portrl.rewards.sandbox_child import BOOTSTRAP
from portrl.rewards.sandbox_host import (
    DEFAULT_PACKAGES,
    UID_BASE,
    UID_COUNT,
    WRITABLE_DIRS,
    SandboxError,
    UidSlot,
    check_package_names,
    exposed_packages,
    isolation_view,
    kill_group,
    kill_uid,
    live_processes,
    root_layout,
    user_task_count,
)

__all__ = ["DEFAULT_PACKAGES", "STATUSES", "UID_BASE", "UID_COUNT", "WRITABLE_DIRS", "RunResult", "SandboxError",
           "SandboxLimits", "SandboxUnisolated", "Started", "classify_exit", "exposed_packages", "finish",
           "live_processes", "run_program", "shared_pool", "start_program"]

log = logging.getLogger(__name__)

STATUSES = ("ok", "wrong", "timeout", "memory", "output_limit", "runtime_error", "syntax_error")
_MODULES = ("sandbox_child", "sandbox_syscalls", "sandbox_root", "sandbox_seccomp")  # what the child runs
_SETUP_ERROR_EXIT = 121
ALLOW_KEY = "sandbox.allow_unisolated=true"  # the config key that accepts running without isolation


class SandboxUnisolated(SandboxError):
    """The platform refuses parts of the isolation and ``SandboxLimits.allow_unisolated`` is False: the program
    was not run. The message (one line) names what is missing, the kernel's reason and how to allow it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. ``cpu_s`` None: the wall time rounded up (CPU time never exceeds wall time for a
    single thread; more processes share the wall limit anyway). ValueError (one line) for ``packages`` that are not
    top-level import names (or name portrl), and for ``namespaces=False`` without ``allow_unisolated=True``."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    cpu_s: float | None = None
    file_size_mb: int = 16
    disk_mb: int = 64  # all files written in the sandbox folder (with a mount namespace: a tmpfs of this size)
    nproc: int = 16
    nofile: int = 64
    output_bytes: int = 4 * 1024 * 1024
    stderr_bytes: int = 8192
    namespaces: bool = True  # False: no namespaces (and so no minimal root) -- only with allow_unisolated=True
    # run the program even where the platform refuses parts of the isolation (module docstring); False: such a run
    # raises SandboxUnisolated and the program never starts
    allow_unisolated: bool = False
    # top-level import names a program may import besides the standard library (each bound into the sandbox
    # where this interpreter has it installed; exposed_packages says which are)
    packages: tuple[str, ...] = DEFAULT_PACKAGES

    def __post_init__(self) -> None:
        object.__setattr__(self, "packages", check_package_names(self.packages))
        if not self.namespaces and not self.allow_unisolated:
            raise ValueError("SandboxLimits(namespaces=False) runs programs without isolation: pass "
                             "allow_unisolated=True too")


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
    mount_isolated: bool = False  # a new mount namespace (private /tmp, /dev/shm; the sandbox folder a tmpfs)
    uid_dropped: bool = False  # ran as its own unprivileged uid (root only), ``details["uid"]``
    pid_isolated: bool = False  # new PID and IPC namespaces: the program is pid 2, its init pid 1
    root_isolated: bool = False  # the minimal root: only its folder, the interpreter, /usr (read-only)
    seccomp_filtered: bool = False  # the seccomp filter of portrl.rewards.sandbox_seccomp
    details: dict = field(default_factory=dict)  # "uid" when dropped; why a step failed ("*_error")


_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key not in _warned:
            _warned.add(key)
            log.warning(message)


# ------------------------------------------------------------------------------------------------ a run
@dataclass
class Started:
    """A sandboxed program that is running: ``proc`` has stdin, stdout and stderr pipes (the program's own).
    :func:`finish` must follow, whatever happens (it kills what is left, removes the folder, frees the uid)."""

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


def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``source`` (Python) with ``stdin`` under ``limits``; a RunResult whatever the program does.
    SandboxError only when the sandbox itself cannot start it."""
    started = start_program(source, limits)
    out, err, timed_out, over = b"", b"", False, False
    try:
        out, err, timed_out, over = _communicate(started.proc, stdin.encode("utf-8", "replace"), limits,
                                                 started.deadline)
        if not (timed_out or over):  # the pipes closed: let the launcher pass the program's status on
            timed_out = not _exited_by(started.proc, started.deadline)
    finally:
        result = finish(started, out, err, timed_out, over)
    return result


def start_program(source: str, limits: SandboxLimits = SandboxLimits()) -> Started:
    """Start ``source`` in the sandbox (module docstring) and return at once; :func:`finish` ends it.
    SandboxError when the interpreter is exiting (the runs left are being cleaned up)."""
    root = os.geteuid() == 0
    slot = UidSlot() if root else None
    try:
        tmp = _new_folder(slot)
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
        return _start(program, tmp, limits, slot, root)
    except BaseException:
        if slot is not None:
            kill_uid(slot.uid)
            slot.release()
        _remove_tree(tmp)
        _forget(tmp)
        raise


# ------------------------------------------------------------------------------- runs left at interpreter exit
@dataclass
class _Live:
    slot: UidSlot | None
    pgid: int | None = None


_live: dict[str, _Live] = {}  # sandbox folder -> what to kill and free if the process exits with the run going
_live_lock = threading.Lock()
_exiting = False


def _new_folder(slot: UidSlot | None) -> str:
    with _live_lock:
        if _exiting:
            raise SandboxError("the interpreter is exiting: no new sandbox runs")
        tmp = tempfile.mkdtemp(prefix="portrl-sandbox-")
        _live[tmp] = _Live(slot)
        return tmp


def _forget(folder: str) -> None:
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
        _remove_tree(folder)


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


@functools.lru_cache(maxsize=1)
def _child_code() -> dict:
    """The code objects of the child and its siblings, compiled once per process (the child runs the same
    Python: the base interpreter of this one)."""
    folder = Path(__file__).parent
    return {name: compile((folder / f"{name}.py").read_text(encoding="utf-8"), f"{name}.py", "exec",
                          dont_inherit=True) for name in _MODULES}


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


def _start(program: str, tmp: str, limits: SandboxLimits, slot: UidSlot | None, root: bool) -> Started:
    uid = slot.uid if slot is not None else None
    masks, keep, visible = isolation_view(tmp, root)
    layout = root_layout(limits.packages)
    # not root: the user's processes count, and with a PID namespace the launcher and init are two of them
    nproc = limits.nproc if root else user_task_count() + limits.nproc + 2
    status_r, status_w = os.pipe()
    cfg: dict[str, Any] = {
        "status_fd": status_w, "parent_pid": os.getpid(), "python": layout["python"],
        "python_host": sys.executable, "cwd": tmp, "allow_unisolated": limits.allow_unisolated,
        "program": os.path.basename(program), "uid": uid, "gid": uid, "namespaces": limits.namespaces,
        "masks": masks, "keep": keep, "interpreter_visible": visible, "layout": layout,
        "cpu_s": math.ceil(limits.cpu_s if limits.cpu_s is not None else limits.timeout_s),
        "timeout_s": limits.timeout_s,
        "memory_mb": limits.memory_mb, "file_size_mb": limits.file_size_mb, "disk_mb": limits.disk_mb,
        "nofile": limits.nofile, "nproc": nproc,
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp,
                # one thread per math library (as verl): a thread pool per core would hit RLIMIT_NPROC
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    }
    start = time.monotonic()
    try:
        cfg_r, cfg_w, rest = _payload_pipe(marshal.dumps({"cfg": cfg, "code": _child_code()}))
    except BaseException:
        os.close(status_r)
        os.close(status_w)
        raise
    try:
        # the launcher is the base interpreter (the sandbox's own); its command line holds nothing of the host
        proc = subprocess.Popen(
            [layout["python"], "-I", "-S", "-c", BOOTSTRAP, str(cfg_r)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp, env=cfg["env"], start_new_session=True,
            pass_fds=(status_w, cfg_r), close_fds=True)
    except BaseException:
        os.close(status_r)
        if cfg_w is not None:
            os.close(cfg_w)
        raise
    finally:
        os.close(status_w)
        os.close(cfg_r)
    with _live_lock:
        run = _live.get(tmp)
        if run is not None:
            run.pgid = proc.pid
        exiting = _exiting
    if exiting:  # the exit cleanup ran meanwhile: this run must not outlive it
        kill_group(proc.pid)
    if cfg_w is not None:
        try:
            _write_all(cfg_w, rest)
        except OSError:  # the launcher is gone: finish() reports it
            pass
        finally:
            os.close(cfg_w)
    return Started(proc, tmp, slot, status_r, cfg, start, root)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def finish(started: Started, out: bytes, err: bytes, timed_out: bool, over: bool) -> RunResult:
    """End a started program (kill its group, free its uid, remove its folder) and describe its run: ``out`` and
    ``err`` are what was read of its stdout and stderr, ``timed_out`` / ``over`` whether a limit stopped it.
    SandboxError when the sandbox itself could not start the program."""
    proc, cfg, root = started.proc, started.cfg, started.root
    try:
        elapsed = time.monotonic() - started.start
        kill_group(proc.pid)
        if proc.poll() is None:
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:  # a stdin pipe whose reader is gone
                    pass
        report = _read_status(started.status_r)
    finally:
        if started.slot is not None:
            kill_uid(started.slot.uid)
            started.slot.release()
        _remove_tree(started.folder)
        _forget(started.folder)
    if report.get("unisolated"):
        raise SandboxUnisolated(_unisolated_message(report, root))
    if "error" in report or (proc.returncode == _SETUP_ERROR_EXIT and not report):
        raise SandboxError(f"the sandbox could not start the program: {report.get('error', 'no report')}")
    net, mnt, dropped = bool(report.get("net")), bool(report.get("mnt")), bool(report.get("uid_dropped"))
    pid, new_root, filtered = bool(report.get("pid")), bool(report.get("root")), bool(report.get("seccomp"))
    if cfg["namespaces"]:
        _warn_missing(report, net, pid, new_root)
    if not filtered:
        _warn_once("seccomp", "code sandbox: no seccomp filter on this platform "
                              f"({report.get('seccomp_error', 'unknown reason')}); programs can ptrace, mount, ...")
    if root and not dropped:
        _warn_once("uid", "code sandbox: running as root without a uid drop (the interpreter is not reachable "
                          "by an unprivileged uid and no mount namespace); RLIMIT_NPROC does not apply to root")
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    status = classify_exit(proc.returncode, stderr, timed_out, over, elapsed, cfg["cpu_s"])
    details = {k: v for k, v in report.items() if k.endswith("error")}
    if dropped:
        details["uid"] = cfg["uid"]
    return RunResult(status, stdout, stderr, elapsed, proc.returncode, proc.pid, net, mnt, dropped, pid, new_root,
                     filtered, details)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _unisolated_message(report: dict, root: bool) -> str:
    """One line: what the platform refused (the kernel's reasons) and the ways to allow it."""
    reasons = []
    for key, what in (("ns_error", "unshare"), ("mnt_error", "mount"), ("root_error", "minimal root"),
                      ("seccomp_error", "seccomp")):
        if report.get(key):
            reasons.append(f"{what}: {_one_line(report[key])}")
    if root and not report.get("uid_dropped") and "uid drop" in report["unisolated"]:
        reasons.append("uid drop: no mount namespace, and the interpreter is out of an unprivileged uid's reach")
    docker = "--security-opt seccomp=unconfined" + (" --cap-add SYS_ADMIN" if root else "")
    return (f"the code sandbox cannot isolate programs here and does not run them without isolation: no "
            f"{', '.join(report['unisolated'])} ({'; '.join(reasons) or 'no reason given'}); in Docker run the "
            f"container with {docker} (and --security-opt apparmor=unconfined where AppArmor is on); on a host "
            "with unprivileged user namespaces off set the sysctls kernel.unprivileged_userns_clone=1 and "
            "user.max_user_namespaces=15000 (Ubuntu 24.04 also kernel.apparmor_restrict_unprivileged_userns=0); "
            f"or accept running programs without isolation with {ALLOW_KEY}")


def _warn_missing(report: dict, net: bool, pid: bool, new_root: bool) -> None:
    why = report.get("ns_error", "unknown reason")
    if not net:
        _warn_once("net", f"code sandbox: no new network namespace on this platform ({why}); programs can reach "
                          "the network")
    if not pid:
        _warn_once("pid", f"code sandbox: no new PID namespace on this platform ({why}); programs can see the "
                          "machine's processes")
    if not new_root:
        why = report.get("root_error") or report.get("mnt_error") or why
        _warn_once("root", f"code sandbox: no private root file system on this platform ({why}); programs can "
                           "read every file their uid may read (the checkout, training data, ground truths)")


def _exited_by(proc: subprocess.Popen, deadline: float) -> bool:
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


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
    stdin_pipe, stdout_pipe, stderr_pipe = proc.stdin, proc.stdout, proc.stderr
    if stdin_pipe is None or stdout_pipe is None or stderr_pipe is None:
        raise ValueError("_communicate needs a process started with stdin, stdout and stderr pipes")
    sel = selectors.DefaultSelector()
    for stream in (stdin_pipe, stdout_pipe, stderr_pipe):
        os.set_blocking(stream.fileno(), False)
    if data:
        sel.register(stdin_pipe, selectors.EVENT_WRITE)
    else:
        stdin_pipe.close()
    sel.register(stdout_pipe, selectors.EVENT_READ)
    sel.register(stderr_pipe, selectors.EVENT_READ)
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
                if key.fileobj is stdin_pipe:
                    try:
                        view = view[os.write(stdin_pipe.fileno(), view[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the program closed its stdin
                        view = view[:0]
                    if not view:
                        sel.unregister(stdin_pipe)
                        stdin_pipe.close()  # EOF: reading past it gets "" / EOFError
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is stdout_pipe:
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
        for stream in (stdin_pipe, stdout_pipe, stderr_pipe):
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

