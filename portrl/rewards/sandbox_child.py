"""The child side of portrl.rewards.sandbox: set up isolation, then exec the program's interpreter.

Started by :func:`portrl.rewards.sandbox_launch.launch` (for :func:`portrl.rewards.sandbox.start_program`) as
``<base python> -I -S -c BOOTSTRAP FD`` in a new session (its own process group), with the sandbox folder as cwd
and a clean environment. :data:`BOOTSTRAP` reads the payload the host wrote to the pipe FD (marshal: the run's
settings and the code objects of this module and its siblings sandbox_syscalls, sandbox_root and sandbox_seccomp,
compiled by the host) and calls :func:`main`: no file of the checkout is read here, and the command line -- what
/proc/1/cmdline shows the program -- names neither a path of the host, its pid nor the root's layout. It imports
only the standard library, and does, in this order, before ``execve``:

1. namespaces: as root ``unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC)``; otherwise the
   same with CLONE_NEWUSER and an identity uid/gid map. Where that is refused, the same without the PID and
   IPC namespaces, then (root) a network namespace alone. Each step is tried and reported (a container's seccomp
   profile often refuses them).
2. with a PID namespace this process (the launcher) forks the namespace's init (pid 1), waits for it and exits
   the way the program did (its exit code, or killed by the same signal), so the caller sees the program's
   status. Init builds the file system view, forks the program (pid 2), reaps every process of the namespace
   and exits when the program has; the kernel then kills whatever else is left in the namespace. Both hold
   /dev/null as stdin/stdout/stderr, so the pipes belong to the program alone.
3. in the new mount namespace (mounts made private): the minimal root of portrl.rewards.sandbox_root (the
   program's folder as a tmpfs of ``disk_mb``, the base interpreter, its standard library and the exposed
   packages, the system's programs and libraries read-only, /dev, /tmp, a fresh /proc of the PID namespace;
   nothing else of the host). Where that fails (e.g. pivot_root refused), the earlier view: a small private tmpfs
   over every world-writable folder (/tmp, /var/tmp, /dev/shm, /run/lock) and over the folders that hide the
   interpreter from the sandbox user, the needed folders bound back, and a tmpfs of ``disk_mb`` over the sandbox
   folder, and a fresh /proc of the PID namespace -- the rest of the host stays readable.
4. resource limits (CPU time, address space, file size, processes, open files, no core files).
5. as root: drop to the sandbox uid/gid (no supplementary groups), so that RLIMIT_NPROC applies (root is
   exempt from it) and only world-writable files outside the sandbox folder are writable.
6. SIGKILL on the parent's death (prctl PR_SET_PDEATHSIG) for the launcher and for init, so a reward process
   terminated mid-run takes the program with it (without a PID namespace: the program itself, processes it
   forked are not covered).
7. no_new_privs and the seccomp filter of portrl.rewards.sandbox_seccomp (on x86_64 and aarch64).
8. the check: when any part is missing (a namespace, the minimal root, the filter; as root the uid drop) and the
   settings do not allow running without it (``allow_unisolated``), the program is NOT executed: the report
   names the missing parts ("unisolated") and this process exits with code 121.

Then it executes the program: in the minimal root with the base interpreter (``python``), elsewhere with the host
process's own (``python_host``: its virtual environment, as before the root existed), both with ``-I``. What it
managed is written as one JSON line to the status pipe (fd ``status_fd``, closed by the exec); an error before or
in exec is written there as a line {"error": ...}, with exit code 121.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import types
from typing import NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
SETUP_ERROR_EXIT = 121


def _load(name: str, code) -> types.ModuleType:
    """A sibling module from its code object (compiled by the host, passed in the payload): no file of the
    checkout is opened here, and importing the portrl package would import far more than the sandbox needs."""
    module = types.ModuleType(name)
    module.__file__ = name + ".py"
    sys.modules[name] = module
    exec(code, module.__dict__)  # noqa: S102 - the host's own module, compiled by the host
    return module


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(fn, *args) -> str | None:
    """None when the libc call succeeded, else the error text."""
    if fn(*args) == 0:
        return None
    err = ctypes.get_errno()
    return f"{os.strerror(err)} (errno {err})"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _report(status_fd: int, report: dict) -> None:
    os.write(status_fd, (json.dumps(report) + "\n").encode())


# ------------------------------------------------------------------------------------------- namespaces
def _namespaces(libc, root: bool) -> dict:
    """Try new network, mount, PID and IPC namespaces; {"net", "mnt", "pid": bool, "ns_error": str?}."""
    report: dict[str, bool | str] = {"net": False, "mnt": False, "pid": False}
    if not hasattr(libc, "unshare"):
        return {**report, "ns_error": "no unshare() on this platform (Linux only)"}
    user = 0 if root else CLONE_NEWUSER
    err = _call(libc.unshare, user | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC)
    if err is None:
        report.update(net=True, mnt=True, pid=True)
    else:
        report["ns_error"] = err
        if _call(libc.unshare, user | CLONE_NEWNET | CLONE_NEWNS) is None:
            report.update(net=True, mnt=True)
        elif root and _call(libc.unshare, CLONE_NEWNET) is None:
            report["net"] = True
    if root or not report["net"]:
        return report
    uid, gid = os.getuid(), os.getgid()
    try:  # identity map: files created keep the user's ids (an unmapped fsuid cannot create files)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as exc:
        report.update(mnt=False, ns_error=f"uid map: {exc}")
    return report


def _die_with_parent(libc, parent_pid: int | None = None, lifeline: int | None = None) -> None:
    """SIGKILL when the parent dies; exit now if it already has (by pid, or by EOF on a ``lifeline`` pipe)."""
    if not hasattr(libc, "prctl"):
        return
    libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL))
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(SETUP_ERROR_EXIT)
    if lifeline is not None:
        os.set_blocking(lifeline, False)
        try:
            if os.read(lifeline, 1) == b"":
                os._exit(SETUP_ERROR_EXIT)
        except BlockingIOError:  # the launcher is alive and holds the write end
            pass
        os.close(lifeline)


def _quiet_stdio() -> None:
    """/dev/null as stdin, stdout, stderr: the program's pipes reach EOF when the program's side closes them."""
    try:
        null = os.open("/dev/null", os.O_RDWR)
    except OSError:
        for fd in (0, 1, 2):
            os.close(fd)
        return
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _mirror(status: int) -> NoReturn:
    """Exit as a process with wait status ``status`` did: the same exit code, or killed by the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)  # RLIMIT_CORE is 0: no core file for SIGSEGV, SIGXCPU, ...
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else SETUP_ERROR_EXIT)


