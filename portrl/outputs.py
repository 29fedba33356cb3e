"""Where a command writes: it claims each output path first, and never replaces what it did not write.

Every ``portrl`` command that writes where the user points it (``sft --output``, ``eval --report``,
``preprocess --output-dir``, ``plot``, ``parity ... --report / --output``) claims each path it will write with
:func:`claim` before any work starts (``portrl train`` does the same for ``trainer.output_dir`` in
portrl.trainer.run_dir, which also resumes its own run):

* a path that does not exist, or an empty folder, is free;
* an existing file, or a folder with anything in it, is refused with one line (:class:`OutputExists`, a
  UserError: exit 2) naming the path, the flag and the two ways on: another path, or
  ``--on-existing move_aside``, which renames the existing one to ``<name>.old-<YYYYmmdd-HHMMSS>`` beside it
  (:func:`move_aside`; nothing is deleted);
* ``ours(path)`` (optional) marks an existing file as this command's own earlier output (``portrl plot``'s
  PNGs carry a marker), which may be rewritten.

The result is written under a temporary name and published with :func:`publish`, which never replaces an
existing path: a file or folder that appeared while the command ran (a second run given the same path) is kept,
and the new result is published beside it as ``<name>.new-<time>`` with a warning.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

from portrl.errors import UserError

log = logging.getLogger(__name__)

#: ``--on-existing`` (and ``trainer.on_existing_run``): what to do with an output path that holds something
ON_EXISTING = ("refuse", "move_aside")


class OutputExists(UserError):
    """An output path already holds a file or a non-empty folder that this command did not write."""


def add_on_existing_argument(parser) -> None:
    """``--on-existing {refuse,move_aside}`` on an argparse parser."""
    parser.add_argument("--on-existing", choices=ON_EXISTING, default="refuse",
                        help="an output path that already holds something: refuse (default) or move_aside "
                             "(rename it to <name>.old-<time>; nothing is deleted)")


def holds_something(path: Path) -> bool:
    """``path`` is a file (or a link, or anything but a folder), or a folder with at least one entry."""
    if not os.path.lexists(path):
        return False
    if path.is_symlink() or not path.is_dir():
        return True
    with os.scandir(path) as entries:
        return next(entries, None) is not None


def sibling_name(path: Path, tag: str) -> Path:
    """``<name>.<tag>-<YYYYmmdd-HHMMSS>`` beside ``path`` (``-2``, ``-3`` ... added while that is taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.{tag}-{stamp}")
    n = 1
    while os.path.lexists(target):
        n += 1
        target = path.with_name(f"{path.name}.{tag}-{stamp}-{n}")
    return target


def move_aside(path: str | os.PathLike, announce: bool = True) -> Path:
    """Rename ``path`` (a file or a folder) to ``<name>.old-<time>`` beside it; returns the new name. A folder that
    cannot be renamed (a mount point, the working directory) keeps its place and its entries move instead.
    ``announce``: log a warning naming both (False: the caller says it in its own line)."""
    path = Path(path)
    target = sibling_name(path, "old")
    try:
        os.rename(path, target)
    except OSError:
        if not path.is_dir() or path.is_symlink():
            raise
        target.mkdir()
        for entry in path.iterdir():
            os.rename(entry, target / entry.name)
    if announce:
        log.warning("the earlier %s moved to %s (nothing deleted)", path, target)
    return target


def claim(path: str | os.PathLike, flag: str, on_existing: str = "refuse",
          ours: Optional[Callable[[Path], bool]] = None) -> Path:
    """Make ``path`` free for a new output, or raise :class:`OutputExists` (see the module docstring). ``flag``
    names where the path came from in messages (``--output``, ``trainer.output_dir``, ...)."""
    path = Path(os.path.expanduser(str(path)))
    if on_existing not in ON_EXISTING:
        raise UserError(f"--on-existing {on_existing!r} is not valid; valid: {', '.join(ON_EXISTING)}")
    if not holds_something(path) or (ours is not None and path.is_file() and ours(path)):
        return path
    if on_existing == "move_aside":
        move_aside(path)
        return path
    what = "a non-empty folder" if path.is_dir() and not path.is_symlink() else "an existing file"
    raise OutputExists(f"{flag} {path} is {what} that this command did not write; portrl never overwrites or deletes "
                       f"it: give a new path, or --on-existing move_aside to rename it to {path.name}.old-<time>")


def _link_or_rename(tmp: Path, path: Path) -> None:
    """A file to ``path`` only if nothing is there: a hard link fails on an existing path (no check-then-replace
    race); a filesystem without hard links gets the check and a rename."""
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Rename the complete ``tmp`` (a file or a folder) to ``path`` unless something is there now (an empty folder
    is replaced); then to ``<name>.new-<time>`` beside it, with a warning. Returns where it went."""
    tmp, path = Path(tmp), Path(path)
    try:
        if tmp.is_dir():
            os.rename(tmp, path)  # replaces only an empty folder (ENOTEMPTY / EEXIST otherwise)
        else:
            _link_or_rename(tmp, path)
        return path
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
    beside = sibling_name(path, "new")
    os.rename(tmp, beside)
    log.warning("%s appeared while this command ran and is kept; the new output is %s", path, beside)
    return beside


__all__ = ["ON_EXISTING", "OutputExists", "add_on_existing_argument", "claim", "holds_something", "move_aside",
           "publish", "sibling_name"]
