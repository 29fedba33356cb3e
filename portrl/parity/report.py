"""Parity reports: the environment header every report carries, atomic JSON writing, reading back."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from portrl.outputs import publish

if TYPE_CHECKING:
    from portrl.device.backend import Backend

#: bumped when the report layout changes; ``compare`` refuses other versions
REPORT_VERSION = 1


def environment(backend: Backend) -> dict[str, Any]:
    """Backend name, device name and the versions of its stack (no device runtime needed beyond probe)."""
    probe = backend.probe()
    versions = dict(probe.versions or backend.installed_versions())
    versions.setdefault("torch", torch.__version__)
    try:
        versions.setdefault("portrl", version("portrl"))
    except Exception:  # running from a source tree without metadata
        versions.setdefault("portrl", "unknown")
    return {"backend": backend.name, "device_type": backend.device_type, "device_name": probe.device_name,
            "versions": versions, "python": platform.python_version(), "host": platform.machine()}


def write_text(path, text: str, replace: bool = True) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename (readable by all, like a plain write);
    returns where it went. ``replace=False`` (a report the user named and the command claimed): a file at ``path``
    by then is kept and the new one goes beside it (portrl.outputs.publish)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        if replace:
            os.replace(tmp, path)
        else:
            path = publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_json(path, data: dict[str, Any], replace: bool = True) -> Path:
    """Write ``data`` as indented JSON (no NaN/Inf) to ``path`` atomically (``replace``: as :func:`write_text`)."""
    return write_text(path, json.dumps(data, indent=1, allow_nan=False) + "\n", replace)


def read_report(path) -> dict[str, Any]:
    """A report written by ``portrl parity ops``; a clear error when it is not one."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"parity report {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"parity report {str(p)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("kind") != "ops" or "cases" not in data:
        raise ValueError(f"{str(p)!r} is not a `portrl parity ops` report (no kind='ops' and cases)")
    if data.get("version") != REPORT_VERSION:
        raise ValueError(f"parity report {str(p)!r} has layout version {data.get('version')!r}; this portrl reads "
                         f"version {REPORT_VERSION}: rerun `portrl parity ops` with this portrl")
    return data
