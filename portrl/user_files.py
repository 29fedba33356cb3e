"""Files and folders written for the user: unique temporary names, ordinary permissions.

Outputs are written under a temporary name next to their final path and renamed into place when complete.
:func:`temp_name` makes that name unique (process id and a random part), so two processes writing the same
output never share a half-written file. :func:`ordinary_permissions` gives a file or folder what a plain
``open()`` / ``mkdir()`` would under the user's umask (usually 0644 / 0755): ``tempfile.mkstemp`` creates
0600 files and ``tempfile.mkdtemp`` 0700 folders, which other users of a shared machine or group could not read.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def temp_name(path: str | os.PathLike, suffix: str = "") -> Path:
    """A hidden, unique temporary path in ``path``'s folder: ``.<name>.tmp-<pid>-<random><suffix>``
    (``suffix`` keeps an extension a writer needs, e.g. ``.png`` for matplotlib)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}")


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (``os.umask`` must set one to read
    it, which another thread could see)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ordinary_permissions(path: str | os.PathLike) -> None:
    """chmod ``path`` to 0o666 (a file) or 0o777 (a folder) less the umask; a folder's contents are left as
    they are (a library writing into it creates them with ordinary permissions already)."""
    mode = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, mode & ~umask())


@contextmanager
def new_dir(out: str | os.PathLike, tmp: str | os.PathLike | None = None,
            aside: str | os.PathLike | None = None) -> Iterator[Path]:
    """``with new_dir(out) as tmp:`` fill the empty folder ``tmp`` (default a :func:`temp_name` beside ``out``;
    ordinary permissions). When the block ends without an error ``tmp`` replaces ``out`` (:func:`replace_dir`);
    otherwise it is removed. ``out`` is always the old folder or the complete new one, never a half-written one."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tmp) if tmp is not None else temp_name(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()  # mode 0o777 less the umask, unlike tempfile.mkdtemp's 0o700
    try:
        yield tmp
        replace_dir(tmp, out, aside)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike, aside: str | os.PathLike | None = None) -> None:
    """Put the complete folder ``tmp`` at ``out``. An existing ``out`` is renamed to ``aside`` (default a
    :func:`temp_name` beside it) first and removed after, so ``out`` is never half-written: it is missing only
    between two renames on one filesystem."""
    tmp, out = Path(tmp), Path(out)
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(aside) if aside is not None else temp_name(out, ".old")
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
