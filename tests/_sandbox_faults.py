"""Platforms where the code sandbox fails, made for real with a seccomp filter on a process (and everything it
starts, exec included), for tests of what portrl does there.

* ``namespaces``: unshare, clone with a CLONE_NEW* flag and clone3 fail (EPERM / ENOSYS), as under Docker's default
  seccomp profile without CAP_SYS_ADMIN: the sandbox's isolation is refused;
* ``setrlimit``: setting a resource limit fails with EPERM (prlimit64 with a new limit, setrlimit; reading limits
  still works): the sandbox's launcher cannot set the program's limits, so it cannot start a program at all.

:func:`fault_source` is Python that installs one on the calling thread; :func:`command_under` wraps a command so it
runs under one (``python -c <install>; os.execv(...)``). Both need Linux x86_64 or aarch64 with seccomp
(:func:`seccomp_available`).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from typing import List

FAULTS = ("namespaces", "setrlimit")

_INSTALL = textwrap.dedent("""
    import ctypes, struct
    from portrl.rewards import sandbox_seccomp, sandbox_syscalls
    def _portrl_test_fault(fault):
        arch, audit_arch, numbers = sandbox_syscalls.native()
        if fault == "namespaces":
            program = sandbox_seccomp.build_filter(audit_arch, {n: numbers[n] for n in ("unshare", "clone", "clone3")})
        else:  # prlimit64 with a new limit (args[2] != NULL) and setrlimit fail with EPERM, the rest is allowed
            prlimit64, setrlimit = {"x86_64": (302, 160), "aarch64": (261, 164)}[arch]
            ld, jeq, ret = 0x20, 0x15, 0x06
            allow, eperm = 0x7FFF0000, 0x00050000 | 1
            code = [(ld, 0, 0, 4), (jeq, 0, 7, audit_arch), (ld, 0, 0, 0), (jeq, 6, 0, setrlimit),
                    (jeq, 0, 4, prlimit64), (ld, 0, 0, 32), (jeq, 0, 3, 0), (ld, 0, 0, 36), (jeq, 0, 1, 0),
                    (ret, 0, 0, allow), (ret, 0, 0, eperm)]
            program = b"".join(struct.pack("=HBBI", *c) for c in code)
        err = sandbox_seccomp.install(ctypes.CDLL(None, use_errno=True), program)
        assert err is None, err
""")


@functools.lru_cache(maxsize=1)
def seccomp_available() -> bool:
    """Whether this platform can install the filters (Linux x86_64 / aarch64 with seccomp), tried in a child."""
    if not sys.platform.startswith("linux"):
        return False
    probe = fault_source("namespaces") + "\nimport os\nassert os.system('true') == 0\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120)
    return done.returncode == 0


def fault_source(fault: str) -> str:
    """Python source that installs ``fault`` (FAULTS) on the thread that runs it (and what it starts from then)."""
    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r}; valid: {', '.join(FAULTS)}")
    return _INSTALL + f"_portrl_test_fault({fault!r})\n"


def command_under(fault: str, argv: List[str]) -> List[str]:
    """``argv`` (a program and its arguments) run under ``fault``: the filter is installed, then ``argv`` exec'd."""
    return [sys.executable, "-c", fault_source(fault) + f"import os\nos.execv({argv[0]!r}, {list(argv)!r})\n"]


__all__ = ["FAULTS", "command_under", "fault_source", "seccomp_available"]
