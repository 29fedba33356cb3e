"""Atomic, verified, rotated checkpoints: ``<root>/global_step_<step>/`` with a ``manifest.json``.

Writing: ``save(step, write_fn, meta)`` lets ``write_fn(tmp_dir)`` fill a temporary directory
``<root>/.tmp_global_step_<step>_<pid>``, adds ``manifest.json`` (every file's relative path, size in
bytes and sha256, plus ``meta`` and the step), flushes, then renames the directory to its final name
(``os.replace``: atomic on one filesystem). A process killed mid-write leaves only a ``.tmp_*``
directory, which is never taken for a checkpoint and is removed by the next save. Only the newest
``max_to_keep`` checkpoints are kept.

Reading: ``latest_valid()`` checks checkpoints newest first: the manifest must exist, parse and have the
expected shape (``step`` an int, ``meta`` a dict, ``files`` a dict of ``{"size": int, "sha256": hex}`` with
relative paths inside the checkpoint), and every listed file must exist with the listed size and sha256.
A partial, corrupt or malformed checkpoint is skipped with a warning naming it and what is wrong, and the
previous one is used. ``resolve_auto(identity)`` does the same for ``trainer.resume=auto`` and then checks
the newest intact checkpoint with :func:`check_compatible` (format version, run identity); when checkpoints
exist but none is intact it raises an error listing each with its problem instead of starting over. A checkpoint
that matches its manifest but does not load (re-hashed after its content changed: a safetensors header or a JSON
state that does not decode, a tensor of another shape) raises :class:`UnusableCheckpoint` as it loads, and a resume
with ``trainer.resume=auto`` skips it the same way (portrl.trainer.run_checkpoints.resume_run).

Rotation (after each save) keeps the checkpoint just written and the newest intact others, up to
``max_to_keep`` in all; it never deletes the one it just wrote (even when higher-numbered ones exist).

The frozen reference policy of a run (KL terms) is the same in every checkpoint, so it is written once to
``<root>/reference`` (:meth:`CheckpointManager.save_reference`) and each checkpoint's ``meta.reference`` pins
it: ``{"dir", "manifest_sha256", "manifest"}``, the sha256 of the reference's manifest and that manifest itself
(every file's size and sha256). A checkpoint is taken for a resume on its own files and a well-formed pin
(:func:`resumable_problem`); the reference is checked as it loads (:func:`reference_damage`). One copy serves
every checkpoint, so a damaged or missing copy does not make them unusable: the resume rebuilds it from the
run's model source (:func:`portrl.trainer.reference_repair.restore_reference`), uses the rebuilt copy only when
every file matches the pinned sha256, and keeps the damaged one aside as ``reference.damaged-<time>``; when the
source no longer gives the same bytes it stops with one line naming the damaged file and the recovery.

The manifest itself (writing, shape, verification, the reference pin) is portrl.trainer.checkpoint_manifest,
whose names this module re-exports.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from portrl import __version__
from portrl.errors import UserError
from portrl.outputs import sibling_name
from portrl.trainer.checkpoint_io import FORMAT_VERSION, LEGACY_FILES
from portrl.trainer.checkpoint_manifest import MANIFEST, REFERENCE, _fsync_dir, _load_manifest, manifest_problem, \
    manifest_text, reference_damage, reference_pin, resumable_problem, sha256_file, verify, write_manifest
from portrl.trainer.run_identity import identity_diff
from portrl.user_files import new_dir

log = logging.getLogger(__name__)

PREFIX = "global_step_"
_STEP_DIR = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(UserError):
    """A checkpoint cannot be used: missing, corrupt, of an old format or of another run (a user error:
    one line, exit code 2)."""


class UnusableCheckpoint(CheckpointError):
    """A checkpoint whose own files do not give a state this run can load: they differ from the manifest, or they
    match it (a re-hashed checkpoint) but a header or JSON state does not decode or a value does not fit the run (a
    tensor of another shape). ``trainer.resume=auto`` skips such a checkpoint for the previous one, as
    :meth:`CheckpointManager.resolve_auto` skips one that fails :func:`verify`; a checkpoint named by its path is
    refused. ``problem``: what is wrong, without the path."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


def unusable(path: str | os.PathLike, problem: str) -> UnusableCheckpoint:
    """The error of checkpoint ``path`` whose files do not load: ``checkpoint <path> is unusable: <problem>``."""
    return UnusableCheckpoint(f"checkpoint {path} is unusable: {problem}", problem)