def _start_init(libc) -> int:
    """Fork the PID namespace's init. In the launcher: wait for it and exit as the program did (never returns).
    In init: returns the pipe on which init passes the program's wait status to the launcher."""
    exit_r, exit_w = os.pipe()
    life_r, life_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(exit_r)
        os.close(life_w)
        _die_with_parent(libc, lifeline=life_r)
        return exit_w
    os.close(exit_w)
    os.close(life_r)
    _quiet_stdio()
    _, status = os.waitpid(pid, 0)
    os.set_blocking(exit_r, False)
    try:
        data = os.read(exit_r, 32)
    except BlockingIOError:
        data = b""
    _mirror(int(data) if data else status)


def _run_init(exit_w: int) -> None:
    """Fork the program; in init reap every process of the namespace until the program is gone, pass its wait
    status on and exit (never returns); in the program: return."""
    # pid 1 ignores the signals it has no handler for; Python's SIGINT handler would let the program stop init
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    program = os.fork()
    if program == 0:
        os.close(exit_w)
        return
    _quiet_stdio()
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(SETUP_ERROR_EXIT)
        if pid == program:
            os.write(exit_w, str(status).encode())
            os._exit(0)


# ------------------------------------------------------------------------------------------ file system
def _mask_and_bind(libc, masks: list, keep: list) -> None:
    """Private tmpfs over each folder in ``masks``; then each folder in ``keep`` bound back at its path."""
    b = os.fsencode
    fds = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in keep]  # reachable after masking
    for path in masks:
        mode = "1777" if os.stat(path).st_mode & 0o002 else "0755"
        err = _call(libc.mount, b"tmpfs", b(path), b"tmpfs", MS_NOSUID | MS_NODEV, b(f"size=64m,mode={mode}"))
        if err:
            raise OSError(f"tmpfs on {path}: {err}")
    for path, fd in fds:
        os.makedirs(path, exist_ok=True)
        err = _call(libc.mount, b(f"/proc/self/fd/{fd}"), b(path), None, MS_BIND | MS_REC, None)
        os.close(fd)
        if err:
            raise OSError(f"bind {path}: {err}")


