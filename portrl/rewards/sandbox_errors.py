"""The code sandbox's errors (portrl/rewards/sandbox.py raises them; both are re-exported there).

* :class:`SandboxError`: the sandbox itself could not start a program (not the program's fault).
* :class:`SandboxUnisolated`: the platform refuses parts of the isolation and ``allow_unisolated`` is False, so the
  program was not run; :func:`unisolated_message` writes its one line from the child's report: what is missing,
  the kernel's reasons, and the ways to allow it (Docker options, sysctls, or the config key :data:`ALLOW_KEY`).
"""

from __future__ import annotations

ALLOW_KEY = "sandbox.allow_unisolated=true"  # the config key that accepts running without isolation


class SandboxError(RuntimeError):
    """The sandbox itself could not start a program (not the program's fault): the message says why."""


class SandboxUnisolated(SandboxError):
    """The platform refuses parts of the isolation and ``SandboxLimits.allow_unisolated`` is False: the program
    was not run. The message (one line) names what is missing, the kernel's reason and how to allow it."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def unisolated_message(report: dict, root: bool) -> str:
    """One line: what the platform refused (the kernel's reasons, from the child's ``report``, whose "unisolated"
    lists the missing parts) and the ways to allow it; ``root``: whether this process runs as root."""
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
