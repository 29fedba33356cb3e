"""Run an untrusted Python program on one input, isolated and limited; a bounded pool runs many.

:func:`run_program` writes the program to a fresh temporary folder (its cwd, HOME and TMPDIR; removed
afterwards) and starts it through portrl.rewards.sandbox_child in a new session (its own process group) with
a clean environment (PATH, LANG, HOME, TMPDIR, and OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS
set to 1; the interpreter runs with ``-I``: no PYTHONPATH, no user site). Each part below is reported on the
:class:`RunResult`.

What the program gets where every part applies (Linux on x86_64 or aarch64; as root, or as any user where
unprivileged user namespaces are on; tested on kernel 6.18 x86_64 as root and as uid 65534):

* its own file system (``root_isolated``, portrl/rewards/sandbox_root.py, the layout in
  portrl/rewards/sandbox_layout.root_layout): a tmpfs root holding, read-only, the base interpreter (the real
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

Where each part lives (every name of ``__all__`` is importable from here): this module holds the limits, the
result and a run from start to finish; the launcher's start and the payload it reads in
portrl/rewards/sandbox_launch.py (the child itself: sandbox_child.py, with sandbox_root.py, sandbox_seccomp.py and
sandbox_syscalls.py), the pipes, the child's report and the status in sandbox_io.py, the runs going and their
cleanup at exit in sandbox_cleanup.py, the uid slots and the process table in sandbox_host.py, the root's layout,
the exposed packages and the folders to mask in sandbox_layout.py (with sandbox_packages.py and
sandbox_interpreter.py), the errors in sandbox_errors.py.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from portrl.rewards.sandbox_cleanup import forget, new_folder, remove_tree
from portrl.rewards.sandbox_errors import SandboxError, SandboxUnisolated, unisolated_message
from portrl.rewards.sandbox_host import (
    UID_BASE,
    UID_COUNT,
    UidSlot,
    kill_group,
    kill_uid,
    live_processes,
    user_task_count,
)
from portrl.rewards.sandbox_io import STATUSES, classify_exit, communicate, exited_by, read_status
from portrl.rewards.sandbox_launch import Started, launch
from portrl.rewards.sandbox_layout import WRITABLE_DIRS, exposed_packages, isolation_view, root_layout
from portrl.rewards.sandbox_packages import DEFAULT_PACKAGES, check_package_names

__all__ = ["DEFAULT_PACKAGES", "STATUSES", "UID_BASE", "UID_COUNT", "WRITABLE_DIRS", "RunResult", "SandboxError",
           "SandboxLimits", "SandboxUnisolated", "Started", "classify_exit", "exposed_packages", "finish",
           "live_processes", "run_program", "shared_pool", "start_program"]

log = logging.getLogger(__name__)

_SETUP_ERROR_EXIT = 121  # the launcher's exit code when it could not start the program (sandbox_child)


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
    missing: tuple[str, ...] = ()  # the isolation parts it ran without (only with allow_unisolated), named by the child


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
    started = start_program(source, limits)
    out, err, timed_out, over = b"", b"", False, False
    try:
        out, err, timed_out, over = communicate(started.proc, stdin.encode("utf-8", "replace"),
                                                limits.output_bytes, limits.stderr_bytes, started.deadline)
        if not (timed_out or over):  # the pipes closed: let the launcher pass the program's status on
            timed_out = not exited_by(started.proc, started.deadline)
    finally:
        result = finish(started, out, err, timed_out, over)
    return result


def start_program(source: str, limits: SandboxLimits = SandboxLimits()) -> Started:
    """Start ``source`` in the sandbox (module docstring) and return at once; :func:`finish` ends it.
    SandboxError when the interpreter is exiting (the runs left are being cleaned up)."""
    root = os.geteuid() == 0
    slot = UidSlot() if root else None
    try:
        tmp = new_folder(slot)
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
        remove_tree(tmp)
        forget(tmp)
        raise


def _start(program: str, tmp: str, limits: SandboxLimits, slot: UidSlot | None, root: bool) -> Started:
    """The child's settings for this run (portrl/rewards/sandbox_child.py reads them), then its launch."""
    uid = slot.uid if slot is not None else None
    masks, keep, visible = isolation_view(tmp, root)
    layout = root_layout(limits.packages)
    # not root: the user's processes count, and with a PID namespace the launcher and init are two of them
    nproc = limits.nproc if root else user_task_count() + limits.nproc + 2
    cfg: dict[str, Any] = {
        "parent_pid": os.getpid(), "python": layout["python"],
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
    return launch(cfg, slot, root)


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
        report = read_status(started.status_r)
    finally:
        if started.slot is not None:
            kill_uid(started.slot.uid)
            started.slot.release()
        remove_tree(started.folder)
        forget(started.folder)
    if report.get("unisolated"):
        raise SandboxUnisolated(unisolated_message(report, root))
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
                     filtered, details, tuple(report.get("missing", ())))


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


# ------------------------------------------------------------------------------------------------- pool
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(max_workers: int) -> ThreadPoolExecutor:
    """One shared thread pool per size (threads only wait on child processes; each run is its own process)."""
    with _pools_lock:
        if max_workers not in _pools:
            _pools[max_workers] = ThreadPoolExecutor(max_workers, thread_name_prefix="portrl-sandbox")
        return _pools[max_workers]

