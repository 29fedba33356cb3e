"""Checkpoint manifests: what a checkpoint holds (every file's size and sha256, its step and meta) and whether a
folder still matches it. ``manifest.json`` is written last, after every file is flushed (:func:`write_manifest`);
a checkpoint is intact when the manifest has the expected shape and every listed file matches (:func:`verify`).
The run's reference policy (one copy beside the checkpoints, pinned by each checkpoint's ``meta.reference``) is
checked the same way (:func:`reference_damage`). Rotation, resume and compatibility: portrl.trainer.checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Dict, Optional

MANIFEST = "manifest.json"
#: the run's frozen reference policy, written once next to the checkpoints (CheckpointManager.save_reference)
REFERENCE = "reference"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
        fh.write(manifest_text(manifest))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)
    return manifest


def manifest_text(manifest: dict) -> str:
    """The text :func:`write_manifest` writes for ``manifest`` (the same dict always gives the same text, so a
    manifest kept in a checkpoint's ``meta.reference`` can be written again byte for byte)."""
    return json.dumps(manifest, indent=1, sort_keys=True, default=str)


def manifest_problem(manifest: Any) -> Optional[str]:
    """None when ``manifest`` has the shape :func:`write_manifest` writes, else what is wrong."""
    if not isinstance(manifest, dict):
        return "manifest.json is not a JSON object"
    for key, kind in (("step", int), ("meta", dict), ("files", dict)):
        if key not in manifest:
            return f"manifest.json has no {key!r}"
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            return f"manifest.json {key!r} is a {type(manifest[key]).__name__}, not a {kind.__name__}"
    if not manifest["files"]:
        return "manifest lists no files"
    for rel, want in manifest["files"].items():
        parts = Path(rel).parts
        if os.path.isabs(rel) or ".." in parts or not parts:
            return f"manifest.json lists {rel!r}, a path outside the checkpoint"
        if not isinstance(want, dict):
            return f"manifest.json entry for {rel} is not an object"
        size, digest = want.get("size"), want.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"manifest.json size of {rel} is {size!r}, not a byte count"
        if not isinstance(digest, str) or not _SHA256.match(digest):
            return f"manifest.json sha256 of {rel} is {digest!r}, not a sha256 hex digest"
    return None


def _load_manifest(ckpt_dir: Path) -> tuple[Optional[dict], Optional[str]]:
    mpath = ckpt_dir / MANIFEST
    if not mpath.is_file():
        return None, "no manifest.json (partial write)"
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        return None, f"unreadable manifest.json ({exc})"
    problem = manifest_problem(manifest)
    return (None, problem) if problem else (manifest, None)


def _file_problem(folder: Path, files: Dict[str, dict]) -> Optional[tuple[str, str]]:
    """``(relative path, what is wrong)`` of the first of ``files`` (a manifest's ``files``) that ``folder`` does
    not hold with the listed size and sha256; None when all match."""
    for rel, want in files.items():
        p = folder / rel
        if not p.is_file():
            return rel, "is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return rel, f"has {size} bytes, manifest says {want['size']}"
        if sha256_file(p) != want["sha256"]:
            return rel, "sha256 differs from the manifest"
    return None


def reference_pin(manifest: dict) -> tuple[Optional[dict], Optional[str]]:
    """``(meta.reference, None)`` of a checkpoint's manifest (``(None, None)`` when it pins no reference), or
    ``(None, what is wrong)`` when the pin is malformed."""
    ref = manifest["meta"].get("reference")
    if ref is None:
        return None, None
    if not isinstance(ref, dict) or ref.get("dir") != REFERENCE or not isinstance(ref.get("manifest_sha256"), str) \
            or not _SHA256.match(ref["manifest_sha256"]) \
            or ("manifest" in ref and manifest_problem(ref["manifest"]) is not None):
        return None, f"manifest.json meta.reference is {ref!r}, not {{'dir': '{REFERENCE}', 'manifest_sha256': ...}}"
    return ref, None


def reference_damage(root: Path, pin: dict) -> Optional[tuple[Path, str]]:
    """None when the reference ``pin`` (a checkpoint's ``meta.reference``) names is intact in ``root`` (the
    checkpoints' folder): its manifest has the pinned sha256 and every file it lists matches. Otherwise
    ``(the damaged path, what is wrong)``, the damaged data file named where the pin lists the files."""
    rdir = Path(root) / pin["dir"]
    if not rdir.is_dir():
        return rdir, "is missing"
    mpath = rdir / MANIFEST
    bad: Optional[tuple[str, str]]
    if mpath.is_file() and sha256_file(mpath) == pin["manifest_sha256"]:
        manifest, problem = _load_manifest(rdir)
        if problem:
            bad = (MANIFEST, problem)
        else:
            assert manifest is not None  # _load_manifest returns a manifest or a problem
            bad = _file_problem(rdir, manifest["files"])
    else:
        bad = _file_problem(rdir, pin["manifest"]["files"]) if isinstance(pin.get("manifest"), dict) else None
        bad = bad or (MANIFEST, "is missing" if not mpath.is_file() else "differs from the one the checkpoints pin")
    return None if bad is None else (rdir / bad[0], bad[1])


def verify(ckpt_dir: Path, with_reference: bool = False) -> Optional[str]:
    """None when ``ckpt_dir`` matches its manifest (well-formed, every file's size and sha256), else what is
    wrong (one line). ``with_reference``: also the run's reference model the checkpoint names (meta.reference,
    see :meth:`CheckpointManager.save_reference`), which loading it for training needs and evaluating does not."""
    ckpt_dir = Path(ckpt_dir)
    manifest, problem = _load_manifest(ckpt_dir)
    if problem:
        return problem
    assert manifest is not None  # _load_manifest returns a manifest or a problem
    bad = _file_problem(ckpt_dir, manifest["files"])
    if bad is not None:
        return " ".join(bad)
    if not with_reference:
        return None
    ref, problem = reference_pin(manifest)
    if problem is not None:
        return problem
    damage = reference_damage(ckpt_dir.parent, ref) if ref is not None else None
    if damage is not None:
        return f"its reference model {ckpt_dir.parent / REFERENCE}: {damage[0]} {damage[1]}"
    return None


def resumable_problem(ckpt_dir: Path) -> Optional[str]:
    """:func:`verify` of what a resume takes a checkpoint for: its own files and a well-formed reference pin. The
    run's reference (one copy for every checkpoint) is checked, and rebuilt when damaged, as it loads
    (portrl.trainer.run_checkpoints.load_run_checkpoint)."""
    problem = verify(ckpt_dir)
    if problem is None:
        manifest = _load_manifest(Path(ckpt_dir))[0]
        assert manifest is not None  # verify() found it well-formed
        problem = reference_pin(manifest)[1]
    return problem
