"""A run that cannot write its files (disk full, quota, read-only or forbidden folder) stops with one line.

Checkpoints are written under a temporary name and renamed only when complete
(portrl.trainer.checkpoint), so a write that fails leaves every earlier checkpoint intact; what the user
needs is the cause and where to continue from. :func:`storage_error` finds the ``OSError`` behind an exception
(also one raised in a Ray worker, which arrives wrapped, its cause kept) when its errno is one of
:data:`STORAGE_ERRNOS`, and :func:`storage_stopped_message` says, on one line, what could not be written, why,
after which step, and the last intact checkpoint (or that there is none).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Optional

from portrl.trainer.fault_chain import exception_chain, run_stopped_message

#: errno -> what it means for the run's folder
STORAGE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "the file is larger than allowed (ulimit -f)",
}


#: how Rust's std::io::Error shows an errno in a message (safetensors raises SafetensorError with it, not OSError)
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def storage_error(exc: BaseException) -> Optional[OSError]:
    """The OSError with a :data:`STORAGE_ERRNOS` errno that caused ``exc`` (itself, its ``__cause__`` /
    ``__context__`` chain, or a Ray task error's ``cause``), else None. An exception of a library written in Rust
    whose message ends in ``(os error N)`` (safetensors' writer) counts as that OSError, without a file name."""
    for e in exception_chain(exc):
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        found = None if isinstance(e, OSError) else _RUST_OS_ERROR.search(str(e))
        if found and int(found.group(1)) in STORAGE_ERRNOS:
            return OSError(int(found.group(1)), os.strerror(int(found.group(1))))
    return None


def storage_stopped_message(err: OSError, step: int, total: int, checkpoint: Optional[Path]) -> str:
    """One line: what could not be written and why, after which step, and where the run continues from."""
    what = f" {err.filename}" if err.filename else ""
    assert err.errno is not None  # storage_fault() returns only errors with a STORAGE_ERRNOS errno
    cause = f"cannot write{what}: {STORAGE_ERRNOS[err.errno]} ({err.strerror or errno.errorcode[err.errno]})"
    return run_stopped_message(cause, step, total, checkpoint)


__all__ = ["STORAGE_ERRNOS", "storage_error", "storage_stopped_message"]
