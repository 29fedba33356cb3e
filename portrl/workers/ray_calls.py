"""Collecting the results of Ray actor calls, naming the worker that failed.

:func:`gather` waits on ``(group, rank, ObjectRef)`` items; ``group`` is anything with ``describe(rank)``
and ``shutdown()`` (a :class:`~portrl.workers.group.WorkerGroup`). Shared by the worker groups and the
weight-sync link, so neither imports the other for it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence


class WorkerDiedError(RuntimeError):
    """A worker process of a group died. ``worker`` names it (role, rank, node, pid); ``cause`` is Ray's error;
    ``checkpoint`` is the last good checkpoint, added by the controller with :meth:`with_checkpoint`."""

    def __init__(self, worker: str, cause: BaseException | str, checkpoint: Optional[str] = None):
        self.worker, self.cause, self.checkpoint = worker, cause, checkpoint
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        tail = (f"; resume from the last good checkpoint {checkpoint}" if checkpoint
                else "; no checkpoint was written yet" if checkpoint == "" else "")
        super().__init__(f"worker {worker} died ({type(cause).__name__}: {first}){tail}")

    def with_checkpoint(self, path: Optional[str]) -> "WorkerDiedError":
        """The same error with the last good checkpoint named (``None`` -> "no checkpoint was written yet")."""
        return WorkerDiedError(self.worker, self.cause, str(path) if path else "")


def gather(items: Sequence[tuple]) -> List[Any]:
    """Results of ``(group, rank, ObjectRef)`` items, in order. The first dead actor raises WorkerDiedError
    naming it (its group is shut down: the others' collectives cannot complete); the first failing call
    re-raises the worker's error with the worker named in a note."""
    import ray

    pending = {ref: i for i, (_, _, ref) in enumerate(items)}
    results: List[Any] = [None] * len(items)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            i = pending.pop(ref)
            group, rank, _ = items[i]
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                err = WorkerDiedError(group.describe(rank), exc)
                for g in {id(g): g for g, _, _ in items}.values():
                    g.shutdown()
                raise err from exc
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"raised by worker {group.describe(rank)}")
                raise
    return results
