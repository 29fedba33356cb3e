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

from portrl.device.backend import CompatRow, package_version

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
    """Ok when a row matches the installed versions; warn when rows apply but none matches.

    A row pairs components, so it applies when at least two components it pins are installed.
    Of the applicable rows only the most specific ones (most pinned components installed) are
    compared: with a rollout plugin installed, the rows that pin the plugin decide.
    """
    rows = list(rows)
    if not rows:
        return Check("compatibility rows", OK, "this backend declares no version rows")
    covered = {id(r): sum(_lookup(installed, p) is not None for p in r.pins) for r in rows}
    applicable = [r for r in rows if covered[id(r)] >= 2]
    if not applicable:
        return Check("compatibility rows", OK, "fewer than two pinned components installed: nothing to pair")
    best = max(covered[id(r)] for r in applicable)
    candidates = sorted((r for r in applicable if covered[id(r)] == best), key=lambda r: len(r.pins))
    for row in candidates:
        if row.matches({p: v for p in row.pins if (v := _lookup(installed, p)) is not None}):
            return Check("compatibility rows", OK, f"matches {_describe(row)}")
    have = ", ".join(f"{k}={v}" for k, v in sorted(installed.items()))
    known = "; ".join(_describe(r) for r in candidates)
    return Check("compatibility rows", WARN, f"installed versions ({have}) match no known row",
                 f"install one of the known combinations: {known}")


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