def _private_workdir(libc, cfg: dict, code: bytes, options: str) -> None:
    """A tmpfs of ``disk_mb`` over the sandbox folder (what the program writes there is bounded and never
    reaches the disk), holding a copy of the program; the cwd moves onto it."""
    err = _call(libc.mount, b"tmpfs", os.fsencode(cfg["cwd"]), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode())
    if err:
        raise OSError(f"tmpfs on the sandbox folder: {err}")
    os.chdir(cfg["cwd"])
    fd = os.open(cfg["program"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, code)
    os.close(fd)


def _file_view(libc, cfg: dict, root: bool, report: dict, tables, sandbox_root) -> None:
    """The minimal root; where it cannot be built, the masked host view (module docstring, step 3)."""
    err = _call(libc.mount, None, b"/", None, MS_REC | MS_PRIVATE, None)
    if err:
        report.update(mnt=False, mnt_error=f"make / private: {err}")
        return
    with open(cfg["program"], "rb") as f:  # relative to the cwd: the real sandbox folder
        code = f.read()
    options = f"size={cfg['disk_mb']}m,mode=0700" + (f",uid={cfg['uid']},gid={cfg['gid']}"
                                                      if root and cfg["uid"] is not None else "")
    native = tables.native()
    if native is None:
        report["root_error"] = f"no syscall table for {os.uname().machine}"
    else:
        numbers = native[2]
        try:
            report.update(sandbox_root.build_root(
                libc, cfg["layout"], cfg["cwd"], options, (cfg["program"], code), report["pid"],
                numbers["pivot_root"], numbers.get("mount_setattr")))
            report["root"] = True
            return
        except sandbox_root.RootError as exc:
            report["root_error"] = str(exc)
    # from here on a failure leaves the view half-built: it is raised (a setup error), not reported
    _mask_and_bind(libc, cfg["masks"], cfg["keep"])
    _private_workdir(libc, cfg, code, options)
    if report["pid"]:  # the host's /proc would list the machine's processes
        err = _call(libc.mount, b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        report.update(proc=err is None, **({"proc_error": err} if err else {}))


# ----------------------------------------------------------------------------------------- the program
def _limits(cfg: dict) -> None:
    mb = 1024 * 1024
    cpu = int(cfg["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL at the hard
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"],) * 2)


def _seccomp(libc, tables, sandbox_seccomp) -> dict:
    native = tables.native()
    if native is None:
        return {"seccomp": False, "seccomp_error": f"no syscall table for {os.uname().machine}"}
    arch, audit_arch, numbers = native
    x32 = tables.X32_SYSCALL_BIT if arch == "x86_64" else None
    err = sandbox_seccomp.install(libc, sandbox_seccomp.build_filter(audit_arch, numbers, x32))
    return {"seccomp": True} if err is None else {"seccomp": False, "seccomp_error": err}


PARTS = (("net", "network namespace"), ("mnt", "mount namespace"), ("pid", "PID namespace"),
         ("root", "minimal root"), ("seccomp", "seccomp filter"))


def _missing(report: dict, root: bool) -> list:
    """The isolation parts this run lacks (names of PARTS; as root also "uid drop")."""
    missing = [name for key, name in PARTS if not report[key]]
    if root and not report["uid_dropped"]:
        missing.append("uid drop")
    return missing


def _exec_program(libc, cfg: dict, root: bool, report: dict, status_fd: int, tables, sandbox_seccomp) -> None:
    _limits(cfg)
    if root and cfg["uid"] is not None and (report["mnt"] or cfg["interpreter_visible"]):
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        report["uid_dropped"] = True
    if not report["pid"]:  # the program is this process: killed with the reward process (the uid change cleared it)
        _die_with_parent(libc, cfg["parent_pid"])
    report.update(_seccomp(libc, tables, sandbox_seccomp))  # last: the steps before need mount, unshare, ...
    report["missing"] = _missing(report, root)
    if report["missing"] and not cfg["allow_unisolated"]:  # refused: the program never runs (the host raises)
        _report(status_fd, {**report, "unisolated": report["missing"]})
        os._exit(SETUP_ERROR_EXIT)
    os.set_inheritable(status_fd, False)  # closed by a successful exec: the parent then reads EOF
    _report(status_fd, report)
    # in the minimal root the base interpreter (its standard library and the exposed packages); elsewhere the
    # caller's own interpreter (a virtual environment's launcher finds its packages next to it)
    python = cfg["python"] if report["root"] else cfg["python_host"]
    os.execve(python, [python, "-I", cfg["program"]], cfg["env"])


def main(payload: dict) -> None:
    """Run by the bootstrap (:data:`BOOTSTRAP`) with the payload the host wrote to the pipe: {"cfg": the run's
    settings, "code": {module name: code object} of this module's siblings}."""
    cfg = payload["cfg"]
    status_fd = cfg["status_fd"]
    report: dict = {"net": False, "mnt": False, "pid": False, "root": False, "seccomp": False,
                    "uid_dropped": False}
    try:
        libc = _libc()
        root = os.geteuid() == 0
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the launcher may die of the program's signal
        _die_with_parent(libc, cfg["parent_pid"])
        tables, sandbox_root, sandbox_seccomp = (_load(name, payload["code"][name])
                                                 for name in ("sandbox_syscalls", "sandbox_root", "sandbox_seccomp"))
        if cfg["namespaces"]:
            report.update(_namespaces(libc, root))
        exit_w = _start_init(libc) if report["pid"] else None
        if report["mnt"]:
            _file_view(libc, cfg, root, report, tables, sandbox_root)
        if exit_w is not None:
            _run_init(exit_w)
        _exec_program(libc, cfg, root, report, status_fd, tables, sandbox_seccomp)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises SandboxError
        _report(status_fd, {"error": f"{type(exc).__name__}: {exc}"})
        os._exit(SETUP_ERROR_EXIT)


# What the host starts: ``python -I -S -c BOOTSTRAP FD``. It reads the payload (marshal: {"cfg", "code"}) from the
# pipe FD to its end and runs this module's code from it: the command line (/proc/1/cmdline in the sandbox) holds
# neither a path of the host nor the run's settings.
BOOTSTRAP = ("import marshal,os,sys;f=os.fdopen(int(sys.argv[1]),'rb');p=marshal.loads(f.read());f.close();"
             "g={'__name__':'sandbox_child'};exec(p['code']['sandbox_child'],g);g['main'](p)")
