"""The code sandbox's seccomp filter: a classic-BPF program built here, installed with prctl (standard library only).

:func:`build_filter` returns the filter for one architecture; :func:`install` sets no_new_privs and installs it
on the calling thread (the sandbox calls it as the last step before exec, single-threaded, so the program and
everything it starts inherit it). The filter:

* kills the process (SECCOMP_RET_KILL_PROCESS) on a syscall of another ABI than the table's: a 32-bit
  ``int 0x80`` on x86_64 (AUDIT_ARCH_I386, other numbers) or an x32 syscall -- ways around the table;
* fails with EPERM: :data:`DENIED` -- tracing or reading other processes (ptrace, process_vm_readv/writev,
  pidfd_getfd, kcmp), changing the file system view or namespaces (mount and the new mount API, umount2,
  pivot_root, chroot, unshare, setns, and clone with any CLONE_NEW* flag), and kernel interfaces a program
  does not need and that widen the kernel's attack surface (bpf, perf_event_open, userfaultfd, io_uring,
  keyrings, modules, kexec, reboot, swap, acct, syslog, quotactl, open_by_handle_at, iopl/ioperm);
* fails with ENOSYS: clone3, whose flags sit in memory a filter cannot read (libc then falls back to clone,
  which the filter checks; the same choice as Docker's default profile);
* allows everything else.

EPERM rather than a kill: a program that probes (``ctypes ptrace(PTRACE_TRACEME)``) gets -1 and an error it
can handle, and its run is still judged by its output; a kill would only look like a crash.
"""

import ctypes
import errno
import struct

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
CLONE_NEW_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000  # NEWNS NEWCGROUP NEWUTS NEWIPC
                   | 0x10000000 | 0x20000000 | 0x40000000)  # NEWUSER NEWPID NEWNET
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
          "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "fspick", "mount_setattr",
          "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
          "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module", "kexec_load",
          "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "syslog", "quotactl", "open_by_handle_at",
          "iopl", "ioperm")

# classic BPF opcodes (linux/filter.h) and the offsets in struct seccomp_data (linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # args[0]'s low 32 bits (both architectures are little-endian)


def build_filter(audit_arch: int, numbers: dict[str, int], x32_bit: int | None = None) -> bytes:
    """The filter as packed ``struct sock_filter`` entries for the architecture ``audit_arch`` whose syscall
    numbers are ``numbers``; ``x32_bit``: numbers with this bit set are another ABI (x86_64's x32)."""
    denied = sorted({numbers[name] for name in DENIED if name in numbers})
    head: list[tuple[int | str, int | str, int | str, int]] = [(_LD_W_ABS, 0, 0, _ARCH), ("jeq", "next", "kill", audit_arch), (_LD_W_ABS, 0, 0, _NR)]
    if x32_bit is not None:
        head.append(("jge", "kill", "next", x32_bit))
    checks: list[tuple[int | str, int | str, int | str, int]] = [("jeq", "eperm", "next", nr) for nr in denied]
    checks += [("jeq", "enosys", "next", numbers["clone3"]),
               ("jeq", "next", "allow", numbers["clone"]),
               (_LD_W_ABS, 0, 0, _ARG0_LOW),
               ("jset", "eperm", "allow", CLONE_NEW_FLAGS)]
    tail = {"allow": SECCOMP_RET_ALLOW, "eperm": SECCOMP_RET_ERRNO | errno.EPERM,
            "enosys": SECCOMP_RET_ERRNO | errno.ENOSYS, "kill": SECCOMP_RET_KILL_PROCESS}
    body = head + checks
    where = {label: len(body) + i for i, label in enumerate(tail)}
    codes = {"jeq": _JEQ_K, "jge": _JGE_K, "jset": _JSET_K}
    out = []
    for i, (op, jt, jf, k) in enumerate(body):
        if isinstance(op, str):  # a jump (codes), to labels: offsets count from the next instruction
            jt, jf = (where[t] - i - 1 if isinstance(t, str) and t != "next" else 0 for t in (jt, jf))
            op = codes[op]
        out.append(struct.pack("=HBBI", op, jt, jf, k))
    out += [struct.pack("=HBBI", _RET_K, 0, 0, action) for action in tail.values()]
    return b"".join(out)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(libc, program: bytes) -> str | None:
    """Set no_new_privs and install ``program`` (from :func:`build_filter`) on the calling thread; None when
    installed, else why not (the kernel has no seccomp, or a container's profile refuses it)."""
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    # prctl is variadic: every argument a full unsigned long (the kernel checks that unused ones are 0)
    for args in ((PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
                 (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0)):
        if libc.prctl(*map(ctypes.c_ulong, args)) != 0:
            err = ctypes.get_errno()
            return f"prctl({args[0]}): {errno.errorcode.get(err, err)}"
    return None
