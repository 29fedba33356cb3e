"""``portrl doctor [--device D] [--json]``: check the chosen backend's environment, one line per check.

Checks, in order: the backend's probe; the installed versions against its compatibility rows;
the requirements installed packages declare on each other; the backend's own constraints;
Ray device isolation; the backend's known traps (:meth:`Backend.doctor_checks`); and the traps
every registered backend's packages set for the whole host (:meth:`Backend.host_checks`).
Each line is ok / warn / fail with the fix; the exit status is 1 when any check fails (2 for an unknown
``--device``, like every user error).

The device layer is imported when the command runs, so that ``portrl --help`` and ``portrl doctor --help`` stay fast.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from portrl.device.backend import Backend


def add_arguments(parser) -> None:
    parser.add_argument("--device", default=None,
                        help="backend to check (default: $PORTRL_DEVICE, else the detected one; 'auto' detects)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")


def collect_checks(backend: Backend, all_backends) -> list:
    """Every doctor check for ``backend``; ``all_backends`` contribute their host-wide traps."""
    from portrl.device.checks import FAIL, OK, Check, compat_check, constraint_check, declared_requirement_checks, \
        ray_isolation_check  # noqa: PLC0415  (CLI start-up: loaded by the command)

    result = backend.probe()
    if result.usable:
        where = f"{result.device_count} device(s)" + (f", {result.device_name}" if result.device_name else "")
        checks = [Check("probe", OK, f"{backend.name} usable: {where}")]
    else:
        checks = [Check("probe", FAIL, f"{backend.name} not usable: {result.reason}",
                        "see the reason; run `portrl devices` to list the backends usable here")]
    installed = backend.installed_versions()
    checks.append(compat_check(backend.compat_rows, installed))
    checks.extend(declared_requirement_checks(backend.version_packages))
    for dist, requirement, fix in backend.version_constraints:
        check = constraint_check(dist, requirement, fix)
        if check is not None:
            checks.append(check)
    isolation = ray_isolation_check(backend.visible_devices_env, backend.ray_noset_env)
    if isolation is not None:
        checks.append(isolation)
    checks.extend(backend.doctor_checks())
    for other in all_backends:
        checks.extend(other.host_checks())
    return checks


def run(args) -> int:
    from portrl.device import all_backends, resolve_backend  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.device.checks import FAIL  # noqa: PLC0415  (CLI start-up: loaded by the command)

    backend = resolve_backend(args.device, require_usable=False)  # an unknown name: BackendError, exit 2
    if not args.json:  # the first line before the checks run (a package metadata scan takes a moment)
        print(f"portrl doctor: backend {backend.name} (device type {backend.device_type!r}, "
              f"process group {backend.dist_backend!r})", flush=True)
    checks = collect_checks(backend, all_backends())
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        print(json.dumps({"backend": backend.name, "ok": not failed, "checks": [c.as_dict() for c in checks]}, indent=2))
        return 1 if failed else 0
    for c in checks:
        line = f"{c.status:<4} {c.name}: {c.message}"
        if c.fix and c.status != "ok":
            line += f"\n       fix: {c.fix}"
        print(line)
    warned = sum(c.status == "warn" for c in checks)
    print(f"{len(checks)} checks: {'FAILED' if failed else 'passed'}" + (f" ({warned} warning(s))" if warned else ""))
    return 1 if failed else 0
