"""Atomic, verified, rotated checkpoints: ``<root>/global_step_<step>/`` with a ``manifest.json``.

Writing: ``save(step, write_fn, meta)`` lets ``write_fn(tmp_dir)`` fill a temporary directory
``<root>/.tmp_global_step_<step>_<pid>``, adds ``manifest.json`` (every file's relative path, size in
bytes and sha256, plus ``meta`` and the step), flushes, then renames the directory to its final name
(``os.replace``: atomic on one filesystem). A process killed mid-write leaves only a ``.tmp_*``
directory, which is never taken for a checkpoint and is removed by the next save. Only the newest
``max_to_keep`` checkpoints are kept.

Reading: ``latest_valid()`` checks checkpoints newest first: the manifest must exist and parse, and
every listed file must exist with the listed size and sha256. A partial or corrupt checkpoint is
skipped with a warning naming it and what is wrong, and the previous one is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "global_step_"
_STEP_DIR = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or a named checkpoint is missing or corrupt."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(ckpt_dir: Path, step: int, meta: dict) -> dict:
    """Hash every file below ``ckpt_dir`` (except the manifest) and write ``manifest.json`` (temp + rename)."""
    files = {}
    for p in sorted(ckpt_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
            files[p.relative_to(ckpt_dir).as_posix()] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"step": int(step), "time": time.time(), "meta": meta, "files": files}
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)
    return manifest


def verify(ckpt_dir: Path) -> Optional[str]:
    """None when ``ckpt_dir`` matches its manifest, else what is wrong (one line)."""
    ckpt_dir = Path(ckpt_dir)
    mpath = ckpt_dir / MANIFEST
    if not mpath.is_file():
        return "no manifest.json (partial write)"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest.json ({exc})"
    if not files:
        return "manifest lists no files"
    for rel, want in files.items():
        p = ckpt_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size} bytes, manifest says {want['size']}"
        if sha256_file(p) != want["sha256"]:
            return f"{rel} sha256 differs from the manifest"
    return None


def read_meta(path: str | os.PathLike) -> dict:
    """The manifest of a checkpoint: ``{"step", "time", "meta", "files"}``."""
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path} is not a portrl checkpoint (no {MANIFEST})")
    return json.loads(mpath.read_text())


class CheckpointManager:
    """Checkpoints under ``root`` named ``global_step_<step>``; keeps the newest ``max_to_keep``."""

    def __init__(self, root: str | os.PathLike, max_to_keep: int = 2):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.root = Path(root)
        self.max_to_keep = int(max_to_keep)

    # ----------------------------------------------------------------------------------- listing
    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every final-named checkpoint directory, oldest first (not verified)."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def path_for(self, step: int) -> Path:
        return self.root / f"{PREFIX}{int(step)}"

    # ------------------------------------------------------------------------------------ saving
    def save(self, step: int, write_fn: Callable[[Path], None], meta: Optional[dict] = None) -> Path:
        """Write a checkpoint for ``step`` atomically and return its final path."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        tmp = self.root / f".tmp_{PREFIX}{int(step)}_{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            write_fn(tmp)
            write_manifest(tmp, step, dict(meta or {}))
            final = self.path_for(step)
            if final.exists():  # re-saving a step (e.g. after a resume): replace the old one
                old = self.root / f".old_{PREFIX}{int(step)}_{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._rotate()
        log.info("checkpoint saved: %s", final)
        return final

    def _remove_stale_temps(self) -> None:
        for p in self.root.iterdir():
            if p.is_dir() and (p.name.startswith(".tmp_") or p.name.startswith(".old_")):
                shutil.rmtree(p, ignore_errors=True)

    def _rotate(self) -> None:
        ckpts = self.checkpoints()
        for _, path in ckpts[: max(0, len(ckpts) - self.max_to_keep)]:
            shutil.rmtree(path, ignore_errors=True)
            log.info("checkpoint removed (max_to_keep=%d): %s", self.max_to_keep, path)

    # ----------------------------------------------------------------------------------- loading
    def latest_valid(self) -> Optional[Path]:
        """The newest checkpoint whose files match its manifest; bad ones are skipped with a warning."""
        for _step, path in reversed(self.checkpoints()):
            problem = verify(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
        return None

    def resolve_resume(self, resume: str | os.PathLike | None) -> Optional[Path]:
        """``"off"`` -> None; ``"auto"`` -> :meth:`latest_valid` (None when there is none);
        a path -> that checkpoint, which must verify (an error names what is wrong)."""
        if resume is None or str(resume) == "off":
            return None
        if str(resume) == "auto":
            path = self.latest_valid()
            if path is not None:
                log.info("resuming from %s", path)
            return path
        path = Path(os.path.expanduser(str(resume)))
        if not path.is_dir():
            raise CheckpointError(f"trainer.resume={resume}: no such checkpoint directory (use auto, off or a "
                                  f"{PREFIX}<step> directory)")
        problem = verify(path)
        if problem is not None:
            raise CheckpointError(f"trainer.resume={resume}: checkpoint is unusable: {problem}")
        return path


__all__ = ["CheckpointManager", "CheckpointError", "read_meta", "verify", "write_manifest", "sha256_file"]