def set_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to ``<path>.<why>-<YYYYmmdd-HHMMSS>`` beside it (a number added if taken); returns the new
    path. Nothing is deleted."""
    target = sibling_name(path, why)
    os.replace(path, target)
    return target


def check_compatible(path: Path, manifest: dict, identity: Optional[Dict[str, Any]] = None,
                     only: tuple = ()) -> None:
    """Raise CheckpointError when the (verified) checkpoint at ``path`` has another format version than this
    portrl reads, or (with ``identity``) was written by a different run. ``only``: compare just the identity
    keys starting with these prefixes (``portrl eval`` checks the model only)."""
    meta = manifest.get("meta", {})
    fmt = meta.get("format")
    if fmt is None:
        legacy = [f for f in LEGACY_FILES if f in manifest.get("files", {})]
        raise CheckpointError(
            f"checkpoint {path} is in the old pickled format ({', '.join(legacy) or 'no format version'}; written "
            f"by portrl {meta.get('portrl_version', '0.1.0 or earlier')}), which portrl {__version__} does not load "
            f"(loading it could run code); it reads checkpoint format {FORMAT_VERSION} (safetensors + JSON): start a "
            f"fresh run (a new trainer.output_dir, or trainer.resume=off trainer.on_existing_run=move_aside)")
    if fmt != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format {fmt!r} (written by portrl {meta.get('portrl_version', '?')}); portrl "
            f"{__version__} reads format {FORMAT_VERSION}: use the portrl version that wrote it, or start a fresh "
            f"run (a new trainer.output_dir)")
    if identity is None:
        return
    saved = meta.get("identity")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} records no run identity (manifest meta.identity); start a fresh "
                              f"run (a new trainer.output_dir)")
    if only:
        saved = {k: v for k, v in saved.items() if k.startswith(only)}
        identity = {k: v for k, v in identity.items() if k.startswith(only)}
    diff = identity_diff(saved, identity)
    if diff:
        raise CheckpointError(
            f"checkpoint {path} belongs to a different run ({'; '.join(diff)}); to start a new run use a fresh "
            f"trainer.output_dir, or trainer.resume=off trainer.on_existing_run=move_aside to move the old one aside")


def read_meta(path: str | os.PathLike) -> dict:
    """The manifest of a checkpoint: ``{"step", "time", "meta", "files"}``."""
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path} is not a portrl checkpoint (no {MANIFEST})")
    manifest, problem = _load_manifest(Path(path))
    if problem or manifest is None:  # no manifest always comes with a problem
        raise unusable(path, str(problem))
    return manifest


def open_checkpoint(path: str | os.PathLike, identity: Optional[Dict[str, Any]] = None, only: tuple = (),
                    with_reference: bool = False) -> dict:
    """What every reader does first: verify ``path`` against its manifest (sizes, sha256, shape; the reference
    model too with ``with_reference``), then its format version and (with ``identity``) its run identity;
    returns the manifest. Raises CheckpointError."""
    path = Path(os.path.expanduser(str(path)))
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory (give a {PREFIX}<step> directory of a run)")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path} is not a portrl checkpoint (no {MANIFEST}; give a {PREFIX}<step> directory)")
    problem = verify(path, with_reference)
    if problem is not None:
        raise unusable(path, problem)
    manifest = read_meta(path)
    check_compatible(path, manifest, identity, only)
    return manifest


class CheckpointManager:
    """Checkpoints under ``root`` named ``global_step_<step>``; keeps the newest ``max_to_keep`` (see the module
    docstring for rotation)."""

    def __init__(self, root: str | os.PathLike, max_to_keep: int = 2):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.root = Path(root)
        self.max_to_keep = int(max_to_keep)
        self._intact: Dict[Path, float] = {}  # verified here (written or checked): path -> manifest mtime

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

    def _rotation_problem(self, path: Path) -> Optional[str]:
        """:func:`verify` for rotation, remembered for checkpoints this manager wrote or already verified while
        their manifest is unchanged (a big checkpoint's sha256 is not recomputed at every save). Readers
        (:meth:`latest_valid`, :meth:`resolve_auto`) always verify in full."""
        try:
            mtime = (path / MANIFEST).stat().st_mtime
        except OSError:
            mtime = None
        if mtime is not None and self._intact.get(path) == mtime:
            return None
        problem = verify(path)
        if problem is None and mtime is not None:
            self._intact[path] = mtime
        return problem

    # ------------------------------------------------------------------------------------ saving
    def save(self, step: int, write_fn: Callable[[Path], None], meta: Optional[dict] = None) -> Path:
        """Write a checkpoint for ``step`` atomically and return its final path. The manifest's meta gets
        ``format`` (the checkpoint format version) and ``portrl_version`` unless ``meta`` sets them."""
        meta = {"format": FORMAT_VERSION, "portrl_version": __version__, **dict(meta or {})}
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        final = self.path_for(step)  # re-saving a step (e.g. after a resume) replaces the old one
        with new_dir(final, tmp=self.root / f".tmp_{PREFIX}{int(step)}_{os.getpid()}",
                     aside=self.root / f".old_{PREFIX}{int(step)}_{os.getpid()}") as tmp:
            write_fn(tmp)
            write_manifest(tmp, step, meta)
        _fsync_dir(self.root)
        self._intact[final] = (final / MANIFEST).stat().st_mtime
        self._rotate(keep=final)
        log.info("checkpoint saved: %s", final)
        return final

    def save_reference(self, write_fn: Callable[[Path], object]) -> Dict[str, Any]:
        """Write the run's frozen reference policy once to ``<root>/reference`` (atomically, with its own manifest)
        and return what a checkpoint's ``meta.reference`` records: ``{"dir", "manifest_sha256", "manifest"}`` (the
        manifest itself, so that a damaged copy can be rebuilt and checked file by file). Checkpoints then pin it
        instead of each holding a copy; rotation never removes it."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / REFERENCE
        # an existing one is another run's (moved-aside runs take theirs along) or a damaged one
        with new_dir(final, tmp=self.root / f".tmp_{REFERENCE}_{os.getpid()}",
                     aside=self.root / f".old_{REFERENCE}_{os.getpid()}") as tmp:
            write_fn(tmp)
            manifest = write_manifest(tmp, 0, {"format": FORMAT_VERSION, "portrl_version": __version__,
                                               "kind": REFERENCE})
        _fsync_dir(self.root)
        return {"dir": REFERENCE, "manifest_sha256": sha256_file(final / MANIFEST), "manifest": manifest}

    def _remove_stale_temps(self) -> None:
        for p in self.root.iterdir():
            if p.is_dir() and (p.name.startswith(".tmp_") or p.name.startswith(".old_")):
                shutil.rmtree(p, ignore_errors=True)

    def _rotate(self, keep: Path) -> None:
        """Keep ``keep`` and the newest intact others (``max_to_keep`` in all); remove the rest."""
        kept = 1
        for _step, path in reversed(self.checkpoints()):
            if path == keep:
                continue
            if kept < self.max_to_keep and self._rotation_problem(path) is None:
                kept += 1
                continue
            shutil.rmtree(path, ignore_errors=True)
            self._intact.pop(path, None)
            log.info("checkpoint removed (max_to_keep=%d): %s", self.max_to_keep, path)

    # ----------------------------------------------------------------------------------- loading
    def latest_valid(self) -> Optional[Path]:
        """The newest checkpoint whose files match its manifest; bad ones are skipped with a warning."""
        for _step, path in reversed(self.checkpoints()):
            problem = resumable_problem(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
        return None

    def resolve_auto(self, identity: Optional[Dict[str, Any]] = None,
                     skip: Optional[Dict[Path, str]] = None) -> Optional[Path]:
        """``trainer.resume=auto``: the newest intact checkpoint (corrupt, partial or malformed ones skipped with
        a warning), checked by :func:`check_compatible`; None when there is no checkpoint at all. ``skip``: the
        checkpoints already found unusable as they loaded (:class:`UnusableCheckpoint`), with their problems, taken
        as not intact. Raises CheckpointError when checkpoints exist but none is intact (listing each with its
        problem), or when the newest intact one has another format or belongs to another run."""
        problems: List[str] = []
        for _step, path in reversed(self.checkpoints()):
            if skip and path in skip:  # its warning was logged when it failed to load
                problems.append(f"{path}: {skip[path]}")
                continue
            problem = resumable_problem(path)
            if problem is None:
                check_compatible(path, read_meta(path), identity)
                if problems:
                    log.warning("resuming from %s, the newest intact checkpoint", path)
                return path
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
            problems.append(f"{path}: {problem}")
        if problems:
            raise CheckpointError(
                f"trainer.resume=auto found no usable checkpoint in {self.root} ({'; '.join(problems)}); rather than "
                f"silently start over: repair or remove them, use a fresh trainer.output_dir, or "
                f"trainer.resume=off trainer.on_existing_run=move_aside")
        return None

    def resolve_resume(self, resume: str | os.PathLike | None,
                       identity: Optional[Dict[str, Any]] = None) -> Optional[Path]:
        """``"off"`` -> None; ``"auto"`` -> :meth:`resolve_auto`; a path -> that checkpoint, which must verify
        and be compatible (an error names what is wrong)."""
        if resume is None or str(resume) == "off":
            return None
        if str(resume) == "auto":
            path = self.resolve_auto(identity)
            if path is not None:
                log.info("resuming from %s", path)
            return path
        path = Path(os.path.expanduser(str(resume)))
        if not path.is_dir():
            raise CheckpointError(f"trainer.resume={resume}: no such checkpoint directory (use auto, off or a "
                                  f"{PREFIX}<step> directory)")
        problem = resumable_problem(path)
        if problem is not None:
            raise CheckpointError(f"trainer.resume={resume}: checkpoint is unusable: {problem}; use auto, off or "
                                  f"another {PREFIX}<step> directory")
        check_compatible(path, read_meta(path), identity)
        return path


__all__ = ["MANIFEST", "REFERENCE", "CheckpointManager", "CheckpointError", "UnusableCheckpoint", "check_compatible",
           "manifest_problem", "manifest_text", "open_checkpoint", "read_meta", "reference_damage", "reference_pin",
           "resumable_problem", "set_aside", "unusable", "verify", "write_manifest", "sha256_file"]
