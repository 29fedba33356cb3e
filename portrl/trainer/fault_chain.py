"""What a run that stopped on a fault of its environment says: the exception behind another one, and the line.

A fault (a full disk, a tool's sandbox that stopped working) reaches the trainer wrapped: as the ``__cause__`` or
``__context__`` of another exception, or as a Ray task error's ``cause`` when it happened in a worker.
:func:`exception_chain` walks all of them; :func:`run_stopped_message` is the one line such a run ends with
(portrl/trainer/storage_faults.py, portrl/trainer/run_end.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it (``__cause__``, ``__context__``, a Ray task error's ``cause``), each
    once."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__, getattr(e, "cause", None)) if isinstance(x, BaseException))


def run_stopped_message(cause: str, step: int, total: int, checkpoint: Optional[Path]) -> str:
    """One line: ``cause``, after which step, and where the run continues from (``checkpoint``: the last intact)."""
    when = f"after step {step} of {total}" if step else "before step 1"
    if checkpoint is None:
        return f"the run stopped {when}: {cause}; no checkpoint was written yet: fix that, then rerun the same command"
    return (f"the run stopped {when}: {cause}; the last good checkpoint is {checkpoint} (intact): fix that, then "
            "rerun the same command with trainer.resume=auto to continue from it")
