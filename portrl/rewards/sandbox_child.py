"""The child side of portrl.rewards.sandbox: set up isolation, then exec the program's interpreter.

Run as ``python -I -S sandbox_child.py CONFIG_JSON`` by :func:`portrl.rewards.sandbox.run_program` in a new
session (its own process group), with the sandbox folder as cwd and a clean environment. It imports only the
standard library and does, in this order, before ``execve``:

1. namespaces: as root ``unshare(CLONE_NEWNET | CLONE_NEWNS)``; otherwise ``unshare(CLONE_NEWUSER |
   CLONE_NEWNET | CLONE_NEWNS)`` with an identity uid/gid map. Each step is tried and reported, never fatal
   (a container's seccomp profile often refuses them).
2. in the new mount namespace: mounts made private, a small private tmpfs over every world-writable folder
   (/tmp, /var/tmp, /dev/shm, /run/lock) and over the folders that hide the interpreter from the sandbox
   user (e.g. /root when Python lives in /root/.pyenv); then the folders the program needs (the sandbox
   folder, the interpreter's prefixes) are bound back at their own paths. Files written elsewhere under those
   folders land in the private tmpfs and vanish with the namespace. The sandbox folder itself becomes a
   tmpfs of ``disk_mb`` holding a copy of the program, so what the program writes is bounded in all.
3. resource limits (CPU time, address space, file size, processes, open files, no core files).
4. as root: drop to the sandbox uid/gid (no supplementary groups), so that RLIMIT_NPROC applies (root is
   exempt from it) and only world-writable files outside the sandbox folder are writable.
5. SIGKILL on the parent's death (prctl PR_SET_PDEATHSIG), so a reward process terminated mid-run does not
   leave the program running without its wall-time limit (processes the program forked are not covered).

What it managed is written as one JSON line to the status pipe (fd ``status_fd``, closed by the exec); an
error before or in exec is written there as a line {"error": ...}, with exit code 121.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
SETUP_ERROR_EXIT = 121


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


def _namespaces(libc, root: bool) -> dict:
    """Try a new network + mount namespace; {"net": bool, "mnt": bool, "ns_error": str?}."""
    if not hasattr(libc, "unshare"):
        return {"net": False, "mnt": False, "ns_error": "no unshare() on this platform (Linux only)"}
    if root:
        err = _call(libc.unshare, CLONE_NEWNET | CLONE_NEWNS)
        if err is None:
            return {"net": True, "mnt": True}
        err_net = _call(libc.unshare, CLONE_NEWNET)
        return {"net": err_net is None, "mnt": False, "ns_error": err}
    uid, gid = os.getuid(), os.getgid()
    err = _call(libc.unshare, CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS)
    if err is not None:
        return {"net": False, "mnt": False, "ns_error": err}
    try:  # identity map: files created keep the user's ids (an unmapped fsuid cannot create files)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as exc:
        return {"net": True, "mnt": False, "ns_error": f"uid map: {exc}"}
    return {"net": True, "mnt": True}


def _mask_and_bind(libc, masks: list, keep: list) -> str | None:
    """Private tmpfs over each folder in ``masks``; then each folder in ``keep`` bound back at its path."""
    b = os.fsencode
    err = _call(libc.mount, None, b"/", None, MS_REC | MS_PRIVATE, None)
    if err:
        return f"make / private: {err}"
    fds = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in keep]  # reachable after masking
    # from here on a failure leaves the view half-built: it is raised (a setup error), not reported
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
    return None


def _private_workdir(libc, cfg: dict, root: bool) -> None:
    """A tmpfs of ``disk_mb`` over the sandbox folder (what the program writes there is bounded and never
    reaches the disk), holding a copy of the program; the cwd moves onto it."""
    with open(cfg["program"], "rb") as f:  # relative to the cwd: the real sandbox folder
        code = f.read()
    opts = f"size={cfg['disk_mb']}m,mode=0700" + (f",uid={cfg['uid']},gid={cfg['gid']}" if root and cfg["uid"] else "")
    err = _call(libc.mount, b"tmpfs", os.fsencode(cfg["cwd"]), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode())
    if err:
        raise OSError(f"tmpfs on the sandbox folder: {err}")
    os.chdir(cfg["cwd"])
    fd = os.open(cfg["program"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, code)
    os.close(fd)


def _limits(cfg: dict) -> None:
    mb = 1024 * 1024
    cpu = int(cfg["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL at the hard
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    report: dict = {"net": False, "mnt": False, "uid_dropped": False}
    try:
        libc = _libc()
        root = os.geteuid() == 0
        if cfg["namespaces"]:
            report.update(_namespaces(libc, root))
            if report["mnt"]:
                err = _mask_and_bind(libc, cfg["masks"], cfg["keep"])
                if err:
                    report["mnt"], report["mnt_error"] = False, err
                else:
                    _private_workdir(libc, cfg, root)
        _limits(cfg)
        if root and cfg["uid"] is not None and (report["mnt"] or cfg["interpreter_visible"]):
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
            report["uid_dropped"] = True
        # killed with the parent (a reward worker terminated mid-run); set after the uid change, which clears it
        if hasattr(libc, "prctl"):
            libc.prctl(PR_SET_PDEATHSIG, 9)
            if os.getppid() != cfg["parent_pid"]:
                os._exit(SETUP_ERROR_EXIT)
        os.set_inheritable(status_fd, False)  # closed by a successful exec: the parent then reads EOF
        os.write(status_fd, (json.dumps(report) + "\n").encode())
        os.execve(cfg["python"], [cfg["python"], "-I", cfg["program"]], cfg["env"])
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises SandboxError
        os.write(status_fd, (json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
        os._exit(SETUP_ERROR_EXIT)


if __name__ == "__main__":
    main()
