"""Linux syscall numbers the code sandbox needs, for x86_64 and aarch64 (standard library only).

Sources: arch/x86/entry/syscalls/syscall_64.tbl (x86_64) and include/uapi/asm-generic/unistd.h (aarch64 uses
the generic table) of the Linux kernel; tests/test_rewards_sandbox_isolation.py checks them against the
installed kernel headers where present. Numbers from 424 on (pidfd_*, io_uring_*, the new mount API,
clone3, mount_setattr) are the same on every architecture.

:func:`native` gives the table and the seccomp ``AUDIT_ARCH`` value of the machine running it, or None
on any other architecture (the sandbox then runs without a seccomp filter and without a pivoted root).
"""

import os

AUDIT_ARCH_X86_64 = 0xC000003E  # EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
AUDIT_ARCH_AARCH64 = 0xC00000B7  # EM_AARCH64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
X32_SYSCALL_BIT = 0x40000000  # x86_64: the x32 ABI's numbers, which share AUDIT_ARCH_X86_64

#            name                 x86_64  aarch64
_TABLE = {
    "clone":                      (56,    220),
    "ptrace":                     (101,   117),
    "syslog":                     (103,   116),
    "pivot_root":                 (155,   41),
    "chroot":                     (161,   51),
    "acct":                       (163,   89),
    "mount":                      (165,   40),
    "umount2":                    (166,   39),
    "swapon":                     (167,   224),
    "swapoff":                    (168,   225),
    "reboot":                     (169,   142),
    "iopl":                       (172,   None),
    "ioperm":                     (173,   None),
    "init_module":                (175,   105),
    "delete_module":              (176,   106),
    "quotactl":                   (179,   60),
    "kexec_load":                 (246,   104),
    "add_key":                    (248,   217),
    "request_key":                (249,   218),
    "keyctl":                     (250,   219),
    "unshare":                    (272,   97),
    "perf_event_open":            (298,   241),
    "open_by_handle_at":          (304,   265),
    "setns":                      (308,   268),
    "process_vm_readv":           (310,   270),
    "process_vm_writev":          (311,   271),
    "kcmp":                       (312,   272),
    "finit_module":               (313,   273),
    "kexec_file_load":            (320,   294),
    "bpf":                        (321,   280),
    "userfaultfd":                (323,   282),
    "io_uring_setup":             (425,   425),
    "io_uring_enter":             (426,   426),
    "io_uring_register":          (427,   427),
    "open_tree":                  (428,   428),
    "move_mount":                 (429,   429),
    "fsopen":                     (430,   430),
    "fsconfig":                   (431,   431),
    "fsmount":                    (432,   432),
    "fspick":                     (433,   433),
    "clone3":                     (435,   435),
    "pidfd_getfd":                (438,   438),
    "mount_setattr":              (442,   442),
}
_ARCHES = {"x86_64": (0, AUDIT_ARCH_X86_64), "aarch64": (1, AUDIT_ARCH_AARCH64)}


def table(arch: str) -> dict[str, int]:
    """{syscall name: number} for ``arch`` ("x86_64" or "aarch64"); names the architecture lacks are left out."""
    column = _ARCHES[arch][0]
    return {name: nr for name, numbers in _TABLE.items() if (nr := numbers[column]) is not None}


def native() -> tuple[str, int, dict[str, int]] | None:
    """(architecture, its AUDIT_ARCH value, its table) for this machine; None where neither is this machine."""
    machine = os.uname().machine.lower()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if arch not in _ARCHES:
        return None
    return arch, _ARCHES[arch][1], table(arch)
