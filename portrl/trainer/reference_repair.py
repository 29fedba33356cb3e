"""A run's damaged or missing reference copy (``<output_dir>/checkpoints/reference``), rebuilt under its pin.

Every checkpoint of a run pins the one reference copy by the sha256 of its manifest (``meta.reference``, see
:mod:`portrl.trainer.checkpoint`). When that copy is damaged or gone, :func:`restore_reference` writes it again
with the caller's ``write_fn`` (for an RL run: the policy the run starts from, frozen as a fresh start freezes
it, see :mod:`portrl.trainer.run_checkpoints`) into a temporary folder beside it and checks it against the pin
before anything uses it: every file the pinned manifest lists must come out with its size and sha256, nothing
else may, and the manifest written beside them (the pinned one, byte for byte: kept in the checkpoint's
``meta.reference.manifest``, or the copy's own manifest while that still has the pinned sha256) must have the
pinned sha256. Only then is the damaged copy renamed to ``reference.damaged-<YYYYmmdd-HHMMSS>`` (kept, never
deleted) and the rebuilt one renamed into its place.

When the source no longer gives the same bytes (another weights file at ``model.path``; a policy after an SFT
warm start, which no model file holds), or nothing can check a rebuild (the pin of a checkpoint written before
it held the manifest, and that manifest lost), nothing is changed and a CheckpointError says, in one line,
which file is damaged and how to recover.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from portrl.trainer.checkpoint import MANIFEST, CheckpointError, _fsync_dir, manifest_text, reference_damage, \
    set_aside, sha256_file
from portrl.user_files import temp_name

log = logging.getLogger(__name__)


def _pinned_manifest(rdir: Path, pin: Dict[str, Any]) -> Optional[bytes]:
    """The bytes of the manifest ``pin`` names (their sha256 is ``pin["manifest_sha256"]``), or None when neither
    the pin's own copy nor the one in ``rdir`` gives them."""
    kept = pin.get("manifest")
    if isinstance(kept, dict):
        text = manifest_text(kept).encode()
        if hashlib.sha256(text).hexdigest() == pin["manifest_sha256"]:
            return text
    mpath = rdir / MANIFEST
    if mpath.is_file():
        data = mpath.read_bytes()
        if hashlib.sha256(data).hexdigest() == pin["manifest_sha256"]:
            return data
    return None


def _rebuild_differs(folder: Path, files: Dict[str, dict]) -> Optional[str]:
    """What of the rebuilt ``folder`` differs from the pinned manifest's ``files`` (None: every file matches);
    each file is flushed to disk as it is checked."""
    written = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    extra = [rel for rel in written if rel not in files]
    if extra:
        return f"the rebuild writes {extra[0]}, which the pinned copy does not hold"
    for rel, want in files.items():
        p = folder / rel
        if not p.is_file():
            return f"the rebuild writes no {rel}"
        with open(p, "rb") as fh:
            os.fsync(fh.fileno())
        if p.stat().st_size != want["size"] or sha256_file(p) != want["sha256"]:
            return f"the rebuilt {rel} differs from the pinned one"
    return None


def restore_reference(root: Path, pin: Dict[str, Any], write_fn: Callable[[Path], None], source: str,
                      why_not: str = "") -> Optional[Path]:
    """Make the reference copy ``pin`` (a checkpoint's ``meta.reference``) names in ``root`` (the checkpoints'
    folder) intact. Already intact: nothing is written, returns None. Otherwise ``write_fn(folder)`` rebuilds its
    files, which must match the pin (see the module docstring) before the damaged copy is set aside and the
    rebuilt one put in its place; returns where the damaged copy is kept (None when it was missing). ``source``
    names where the rebuild comes from (``model.path=...``) and ``why_not`` adds why it may not give the same
    bytes, for the error. Raises CheckpointError (one line), with nothing in ``root`` changed."""
    root = Path(root)
    damage = reference_damage(root, pin)
    if damage is None:
        return None
    bad, what = damage
    rdir = root / pin["dir"]
    found = f"the run's reference model is damaged: {bad} {what}"
    recover = f"restore {bad} from a backup, or start a new run (a new trainer.output_dir)"
    want = _pinned_manifest(rdir, pin)
    if want is None:
        raise CheckpointError(f"{found}; its checkpoints pin it by the sha256 of its manifest alone (written by an "
                              f"older portrl), so a rebuilt copy cannot be checked: {recover}")
    tmp = temp_name(rdir)
    aside = None
    try:
        tmp.mkdir()
        write_fn(tmp)
        differs = _rebuild_differs(tmp, json.loads(want)["files"])
        if differs is not None:
            raise CheckpointError(f"{found}, and {source} no longer gives the same one ({differs}){why_not}: {recover}")
        with open(tmp / MANIFEST, "wb") as fh:
            fh.write(want)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.lexists(rdir):
            aside = set_aside(rdir, "damaged")
        try:
            os.replace(tmp, rdir)
        except OSError:
            if aside is not None:  # back where it was: nothing changed
                os.replace(aside, rdir)
            raise
        _fsync_dir(root)
    except OSError as exc:
        raise CheckpointError(f"{found}, and writing a rebuilt copy failed ({exc}): {recover}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.warning("%s; rebuilt it from %s (every file matches the sha256 its checkpoints pin)%s", found, source,
                f", the damaged copy kept as {aside}" if aside is not None else "")
    return aside


__all__ = ["restore_reference"]
