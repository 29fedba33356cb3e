"""Build-time guard: the image's installed stack equals the compatibility row its Dockerfile pins.

Usage (inside an image, after portrl is installed)::

    python3 check_pins.py BACKEND NAME=VERSION [NAME=VERSION ...]

``BACKEND`` is a registered portrl backend; each ``NAME`` is a component of that backend's
compatibility rows (a distribution such as ``torch`` or ``vllm-ascend``, or ``ROCm`` / ``CANN``).
Installed versions come from ``Backend.installed_versions()`` (package metadata; CANN from the
toolkit's install record). Vendor-built torch wheels without a ``+rocmX.Y`` tag report ROCm through
``torch.version.hip``, read here as a fallback. Exit status 1, with one line per mismatch, when
a pin is missing or different: the base image tag then does not carry the row the Dockerfile names.
"""

from __future__ import annotations

import sys

from packaging.version import InvalidVersion, Version


def same_version(pinned: str, installed: str) -> bool:
    """Release numbers equal (zero-padded: ``7.0 == 7.0.0``), post-releases equal (``2.10.0.post4 != 2.10.0``)
    and pre-releases equal (``8.3.RC1 != 8.3.RC2``).

    Local tags (``+cu128``, ``+git1c57644``) are ignored. A source build with a local tag may carry
    PyTorch's development pre-release marker (``2.9.0a0+git1c57644``); that marker is ignored too.
    """
    try:
        want, have = Version(pinned), Version(installed)
    except InvalidVersion:
        return pinned.strip() == installed.strip()
    width = max(len(want.release), len(have.release))
    pad = lambda v: v.release + (0,) * (width - len(v.release))  # noqa: E731
    if pad(want) != pad(have) or want.post != have.post:
        return False
    if want.pre == have.pre:
        return True
    return want.pre is None and have.local is not None and have.pre == ("a", 0)


def _rocm_from_hip() -> str | None:
    """ROCm major.minor from ``torch.version.hip`` (e.g. ``"7.0.51831-..."`` -> ``"7.0"``); no device is touched."""
    try:
        import torch
    except ImportError:
        return None
    hip = getattr(torch.version, "hip", None)
    return ".".join(hip.split(".")[:2]) if hip else None


def installed_components(backend_name: str) -> dict[str, str]:
    from portrl.device import get_backend

    versions = dict(get_backend(backend_name).installed_versions())
    if backend_name == "rocm" and "ROCm" not in versions:
        rocm = _rocm_from_hip()
        if rocm:
            versions["ROCm"] = rocm
    return versions


def mismatches(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """One line per pin that is not installed or not at the pinned version."""
    lines = []
    for name, want in pins.items():
        have = installed.get(name)
        if have is None:
            lines.append(f"{name}: pinned {want}, not installed")
        elif not same_version(want, have):
            lines.append(f"{name}: pinned {want}, installed {have}")
    return lines


def parse_pins(args: list[str]) -> dict[str, str]:
    pins = {}
    for arg in args:
        name, sep, version = arg.partition("=")
        if not sep or not name or not version:
            raise SystemExit(f"check_pins: bad pin {arg!r}; expected NAME=VERSION, e.g. torch=2.8.0")
        pins[name] = version
    return pins


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: check_pins.py BACKEND NAME=VERSION [NAME=VERSION ...]", file=sys.stderr)
        return 2
    backend, pins = argv[0], parse_pins(argv[1:])
    bad = mismatches(pins, installed_components(backend))
    for line in bad:
        print(f"check_pins ({backend}): {line}", file=sys.stderr)
    if bad:
        print("check_pins: the base image does not carry the pinned compatibility row; "
              "pick the image tag of that row (see the backend's compat_rows)", file=sys.stderr)
        return 1
    print(f"check_pins ({backend}): " + ", ".join(f"{k}={v}" for k, v in pins.items()) + " installed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
