"""Environment checks reported by ``portrl doctor``: one :class:`Check` per line, ok / warn / fail.

Backends build their own checks (known traps of their vendor stack) with the helpers here;
``portrl doctor`` adds the generic ones (probe, compatibility rows, declared requirements).
Nothing here imports a package: versions come from installed distribution metadata.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from portrl.device.versions import CompatRow, package_version

OK, WARN, FAIL = "ok", "warn", "fail"
STATUSES = (OK, WARN, FAIL)


@dataclass(frozen=True)
class Check:
    """One doctor line. ``fix`` says what to do when ``status`` is not ok."""

    name: str
    status: str
    message: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name!r}: status {self.status!r} is not one of {', '.join(STATUSES)}")

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def version_satisfies(version: str, specifier: str) -> bool:
    """True when ``version`` (local tag such as ``+cpu`` ignored) is inside ``specifier`` (PEP 440, e.g. ``<5.20``)."""
    req = Requirement(f"x{specifier}")
    try:
        return req.specifier.contains(Version(version).public, prereleases=True)
    except InvalidVersion:
        return False


def constraint_check(dist: str, requirement: str, fix: str) -> Check | None:
    """When ``dist`` is installed, check that ``requirement`` (e.g. ``"transformers<5.20"``) holds.

    Returns None when ``dist`` is not installed (nothing to check). A required package that is
    missing or out of range is a warning: the backend still runs, the feature of ``dist`` may not.
    """
    if package_version(dist) is None:
        return None
    req = Requirement(requirement)
    have = package_version(req.name)
    name = f"{dist} needs {requirement}"
    if have is None:
        return Check(name, WARN, f"{req.name} is not installed", fix)
    if version_satisfies(have, str(req.specifier)):
        return Check(name, OK, f"{req.name} {have}")
    return Check(name, WARN, f"{req.name} {have} is installed", fix)


def declared_requirement_checks(dists: Iterable[str]) -> list[Check]:
    """Check each installed ``dist``'s own metadata requirements on the other ``dists`` (e.g. a pinned torch).

    Only requirements without environment markers or extras are considered, and only against
    packages in ``dists`` that are installed, so the result is about the stack the backend uses.
    A mismatch is a warning: the backend runs, the package that declared the requirement may not.
    """
    dists = list(dists)
    installed = {d: package_version(d) for d in dists}
    checks: list[Check] = []
    for dist in dists:
        if installed[dist] is None:
            continue
        try:
            declared = importlib.metadata.requires(dist) or ()
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in declared:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None or not str(req.specifier):
                continue
            target = next((d for d in dists if _normalise(d) == _normalise(req.name)), None)
            have = installed[target] if target is not None else None
            if have is None:
                continue
            name = f"{dist} {installed[dist]} requires {req.name}{req.specifier}"
            if version_satisfies(have, str(req.specifier)):
                checks.append(Check(name, OK, f"{req.name} {have}"))
            else:
                checks.append(Check(name, WARN, f"{req.name} {have} is installed",
                                    f"pip install '{req.name}{req.specifier}' (or a {dist} release built for {req.name} {have})"))
    return checks


def compat_check(rows: Iterable[CompatRow], installed: Mapping[str, str]) -> Check:
    """Resolve the installed versions against the backend's rows (the version matrix).

    The nearest row is the one that pins the most installed components (a row that pins an installed rollout
    plugin decides over one that does not), then the one with the most matching versions, the fewest
    mismatches, the fewest components missing, the first declared. Ok when every component of that row is
    installed at its version; else warn, naming each component that breaks the row (installed at another
    version) or is missing, with the row's install command as the fix.
    """
    rows = list(rows)
    if not rows:
        return Check("compatibility rows", OK, "this backend declares no version rows")

    def score(item):
        order, row = item
        have = {p: _lookup(installed, p) for p in row.pins}
        covered = sum(v is not None for v in have.values())
        matched = sum(v is not None and row.matches({p: v}) for p, v in have.items())
        return (-covered, -matched, covered - matched, len(row.pins) - covered, order)

    nearest = min(enumerate(rows), key=score)[1]
    broken = [f"{p} {v} (row: {want})" for p, want in nearest.pins.items()
              if (v := _lookup(installed, p)) is not None and not nearest.matches({p: v})]
    missing = [p for p in nearest.pins if _lookup(installed, p) is None]
    if not broken and not missing:
        return Check("compatibility rows", OK, f"matches {_describe(nearest)}")
    parts = ([f"breaks it: {', '.join(broken)}"] if broken else []) + \
        ([f"not installed: {', '.join(missing)}"] if missing else [])
    fix = nearest.install or "install the row's versions: " + " ".join(f"{k}=={v}" for k, v in nearest.pins.items())
    return Check("compatibility rows", WARN, f"nearest row {_describe(nearest)}; " + "; ".join(parts), fix)


def ray_isolation_check(visible_devices_env: str | None, noset_env: Iterable[str]) -> Check | None:
    """Warn when a Ray NOSET variable stops Ray from giving each worker its own devices."""
    if not visible_devices_env:
        return None
    noset = [v for v in noset_env if os.environ.get(v)]
    if noset:
        return Check("Ray device isolation", WARN, f"{', '.join(noset)} set: Ray will not set {visible_devices_env}",
                     f"unset {' '.join(noset)} unless every worker selects its device itself")
    return Check("Ray device isolation", OK, f"Ray sets {visible_devices_env} for each worker")


def _describe(row: CompatRow) -> str:
    pins = " ".join(f"{k}={v}" for k, v in row.pins.items())
    return f"{pins} ({row.note})" if row.note else pins


def _lookup(installed: Mapping[str, str], name: str) -> str | None:
    wanted = _normalise(name)
    return next((v for k, v in installed.items() if _normalise(k) == wanted), None)


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
