"""Versions of installed distributions, read from their metadata (never by importing them), and the sets of
versions a backend is known to work with (:class:`CompatRow`, ``Backend.compat_rows``; ``portrl doctor`` reports
them, portrl/device/checks.py)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class CompatRow:
    """One set of versions a backend is known to work with, e.g. ``{"torch": "2.10.0", "some-plugin": "2.10.0.post4"}``.

    ``pins`` maps a distribution (or a system component such as ``CANN``) to an exact version;
    ``note`` says where the row comes from; ``install`` is the exact command that installs the row (what
    ``portrl doctor`` prints as the fix when the installed versions break it).
    """

    pins: Mapping[str, str]
    note: str = ""
    install: str = ""

    def matches(self, installed: Mapping[str, str]) -> bool:
        """True when every pinned component that is installed has the pinned version (local tags ignored)."""
        for pkg, want in self.pins.items():
            have = installed.get(pkg)
            if have is not None and _base_version(have) != _base_version(want):
                return False
        return True


def _base_version(v: str) -> str:
    return v.split("+", 1)[0]


def package_version(dist: str) -> str | None:
    """Installed version of a distribution, or None; never imports the package."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
