"""Who owns ``trainer.output_dir``: continue this run, start a fresh one, or refuse; never mix two runs.

:func:`prepare_run_dir` runs at the start of ``fit()`` (its refusals, changing nothing and computing no
checksum, also run in ``portrl train``'s preflight before any model loads: :func:`check_run_dir`) and decides,
from ``trainer.resume``, ``trainer.on_existing_run`` and what the directory holds (``run.json``,
``metrics.jsonl``, checkpoints, an exported model), where the run starts:

* ``resume=auto``: the newest intact checkpoint of *this* run (same identity, see
  :mod:`portrl.trainer.run_identity`); none yet -> a fresh start. A directory of a different run (its
  ``run.json`` or its checkpoints record another identity), or one holding a run of unknown identity
  (files but no ``run.json``), is refused with the differing keys; when every checkpoint is unusable the
  error lists them (CheckpointManager.resolve_auto).
* ``resume=off``: a fresh start, into a directory that holds no earlier run; one that does is refused.

A fresh start (either way) into a directory holding anything a run does not write (:data:`RUN_ENTRIES`: a user's
notes, a project checkout) is refused too: a run's files are never mixed with the user's.
* ``resume=PATH``: that checkpoint, which must be of this run (and, inside this run's folder, its newest: a
  continuation from an older one would be mixed with the newer ones).

A checkpoint is taken on its own files: the run's reference copy (``checkpoints/reference``, one for every
checkpoint) is checked, and rebuilt when damaged or missing, as the checkpoint loads
(:mod:`portrl.trainer.reference_repair`), so neither this decision nor :func:`check_run_dir` refuses a run for it.

``on_existing_run=move_aside`` (default ``refuse``) turns each refusal because of an earlier run into moving
that run's directory to ``<output_dir>.old-<YYYYmmdd-HHMMSS>`` (nothing deleted) and starting fresh.

An earlier run with nothing to resume and no result (:func:`nothing_to_keep_in_place`: its ``run.json`` but no
checkpoint, no ``hf_model``, ``plots`` or ``sft`` model, and nothing but a run's files: a run stopped before its
first checkpoint) blocks nothing: where it would be refused, it is moved aside as with ``move_aside`` and one
warning line says so and names where it went.
A trainer object that calls ``fit()`` again (``own_run_id``) continues the run it started itself.

Nothing in the directory is changed before the decision; a fresh start writes ``run.json`` only where none
is (``metrics.jsonl`` is rewritten by the Tracker only when the run logs its first step).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from portrl import outputs
from portrl.trainer.checkpoint import CheckpointError, CheckpointManager, _load_manifest, check_compatible
from portrl.trainer.run_identity import RUN_FILE, identity_diff, read_run_record, run_identity, write_run_record

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

log = logging.getLogger(__name__)

ON_EXISTING = outputs.ON_EXISTING
#: what marks a directory as holding a run (besides checkpoints)
RUN_MARKERS = (RUN_FILE, "metrics.jsonl", "hf_model")
#: what else a run (or ``portrl sft``'s default output, ``<output_dir>/sft``) writes there; a fresh start refuses a
#: folder holding anything but these (a user's files are not mixed with a run's)
RUN_ENTRIES = (*RUN_MARKERS, "checkpoints", "plots", "tensorboard", "wandb", "mlruns", "sft", "traces.jsonl")
_TEMP = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]{8}")  # portrl.user_files.temp_name, left by a killed writer


def run_contents(out_dir: Path, ckpt: CheckpointManager) -> List[str]:
    """The run files ``out_dir`` holds, for messages (``["run.json", "metrics.jsonl", "2 checkpoints"]``)."""
    found = [name for name in RUN_MARKERS if (out_dir / name).exists()]
    n = len(ckpt.checkpoints())
    if n:
        found.append(f"{n} checkpoint{'s' if n > 1 else ''}")
    return found


def foreign_entries(out_dir: Path) -> List[str]:
    """The entries of ``out_dir`` that no run writes (sorted; none when it does not exist)."""
    if not out_dir.is_dir():
        return []
    return sorted(e.name for e in out_dir.iterdir() if e.name not in RUN_ENTRIES and not _TEMP.match(e.name))


def move_aside(out_dir: Path, announce: bool = True) -> Path:
    """Rename ``out_dir`` to ``<out_dir>.old-<time>`` (portrl.outputs.move_aside); recreate it empty."""
    target = outputs.move_aside(out_dir, announce)
    out_dir.mkdir(parents=True, exist_ok=True)
    return target


#: what a run writes only when it finished (or that is a trained model of its own): never moved unasked
RESULTS = ("hf_model", "plots", "sft")


def nothing_to_keep_in_place(out_dir: Path, ckpt: CheckpointManager) -> bool:
    """``out_dir`` holds a run that recorded itself (``run.json``) and has nothing to resume and no result: no
    checkpoint (intact or not), none of :data:`RESULTS`, nothing but a run's files (a run stopped before its first
    checkpoint). Such a folder is moved aside for a new run instead of refusing it."""
    return ((out_dir / RUN_FILE).is_file() and not ckpt.checkpoints() and not foreign_entries(out_dir)
            and not any(os.path.lexists(out_dir / name) for name in RESULTS))


def take_over(out_dir: Path, ckpt: CheckpointManager) -> Path:
    """Move aside the run in ``out_dir`` that has nothing to keep in place (:func:`nothing_to_keep_in_place`) for a
    new run, saying so in one warning line that names where it went; returns that place."""
    held = ", ".join(run_contents(out_dir, ckpt))
    target = move_aside(out_dir, announce=False)
    log.warning("trainer.output_dir=%s held an earlier run with no checkpoint to resume (%s): moved to %s (nothing "
                "deleted); this run starts in %s", out_dir, held, target, out_dir)
    return target


def _refuse(out_dir: Path, why: str, resume: str) -> CheckpointError:
    cont = " or trainer.resume=auto to continue it" if resume == "off" else ""
    return CheckpointError(
        f"trainer.output_dir={out_dir} {why}; nothing there is overwritten or mixed: use a fresh "
        f"trainer.output_dir{cont}, or trainer.on_existing_run=move_aside to move it to "
        f"{out_dir.name}.old-<time> and start a new run")


def prepare_run_dir(cfg: PortRLConfig, out_dir: Path, ckpt: CheckpointManager, identity: Dict[str, Any],
                    own_run_id: Optional[str] = None, dry_run: bool = False) -> Tuple[Optional[Path], Dict[str, Any]]:
    """``(checkpoint to resume from or None, the run record)`` (see the module docstring). Raises CheckpointError.
    ``dry_run``: only the refusals, changing nothing and reading manifests without checksums (see
    :func:`check_run_dir`); returns ``(None, {})``."""
    t = cfg.trainer
    resume = str(t.resume)
    on_existing = str(getattr(t, "on_existing_run", "refuse") or "refuse")
    if on_existing not in ON_EXISTING:
        raise CheckpointError(f"trainer.on_existing_run={on_existing!r} is not valid; valid: {', '.join(ON_EXISTING)}")
    out_dir = Path(out_dir)
    rec = read_run_record(out_dir)
    if rec and own_run_id is not None and rec.get("run_id") == own_run_id:  # fit() again on the same trainer
        return (ckpt.resolve_resume(resume, identity) if resume != "off" else None), rec

    class _MovedAside(Exception):
        pass

    def aside_or_refuse(why: str) -> None:
        nonlocal rec
        stopped = nothing_to_keep_in_place(out_dir, ckpt)
        if on_existing != "move_aside" and not stopped:
            raise _refuse(out_dir, why, resume)
        if dry_run:
            raise _MovedAside
        if on_existing == "move_aside":
            move_aside(out_dir)
        else:
            take_over(out_dir, ckpt)  # a run stopped before its first checkpoint: said in one line
        rec = None

    def refuse_foreign() -> None:  # a fresh start into a folder of the user's own files
        foreign = foreign_entries(out_dir)
        if foreign:
            more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            aside_or_refuse(f"holds files that are not a portrl run ({', '.join(foreign[:3])}{more})")

    try:
        if resume == "off":
            held = run_contents(out_dir, ckpt)
            if held:
                aside_or_refuse(f"holds an earlier run ({', '.join(held)}) and trainer.resume=off starts a new one")
            else:
                refuse_foreign()
            path = None
        else:
            if rec == {}:
                aside_or_refuse(f"holds a run whose {RUN_FILE} is unreadable")
            elif rec is not None:
                diff = identity_diff(rec["identity"], identity)
                if diff:
                    aside_or_refuse(f"holds a different run ({'; '.join(diff)})")
            elif run_contents(out_dir, ckpt) and not ckpt.checkpoints():
                aside_or_refuse(f"holds a run of unknown identity ({', '.join(run_contents(out_dir, ckpt))}; "
                                f"no {RUN_FILE})")
            elif not ckpt.checkpoints():
                refuse_foreign()
            if resume != "auto":
                _check_no_newer(ckpt, Path(os.path.expanduser(resume)))
            if dry_run:
                _check_newest_manifest(ckpt, resume, identity, on_existing == "move_aside" and rec is None)
                return None, {}
            try:
                path = ckpt.resolve_resume(resume, identity)
            except CheckpointError as exc:
                foreign = "different run" in str(exc)
                if rec is not None or resume != "auto" or on_existing != "move_aside" or not foreign:
                    raise
                move_aside(out_dir)  # the checkpoints of another run (no run.json): moved with their directory
                path = None
            if path is None and rec is not None:
                log.info("no checkpoint of this run in %s yet: starting it from the beginning", ckpt.root)
    except _MovedAside:
        return None, {}
    if dry_run:
        return None, {}
    if rec is None:
        rec = write_run_record(out_dir, identity)
    return path, rec


def _check_no_newer(ckpt: CheckpointManager, path: Path) -> None:
    """``resume=PATH`` to an older checkpoint of this run's own folder: its newer checkpoints would later be taken
    for the continuation (resume=auto picks the highest step) or be rotated away; refuse instead of mixing them."""
    try:
        if not path.is_dir() or path.resolve().parent != ckpt.root.resolve():
            return
    except OSError:
        return
    mine = [s for s, p in ckpt.checkpoints() if p.resolve() == path.resolve()]
    newer = [p.name for s, p in ckpt.checkpoints() if mine and s > mine[0]]
    if newer:
        raise CheckpointError(
            f"trainer.resume={path}: this run has newer checkpoints ({', '.join(newer)}), which a continuation from "
            f"{path.name} would be mixed with; continue it in a fresh trainer.output_dir (keep trainer.resume={path}), "
            f"or move the newer ones out of {ckpt.root} first")


def _check_newest_manifest(ckpt: CheckpointManager, resume: str, identity: Dict[str, Any], may_move: bool) -> None:
    """The format and identity of the checkpoint a resume would start from, read from its manifest alone."""
    if resume != "auto":
        path = Path(os.path.expanduser(resume))
        manifest, problem = _load_manifest(path) if path.is_dir() else (None, "no such directory")
        if manifest is not None:
            check_compatible(path, manifest, identity)
        return
    for _step, path in reversed(ckpt.checkpoints()):
        manifest, problem = _load_manifest(path)
        if manifest is None:
            continue
        try:
            check_compatible(path, manifest, identity)
        except CheckpointError as exc:
            if not (may_move and "different run" in str(exc)):
                raise
        return


def check_run_dir(cfg: PortRLConfig) -> None:
    """What :func:`prepare_run_dir` would refuse for ``cfg`` (another run's folder, ``resume=off`` into a run, an
    old-format or foreign checkpoint, a bad ``trainer.on_existing_run``), found before any model loads: nothing
    is changed and no checksum is computed (``fit()`` verifies them). Raises CheckpointError."""
    out_dir = Path(os.path.expanduser(str(cfg.trainer.output_dir)))
    ckpt = CheckpointManager(out_dir / "checkpoints", max_to_keep=max(1, int(cfg.trainer.max_ckpt_to_keep)))
    prepare_run_dir(cfg, out_dir, ckpt, run_identity(cfg), dry_run=True)


__all__ = ["ON_EXISTING", "RESULTS", "RUN_ENTRIES", "check_run_dir", "foreign_entries", "move_aside",
           "nothing_to_keep_in_place", "prepare_run_dir", "run_contents", "take_over"]
